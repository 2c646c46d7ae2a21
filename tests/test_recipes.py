"""Recipes as data: presets run end to end, the written recipe repeats a run bit for bit, flags
override recipes, bad recipes get one-line errors, and user text is used as given."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import flat_config
from shuffleprune.cli import app
from shuffleprune.errors import UserError
from shuffleprune.prune import PRESETS, PruneConfig, prune, resumable
from shuffleprune.report import method_label

runner = CliRunner()
SMALL = dict(nsamples=4, seqlen=32, eval_ctx=32, batch_size=4)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def _identical(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    maps = [p / "index_maps.safetensors" for p in (a, b)]
    same_maps = all(not m.exists() for m in maps) or (
        load_file(str(maps[0])).keys() == load_file(str(maps[1])).keys()
        and all(torch.equal(x, y) for x, y in zip(load_file(str(maps[0])).values(), load_file(str(maps[1])).values())))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa) and same_maps


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_named_recipe_runs_end_to_end(name, tiny_dir, text_file, eval_file, tmp_path):
    config = PruneConfig.build(name, model=str(tiny_dir), calib=str(text_file), eval_text=str(eval_file),
                               perm_block=16, **({"perm_steps": 2} if "learned" in str(PRESETS[name]) else {}), **SMALL)
    out = tmp_path / name
    report = prune(config, out=out, progress=False).report
    assert report["nm_ok"] and report["recipe"]["recipe"] == name
    prune_stage = next(s for s in report["stages"] if s.startswith("prune:"))
    assert prune_stage == "prune:" + {"fast": "wanda", "paper": "wanda"}.get(name, "sparsegpt")
    assert (report["stages"][-1] == "update:blockrecon") == (name == "best")
    assert report["perm"]["index_maps"] == "index_maps.safetensors"
    assert report["ppl"]["pruned"] > 1 and report["ppl"]["dense"] > 1  # a random tiny model: either may be lower
    card = (out / "README.md").read_text()
    assert f"`{name}`" in card and "2:4" in card and "shuffleprune.load" in card and "trust_remote_code" in card
    assert f"{report['ppl']['pruned']:.2f}" in card


def test_presets_that_share_a_prune_method_are_labelled_apart():
    """Tables (`eval`'s pruned row, `prune`'s and `report`'s) name a run by its stages, not its prune method alone:
    `balanced`, `accurate`, `best` and `learned` all prune with SparseGPT and read the same without them."""
    def label(name: str, **options) -> str:
        config = PruneConfig.build(name, **options)
        return method_label({"method": config.method, "pattern": config.pattern, "stages": config.stage_labels()})

    labels = {name: label(name) for name in PRESETS}
    assert len(set(labels.values())) == len(PRESETS), labels
    assert labels["accurate"] == "sparsegpt 2:4, search perm, lsq update"
    assert labels["best"] == "sparsegpt 2:4, search perm, blockrecon update"
    assert labels["fast"] == "wanda 2:4, search perm" and labels["paper"] == "wanda 2:4, learned perm"
    assert label("fast", perm="none") == "wanda 2:4"
    assert label("fast", perm="none", mask_stats="dense") == "wanda 2:4, dense statistics"
    assert method_label({"method": "wanda", "pattern": "2:4"}) == "wanda 2:4"   # a report from before stages


def test_a_run_repeated_from_its_recipe_yaml_is_bit_identical(tiny_dir, text_file, eval_file, tmp_path):
    first = tmp_path / "first"
    config = PruneConfig.build("paper", model=str(tiny_dir), calib=str(text_file), eval_text=str(eval_file),
                               perm_block=16, perm_steps=3, seed=2, **SMALL)
    report = prune(config, out=first, progress=False).report
    written = first / "recipe.yaml"
    again = PruneConfig.build(written, model=str(tiny_dir))
    assert again.stages == config.stages and again.key() == config.key()
    prune(again, out=tmp_path / "again", progress=False)
    assert _identical(first, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "prune_report.json").read_text())["recipe"] == report["recipe"]
    # the CLI takes it too, and explicit flags override it
    res = runner.invoke(app, ["prune", str(tiny_dir), "--recipe", str(written), "--base", "sparsegpt",
                              "--out", str(tmp_path / "cli"), "--quiet"])
    assert res.exit_code == 0, res.output
    cli_report = json.loads((tmp_path / "cli" / "prune_report.json").read_text())
    assert cli_report["method"] == "sparsegpt" and cli_report["stages"][1] == "permutation:learned"
    assert cli_report["calib"]["seed"] == 2 and cli_report["perm"]["steps"] == 3


def test_flags_and_set_override_the_recipe():
    c = PruneConfig.build(None, method="wanda")
    assert c.recipe == "accurate" and c.stage_labels() == ["statistics:sequential", "permutation:search", "prune:wanda",
                                                           "update:lsq"]
    assert (c.stages[-1]["precision"], c.stages[-1]["iters"]) == ("float32", 40)  # the default's cheaper solve
    c = PruneConfig.build("learned", perm="none")
    assert c.stage_labels() == ["statistics:sequential", "prune:sparsegpt"]
    c = PruneConfig.build("learned", method="wanda", overrides=["permutation.steps=7", "permutation.lr_decay=cosine"])
    perm = c.stages[1]
    assert c.stage_labels()[0] == "statistics:dense"  # learned on the whole model under dense statistics
    assert (perm["steps"], perm["lr_decay"], perm["recon"], perm["init"]) == (7, "cosine", "model", "search")
    assert PruneConfig.build("fast", sparsity=0.5).stage_labels() == ["statistics:sequential", "prune:wanda"]
    c = PruneConfig.build(None, perm="learned", perm_steps=5)  # search -> learned keeps block and share
    assert c.stages[1]["permutation"] == "learned" and c.stages[1]["steps"] == 5
    c = PruneConfig.build("balanced", overrides=["statistics=dense", "prune=wanda"])
    assert c.stage_labels() == ["statistics:dense", "permutation:search", "prune:wanda"]
    # YAML 1.1 reads '1e-3' (no dot) as text; a float parameter still takes it
    c = PruneConfig.build(None, overrides=["update=blockrecon", "update.lr=1e-3"])
    assert c.stages[-1]["lr"] == 0.001 and isinstance(c.stages[-1]["lr"], float)


@pytest.mark.parametrize("kwargs,needle", [
    ({"recipe": "fastest"}, "unknown recipe 'fastest'"),
    ({"recipe": None, "method": "obs"}, "--base: unknown prune stage 'obs'"),
    ({"recipe": None, "perm_steps": 5}, "--perm-steps does not apply to permutation 'search'"),
    ({"recipe": None, "overrides": ["permutation.stride=3"]},   # with what it takes
     r"does not apply to permutation 'search' \(it takes: block, rounds, .*\)$"),
    ({"recipe": "fast", "overrides": ["prune.blocksize=64"]}, r"does not apply to prune 'wanda' \(it takes no parameters\)$"),
    ({"recipe": None, "overrides": ["sharpen=yes"]}, "unknown stage kind 'sharpen'"),
    ({"recipe": "fast", "perm": "learned", "sparsity": 0.5}, "N:M"),
    ({"recipe": None, "overrides": ["permutation.block=big"]}, "'block' must be int"),
    ({"recipe": None, "overrides": ["update=blockrecon", "update.lr=fast"]}, "'lr' must be float"),
    # the Python API's values are typed as a recipe file's (were a TypeError deep in the build)
    ({"recipe": None, "pattern": 4}, "'pattern' must be str, got 4"),
    ({"recipe": None, "sparsity": "0.5"}, "'sparsity' must be float, got '0.5'"),
    ({"recipe": None, "nsamples": "128"}, "'nsamples' must be int, got '128'"),
    # documents in memory: the value cut short (all of it was printed), and how to pass them
    ({"recipe": None, "calib": ["a long document"] * 500}, r"^'calib' must be str, got \['a long document', 'a long "
     r"document', 'a long document', \.\.\.\] \(a source name, .*; documents in memory go to shuffleprune\.prune"),
    ({"recipe": None, "only": "*.q_proj"}, "'only' must be a list of strings"),
    ({"recipe": None, "dtype": torch.float64}, "unknown --dtype 'float64'"),
    ({"recipe": None, "dtype": "double"}, "unknown --dtype 'double'"),
    ({"recipe": None, "nsample": 4}, r"unknown prune option\(s\) nsample; did you mean nsamples= for nsample\?"),
    ({"recipe": None, "base": "wanda"}, r"unknown prune option\(s\) base; did you mean method= for base\?"),
    # a bad size or rate: the one value at fault, named with what it must be and what it was
    ({"recipe": None, "nsamples": 0}, r"^--nsamples must be >= 1, got 0$"),
    ({"recipe": "paper", "perm_steps": 0}, r"^--perm-steps must be >= 1, got 0$"),
    ({"recipe": "paper", "perm_lr": -1.0}, r"^--perm-lr must be > 0, got -1.0$"),
    ({"recipe": None, "overrides": ["update=blockrecon", "update.patience=0"]},
     r"^update 'blockrecon': patience must be >= 1, got 0$"),
    ({"recipe": None, "overrides": ["update=blockrecon", "update.lr=0"]}, r"^update 'blockrecon': lr must be > 0, got 0"),
])
def test_bad_recipes_and_overrides_are_one_line_errors(kwargs, needle):
    recipe = kwargs.pop("recipe")
    with pytest.raises(UserError, match=needle) as exc:
        PruneConfig.build(recipe, **kwargs)
    assert "\n" not in str(exc.value)


def test_a_torch_dtype_is_taken_by_its_name_everywhere(tmp_path):
    """The Python API takes ``dtype=torch.bfloat16`` as transformers does (it was refused by prune,
    evaluate and load), and a ``torch.device``, recorded by its name so the recipe file repeats it."""
    from shuffleprune.evaluation.config import EvalConfig
    from shuffleprune.evaluation.evaluate import _validate
    from shuffleprune.models import parse_dtype

    config = PruneConfig.build(None, dtype=torch.bfloat16, device=torch.device("cuda", 1))
    assert config.dtype == "bfloat16" and PruneConfig.build(None, dtype="bf16").dtype == "bf16"
    assert config.device == "cuda:1"   # a torch.device too, by its name
    assert parse_dtype(torch.float16) is torch.float16 and parse_dtype("auto") == "auto"
    evaluation = EvalConfig(dtype=torch.float16, device=torch.device("cpu"))
    _validate(evaluation, None)
    assert evaluation.dtype == "float16" and evaluation.device == "cpu"
    with pytest.raises(UserError, match="unknown --dtype 'int8'"):
        _validate(EvalConfig(dtype=torch.int8), None)   # before any model is loaded


@pytest.mark.parametrize("text,needle", [
    ("stages:\n  - prune: wanda\nnsamples: many\n", r"recipe.yaml:3: 'nsamples' must be int"),
    ("stages:\n  - prune: wanda\ncalibration: wiki\n", r"recipe.yaml:3: unknown key 'calibration'"),
    ("stages:\n  - statistics: sequential\n  - prune: wanda\n    sharpness: 2\n",
     r"recipe.yaml:4: unknown parameter 'sharpness' of prune stage 'wanda'"),
    ("stages:\n  - permutation: search\n    block: 6.5\n  - prune: wanda\n", r"recipe.yaml:3: permutation 'search': 'block' must be int"),
    ("stages:\n  - prune: lasso\n", r"recipe.yaml:2: unknown prune stage 'lasso'"),
    ("stages:\n  - prune: wanda\n  - permutation: search\n", "must run in the order"),
    ("nsamples: 4\n", "no 'stages:' list"),
    ("stages: [\n", r"recipe.yaml:\d+: not valid YAML"),
])
def test_bad_recipe_files_name_the_key_and_line(text, needle, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=needle):
        PruneConfig.build(path)


def test_recipe_file_reads_patterns_as_text_not_base_60(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("pattern: 2:4\nstages:\n  - prune: magnitude\n")
    assert PruneConfig.build(path).pattern == "2:4"


def test_a_pattern_or_a_sparsity_given_replaces_the_recipes_other(tmp_path):
    unstructured = tmp_path / "unstructured.yaml"  # as an earlier --sparsity run writes its recipe.yaml
    unstructured.write_text(PruneConfig.build("fast", sparsity=0.6).to_yaml())
    assert (PruneConfig.build(unstructured).pattern, PruneConfig.build(unstructured).sparsity) == (None, 0.6)
    c = PruneConfig.build(unstructured, pattern="4:8")
    assert (c.pattern, c.sparsity, str(c.spec().pattern)) == ("4:8", None, "4:8")
    c = PruneConfig.build("fast", sparsity=0.7)  # the presets' 2:4 gives way to a sparsity
    assert (c.pattern, c.sparsity) == (None, 0.7)
    with pytest.raises(UserError, match="not both"):
        PruneConfig.build("fast", pattern="2:4", sparsity=0.5)


def test_cli_recipe_errors_exit_2_and_write_nothing(tiny_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - prune: wanda\n    sharpness: 2\n")
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    for args, needle in ((["--recipe", "fastest"], "unknown recipe"),
                         (["--recipe", str(bad)], "bad.yaml:3: unknown parameter 'sharpness'"),
                         (["--set", "prune=lasso"], "unknown prune stage 'lasso'"),
                         (["--out", str(a_file), "--calib", "wiki"], "is a file, not a directory")):
        res = runner.invoke(app, ["prune", str(tiny_dir), *args] + ([] if "--out" in args else ["--out", str(tmp_path / "o")]))
        assert res.exit_code == 2, (args, res.output)
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], res.output
    assert not (tmp_path / "o").exists() and a_file.read_text() == "x"


def test_user_text_is_used_whole_and_a_shared_file_is_split(tiny_dir, text_file, eval_file, tmp_path):
    from shuffleprune.calib import get_source
    from shuffleprune.models import load_model

    tok = load_model(str(tiny_dir)).tokenizer
    n_tokens = len(tok(eval_file.read_text(), add_special_tokens=False)["input_ids"])
    assert n_tokens >= 3000
    r = prune(flat_config(model=str(tiny_dir), calib=str(text_file), eval_text=str(eval_file), **SMALL),
              progress=False).report
    ev = r["eval"]  # every token of the file is read and all whole windows of 32 are scored
    assert ev["tokens"] == ev["tokens_available"] == n_tokens and ev["tokens_scored"] == (n_tokens // 32) * 31
    assert ev["documents"] == len(get_source(str(eval_file)).documents("test")) and not r["calib"]["split_from_shared_file"]
    shared = prune(flat_config(model=str(tiny_dir), calib=str(text_file), eval_text=str(text_file), **SMALL),
                   progress=False).report
    docs = len(get_source(str(text_file)).documents("train"))
    assert shared["calib"]["split_from_shared_file"]
    assert shared["eval"]["documents"] == docs // 10 and shared["calib"]["documents"] == docs - docs // 10


def test_bos_starts_every_window_where_the_tokenizer_adds_it(tiny_dir, text_file, eval_file, tmp_path):
    from tokenizers import processors
    from transformers import AutoTokenizer

    from shuffleprune.evaluation.perplexity import perplexity
    from shuffleprune.models import load_model

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.add_special_tokens({"bos_token": "[BOS]"})
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="[BOS] $A",
                                                                  special_tokens=[("[BOS]", tok.bos_token_id)])
    tok.save_pretrained(tiny_dir)
    lm = load_model(str(tiny_dir))
    seen = []
    handle = lm.model.model.embed_tokens.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    report = prune(flat_config(model=str(tiny_dir), calib=str(text_file), eval_text=str(eval_file), method="wanda",
                               **SMALL), progress=False, loaded=lm).report
    handle.remove()
    bos = lm.tokenizer.bos_token_id
    assert report["bos"] is True and report["eval"]["tokens_scored"] == (report["eval"]["tokens"] // 31) * 31
    assert seen and all((ids[:, 0] == bos).all() and not (ids[:, 1:] == bos).any() for ids in seen)
    stream = torch.arange(2, 66).unsqueeze(0)  # BOS windows: ctx-1 text tokens each, all of them scored
    ppl_bos = perplexity(lm.model, stream, 32, bos=bos)
    ppl_plain = perplexity(lm.model, stream, 32)
    assert ppl_bos != ppl_plain


def test_a_run_is_the_same_with_one_and_two_threads(tiny_dir, text_file, tmp_path):
    from shuffleprune.perm.search import swap_search

    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    score = torch.rand(96, 256, generator=gen)
    outs, perms = [], []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            perms.append(swap_search(score, 2, 4, 64))
            out = tmp_path / f"t{n}"
            prune(PruneConfig.build("balanced", model=str(tiny_dir), calib=str(text_file), eval_text=None,
                                    perm_block=16, **SMALL), out=out, progress=False)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(perms[0], perms[1])
    assert _identical(*outs)


def test_interrupted_before_the_first_checkpoint_reruns_and_after_it_resumes(tiny_dir, text_file, tmp_path, monkeypatch):
    from shuffleprune.prune import driver

    config = flat_config(model=str(tiny_dir), calib=str(text_file), eval_text=None, method="wanda", **SMALL)
    out = tmp_path / "o"

    def interrupted(*args, **kwargs):
        (out / ".resume").mkdir(parents=True, exist_ok=True)  # as far as a run gets before its state exists
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "capture_block_inputs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prune(config, out=out, progress=False)
    monkeypatch.undo()
    assert not resumable(out)
    prune(config, out=out, progress=False)  # a plain rerun: no --overwrite needed for the leftover
    full = tmp_path / "full"
    prune(config, out=full, progress=False)

    def stop_in_block_0(i):
        raise KeyboardInterrupt

    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        prune(config, out=part, progress=False, on_block_done=stop_in_block_0)
    assert resumable(part)
    prune(config, out=part, resume=True, progress=False)
    assert _identical(full, part)


def test_truncated_export_loaded_through_transformers_is_one_line_error(tiny_dir, text_file, tmp_path):
    from transformers import AutoModelForCausalLM

    from shuffleprune.deploy.export import export_checkpoint

    pruned, deployed = tmp_path / "p", tmp_path / "d"
    prune(PruneConfig.build("fast", model=str(tiny_dir), calib=str(text_file), eval_text=None, perm_block=16, **SMALL),
          out=pruned, progress=False)
    export_checkpoint(pruned, deployed)
    weights = deployed / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory"):
        export_checkpoint(pruned, a_file)
    with pytest.raises(UserError, match="truncated or corrupt") as exc:
        AutoModelForCausalLM.from_pretrained(deployed, trust_remote_code=True)
    assert "\n" not in str(exc.value)


def test_the_default_recipe_is_balanced_then_float32_lsq(tiny_dir, text_file, tmp_path):
    """The default (`accurate`) is exactly the measured configuration: `balanced` followed by lsq in
    float32 with 40 steps; it keeps N:M in memory order, changes the weights `balanced` leaves, and
    `--set update=none` gives `balanced` back."""
    from shuffleprune.prune import PruneConfig, prune

    kw = dict(model=str(tiny_dir), calib=str(text_file), eval_text=None, nsamples=4, seqlen=32, batch_size=4,
              perm_block=16)
    lsq32 = ["update=lsq", "update.precision=float32", "update.iters=40", "update.tol=1e-4"]
    runs = {"default": (None, []), "spelled_out": ("balanced", lsq32), "balanced": ("balanced", []),
            "default_no_update": (None, ["update=none"])}
    reports = {name: prune(PruneConfig.build(recipe, overrides=sets, **kw), out=tmp_path / name, progress=False).report
               for name, (recipe, sets) in runs.items()}
    assert reports["default"]["recipe"]["recipe"] == "accurate" and reports["default"]["stages"][-1] == "update:lsq"
    assert reports["default"]["nm_ok"] and all(layer["nm_ok"] for layer in reports["default"]["layers"])
    assert _identical(tmp_path / "default", tmp_path / "spelled_out")
    assert _identical(tmp_path / "default_no_update", tmp_path / "balanced")
    assert not _identical(tmp_path / "default", tmp_path / "balanced")


def test_no_perplexity_is_spelled_none_in_python_and_recipe_files_as_on_the_command_line(tmp_path):
    # only the command line knew "none" (Python's eval_text="none" was looked up as a text source)
    assert PruneConfig.build("fast", eval_text="none").eval_text is None
    assert PruneConfig.build("fast", eval_text="None").eval_text is None
    assert PruneConfig.build("fast", eval_text=None).eval_text is None
    recipe = tmp_path / "r.yaml"
    recipe.write_text("recipe: mine\neval_text: none\nstages:\n  - statistics: sequential\n  - prune: wanda\n")
    assert PruneConfig.build(str(recipe)).eval_text is None
    assert PruneConfig.build("fast").eval_text == "auto"
