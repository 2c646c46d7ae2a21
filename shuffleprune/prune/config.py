"""``PruneConfig``: everything that determines a pruning run, with its stage list as data.

Build one with :meth:`PruneConfig.build` from a recipe (preset name or YAML file) plus explicit
options, which override the recipe's values; the options keep the command line's names
(``method`` = ``--base``, ``perm``, ``perm_steps``, ``mask_stats`` …) so that every flag maps to
one stage parameter (:data:`STAGE_OPTIONS`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from shuffleprune.calib.files import TEXT_FILES
from shuffleprune.calib.sampling import check_bos_mode
from shuffleprune.errors import UserError, check_values, given_path
from shuffleprune.masks import parse_pattern
from shuffleprune.models import dtype_name
from shuffleprune.prune.recipes import (DEFAULT_RECIPE, RUN_KEYS_NOT_IN_RECIPES, StageKeyError, check_stage_entry,
                                        dump_recipe, is_recipe_file, load_recipe)
from shuffleprune.prune.registry import kind_of, stage_class, stage_from_entry
from shuffleprune.prune.stage import KINDS, RunSpec, Stage
from shuffleprune.runtime.determinism import check_seed
from shuffleprune.settings import type_problem


@dataclass
class PruneConfig:
    """A pruning run: the model, the data and evaluation settings, and the effective stage list."""

    model: str | None = None
    recipe: str = DEFAULT_RECIPE       # where the stages came from (a preset name or a file name)
    stages: list[dict] = field(default_factory=list)   # effective recipe entries, {kind: name, param: value}
    pattern: str | None = "2:4"
    sparsity: float | None = None
    calib: str = "wiki"
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    only: list[str] | None = None
    skip: list[str] | None = None
    dtype: str = "auto"
    eval_text: str | None = "auto"     # None: no perplexity
    eval_ctx: int | None = None        # default: the calibration seqlen
    eval_tokens: int | None = None     # cap on held-out tokens (default: all of them)
    bos: str = "window"                # BOS of tokenizers that add one: every window | each text's start (the papers')
    device: str = "auto"
    batch_size: int = 8                # calibration windows per block forward
    tf32: bool = False                 # allow TF32 matmuls on CUDA (faster permutation learning)
    deterministic: bool = False        # PyTorch's deterministic algorithms: a GPU run repeats bit for bit
    trust_remote_code: bool = False    # run the model code a checkpoint ships (auto_map), as transformers' flag

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def build(cls, recipe: str | Path | None = None, overrides: list[str] | None = None, **options: Any) -> "PruneConfig":
        """The config of ``recipe`` (default :data:`DEFAULT_RECIPE`) with ``options`` applied on top:
        run settings by field name, stage choices and parameters by their flag names
        (:data:`STAGE_OPTIONS`), and ``overrides`` as ``kind=name`` / ``kind.param=value`` strings
        (``--set``). A stage option given as ``None`` means "not given"; a run setting given as ``None`` is
        applied (callers leave out what they do not set). The result's stages are complete: ``auto``
        statistics resolved, every parameter filled in."""
        base = load_recipe(recipe if recipe is not None else DEFAULT_RECIPE, check_run_setting)
        stages = [dict(s) for s in base.pop("stages")]
        label = base.pop("recipe", str(recipe or DEFAULT_RECIPE))
        base.pop("about", None)
        run = dict(base)
        stage_opts = {k: options.pop(k) for k in list(options) if k in STAGE_OPTIONS}
        unknown = [k for k in options if k not in _FIELDS]
        if unknown:
            raise UserError(f"unknown prune option(s) {', '.join(unknown)}{_option_hint(unknown)}")
        if options.get("pattern") is not None:
            if options.get("sparsity") is not None:
                raise UserError(f"give --pattern {options['pattern']} (N:M) or --sparsity {options['sparsity']} "
                                "(unstructured), not both")
            run["sparsity"] = None  # an N:M pattern given replaces a recipe's unstructured sparsity
        options.update({k: list(v) for k, v in options.items() if isinstance(v, tuple)})   # only=("a", "b")
        if options.get("dtype") is not None:
            options["dtype"] = dtype_name(options["dtype"])   # dtype=torch.bfloat16 as the name it is recorded by
        if isinstance(options.get("device"), torch.device):
            options["device"] = str(options["device"])   # device=torch.device("cuda", 1) as "cuda:1"
        for key, value in options.items():   # the Python API's values, typed as a recipe file's are
            problem = _type_problem(key, value)
            if problem is not None:
                raise UserError(problem)
        run.update(options)  # a run setting given as None is applied (eval_text=None: no perplexity)
        if isinstance(run.get("eval_text"), str) and run["eval_text"].lower() == "none":
            run["eval_text"] = None   # the command line's spelling, in Python and recipe files too
        if "sparsity" in run and run["sparsity"] is not None:
            run["pattern"] = None
        config = cls(recipe=label, **run)
        config.check_sizes()
        explicit_perm = any(v is not None and STAGE_OPTIONS[k][0] == "permutation" for k, v in stage_opts.items()) \
            or any(o.startswith("permutation") for o in overrides or [])
        config.stages = _resolve(_apply(stages, stage_opts, overrides or []), config,
                                 drop_perm=not is_recipe_file(recipe or DEFAULT_RECIPE) and not explicit_perm)
        config.spec()  # every stage checks its parameters now, before anything is loaded
        return config

    def check_sizes(self) -> None:
        """Refuse counts and lengths no run can use (before anything is loaded)."""
        check_values(("--nsamples", self.nsamples, self.nsamples >= 1, ">= 1"),
                     ("--seqlen", self.seqlen, self.seqlen >= 2, ">= 2 (a window predicts seqlen − 1 tokens)"),
                     ("--batch-size", self.batch_size, self.batch_size >= 1, ">= 1"))
        check_seed(self.seed)
        check_values(("--eval-ctx", self.eval_ctx, self.eval_ctx is None or self.eval_ctx >= 2,
                      ">= 2 (a perplexity window predicts ctx − 1 tokens)"),
                     ("--eval-tokens", self.eval_tokens, self.eval_tokens is None or self.eval_tokens >= 1,
                      ">= 1 (leave it out to score all of the text)"))
        check_bos_mode(self.bos, "--bos")

    # -- reading ----------------------------------------------------------------------------------
    def stage_objects(self) -> list[Stage]:
        """The stage instances, in recipe order."""
        return [stage_from_entry(entry) for entry in self.stages]

    def spec(self) -> RunSpec:
        """The run as the stages check it (each stage's ``check`` runs here)."""
        spec = RunSpec(pattern=parse_pattern(self.pattern, self.sparsity), stages=self.stage_objects(),
                       nsamples=self.nsamples)
        for stage in spec.stages:
            stage.check(spec)
        return spec

    def stage_labels(self) -> list[str]:
        """``kind:name`` of each stage, in order (e.g. ``statistics:sequential``)."""
        return [f"{kind_of(e)}:{e[kind_of(e)]}" for e in self.stages]

    def stage_name(self, kind: str) -> str | None:
        return next((e[kind] for e in self.stages if kind in e), None)

    @property
    def method(self) -> str:
        """The prune stage's method (``--base``)."""
        return self.stage_name("prune")

    def key(self) -> str:
        """Fingerprint of every setting that determines the result (a ``--resume`` must match it)."""
        fixed = {k: v for k, v in asdict(self).items() if k not in ("device", "batch_size", "recipe", "deterministic",
                                                                    "trust_remote_code")}
        return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]

    def effective_recipe(self) -> dict[str, Any]:
        """This run as a recipe: every setting but the model and device, then the stages."""
        out = {"recipe": self.recipe}
        out.update({k: v for k, v in asdict(self).items() if k not in RUN_KEYS_NOT_IN_RECIPES + ("recipe", "stages")})
        out["stages"] = [dict(s) for s in self.stages]
        return out

    def to_yaml(self) -> str:
        from shuffleprune.version import __version__

        head = (f"# shuffleprune {__version__} recipe: repeat this run with\n"
                f"#   shuffleprune prune MODEL --recipe recipe.yaml\n")
        return head + dump_recipe(self.effective_recipe())


_FIELDS = {f.name for f in dataclasses.fields(PruneConfig)} - {"stages", "recipe"}

# flag name -> (stage kind, parameter); parameter None: the flag picks the stage itself
STAGE_OPTIONS: dict[str, tuple[str, str | None]] = {
    "method": ("prune", None), "perm": ("permutation", None), "mask_stats": ("statistics", None),
    "perm_from": ("permutation", "path"), "recon": ("permutation", "recon"), "perm_init": ("permutation", "init"),
    "perm_loss": ("permutation", "loss"), "relax": ("permutation", "relax"), "perm_block": ("permutation", "block"),
    "perm_steps": ("permutation", "steps"), "perm_lr": ("permutation", "lr"),
    "perm_lr_decay": ("permutation", "lr_decay"), "perm_lambda": ("permutation", "lambda_max"),
    "perm_share": ("permutation", "share"), "perm_batch": ("permutation", "batch"),
    "perm_holdout": ("permutation", "holdout"),
}


def check_run_setting(key: str, value: Any) -> str | None:
    """Why ``key: value`` is not a valid run setting of a recipe file (None when it is)."""
    if key not in _FIELDS or key in RUN_KEYS_NOT_IN_RECIPES:
        allowed = ", ".join(sorted(_FIELDS - set(RUN_KEYS_NOT_IN_RECIPES)))
        return f"unknown key '{key}' (a recipe has 'recipe', 'stages' and run settings: {allowed})"
    return _type_problem(key, value)


_CLI_NAMES = {"base": "method"}   # the command line's --base is the Python API's method=


def _option_hint(unknown: list[str]) -> str:
    """The options the unknown ones may have meant (``nsample`` → ``nsamples``, ``base`` → ``method``)."""
    import difflib

    names = sorted((_FIELDS - {"model"}) | set(STAGE_OPTIONS))   # model is prune()'s first argument
    meant = {k: _CLI_NAMES.get(k) or next(iter(difflib.get_close_matches(k, names, n=1)), None) for k in unknown}
    pairs = [f"{v}= for {k}" for k, v in meant.items() if v]
    return f"; did you mean {', '.join(pairs)}?" if pairs else f" (options: {', '.join(names)})"


_TEXT_KEYS = ("calib", "eval_text")


def _type_problem(key: str, value: Any) -> str | None:
    """Why ``value`` does not fit the type of run setting ``key`` (None when it does); a text given
    as documents is told how to pass them."""
    problem = type_problem(PruneConfig, key, value)
    if problem is not None and key in _TEXT_KEYS and not isinstance(value, str):
        problem += (f" (a source name, a hub dataset or a {TEXT_FILES} path; documents in memory go to "
                    "shuffleprune.prune(calib=[...]))")
    return problem


def _index(stages: list[dict], kind: str) -> int | None:
    return next((i for i, s in enumerate(stages) if kind in s), None)


def _apply(stages: list[dict], options: dict[str, Any], overrides: list[str]) -> list[dict]:
    """Stage choices first (``--base``, ``--perm``, ``--mask-stats``, ``--perm-from``, ``kind=name``),
    then parameters (``--perm-steps`` …, ``kind.param=value``)."""
    names, params = _flag_choices(options)
    more_names, more_params = _set_choices(overrides)
    stages = _choose_stages([dict(s) for s in stages], names + more_names)
    return _set_params(stages, params + more_params)


_Name = tuple[str, str, str]          # (kind, stage name, the flag that chose it)
_Param = tuple[str, str, Any, str]    # (kind, parameter, value, the flag that set it)


def _flag_choices(options: dict[str, Any]) -> tuple[list[_Name], list[_Param]]:
    """The stage names and parameters the command line's flags give (``None``: not given)."""
    names: list[_Name] = []
    params: list[_Param] = []
    for flag, value in options.items():
        if value is None:
            continue
        kind, param = STAGE_OPTIONS[flag]
        if flag == "perm_from":
            given_path(value, "--perm-from")
            if options.get("perm") not in (None, "none", "from"):
                raise UserError("--perm-from replaces --perm (leave --perm out)")
            names.append((kind, "from", "--perm-from"))
            params.append((kind, "path", str(value), "--perm-from"))
        elif param is None:
            if flag == "perm" and options.get("perm_from") is not None:
                continue
            names.append((kind, str(value), _flag(flag)))
        else:
            params.append((kind, param, value, _flag(flag)))
    return names, params


def _set_choices(overrides: list[str]) -> tuple[list[_Name], list[_Param]]:
    """The stage names and parameters of ``--set KIND=NAME`` / ``--set KIND.PARAM=VALUE``."""
    names: list[_Name] = []
    params: list[_Param] = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects KIND=NAME or KIND.PARAM=VALUE, got '{text}'")
        kind, _, param = key.partition(".")
        if kind not in KINDS:
            raise UserError(f"--set {text}: unknown stage kind '{kind}'; use one of {', '.join(KINDS)}")
        if param:
            params.append((kind, param, _parse_value(raw), f"--set {text}"))
        else:
            names.append((kind, raw, f"--set {text}"))
    return names, params


def _choose_stages(stages: list[dict], names: list[_Name]) -> list[dict]:
    """Each kind's stage as named: ``none`` drops it (a prune stage cannot go), a kind the recipe lacks
    is inserted in pipeline order, another name replaces the entry keeping the parameters it accepts."""
    for kind, name, flag in names:
        i = _index(stages, kind)
        if name == "none":
            if kind == "prune":
                raise UserError(f"{flag}: a recipe needs a prune stage")
            if i is not None:
                stages.pop(i)
            continue
        if i is None:
            stages.insert(sum(1 for s in stages if KINDS.index(kind_of(s)) < KINDS.index(kind)), {kind: name})
            continue
        old_kind_entry = stages[i]
        if old_kind_entry[kind] == name:
            continue
        new = {kind: name}
        cls = None if (kind == "statistics" and name == "auto") else _stage_or_error(kind, name, flag)
        accepted = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
        new.update({k: v for k, v in old_kind_entry.items() if k != kind and k in accepted})
        stages[i] = new
    return stages


def _set_params(stages: list[dict], params: list[_Param]) -> list[dict]:
    """Each parameter onto its kind's stage, checked there (one the stage does not take is refused)."""
    for kind, param, value, flag in params:
        i = _index(stages, kind)
        if i is None:
            raise UserError(f"{flag}: this recipe has no {kind} stage (pick one first, e.g. --perm learned)")
        entry = stages[i]
        trial = dict(entry, **{param: value})
        try:
            check_stage_entry(trial)
        except StageKeyError as exc:
            if exc.key == param and "unknown parameter" in str(exc):
                raise UserError(f"{flag} does not apply to {kind} '{entry[kind]}'{_takes(kind, entry[kind])}") from exc
            raise UserError(f"{flag}: {exc}") from exc
        stages[i] = trial
    return stages


def _takes(kind: str, name: str) -> str:
    """`` (it takes: a, b)``, the parameters of a stage, for an error; nothing for a name that is no stage class."""
    try:
        fields = sorted(f.name for f in dataclasses.fields(stage_class(kind, name)))
    except (UserError, TypeError):
        return ""
    return f" (it takes: {', '.join(fields)})" if fields else " (it takes no parameters)"


def _stage_or_error(kind: str, name: str, flag: str) -> type[Stage]:
    try:
        return stage_class(kind, name)
    except UserError as exc:
        raise UserError(f"{flag}: {exc}") from exc


def _parse_value(raw: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _resolve(stages: list[dict], config: PruneConfig, drop_perm: bool) -> list[dict]:
    """Order and check the stage list, resolve ``statistics: auto``, drop a preset's permutation for
    an unstructured pattern (``drop_perm``: nobody asked for it), and fill in every stage's parameters."""
    for entry in stages:
        check_stage_entry(entry)
    kinds = [kind_of(s) for s in stages]
    if kinds.count("prune") != 1:
        raise UserError("a recipe needs exactly one prune stage (e.g. '- prune: wanda')")
    for kind in ("statistics", "permutation"):
        if kinds.count(kind) > 1:
            raise UserError(f"a recipe has at most one {kind} stage")
    if kinds != sorted(kinds, key=KINDS.index):
        raise UserError(f"recipe stages must run in the order {' → '.join(KINDS)}; got {' → '.join(kinds)}")
    if "statistics" not in kinds:
        stages.insert(0, {"statistics": "auto"})
    pattern = parse_pattern(config.pattern, config.sparsity)
    perm_i = _index(stages, "permutation")
    if perm_i is not None and not pattern.is_nm and drop_perm:
        stages.pop(perm_i)  # a preset's permutation has no meaning for unstructured masks
    stats_i = _index(stages, "statistics")
    if stages[stats_i]["statistics"] == "auto":
        stages[stats_i] = {"statistics": _auto_statistics(stages)}
    return [stage_from_entry(s).as_recipe() for s in stages]


def _auto_statistics(stages: list[dict]) -> str:
    """``dense`` exactly when permutations are learned against the whole model (under the dense
    model's statistics) and the later stages read input norms alone (Wanda's masks, no XᵀX); else
    ``sequential``."""
    perm = next((s for s in stages if "permutation" in s), None)
    needs = set().union(*(stage_from_entry(s).needs() for s in stages if "statistics" not in s))
    learned_on_model = perm is not None and perm["permutation"] == "learned" and perm.get("recon", "block") == "model"
    return "dense" if learned_on_model and "norms" in needs and "gram" not in needs else "sequential"


def _flag(option: str) -> str:
    """The command-line flag of an option name (``method`` is ``--base``)."""
    return "--base" if option == "method" else "--" + option.replace("_", "-")
