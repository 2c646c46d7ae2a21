"""Recipes: a pruning run's stage list (and optionally its run settings) as data.

A recipe entry names one stage and its parameters, ``{kind: name, param: value, …}``; a recipe
is a named preset below or a YAML file::

    recipe: my-recipe          # optional label
    pattern: '2:4'             # optional run settings (any PruneConfig field but model/device)
    nsamples: 128
    stages:
      - statistics: sequential
      - permutation: learned
        recon: model
        steps: 100
      - prune: sparsegpt

``prune --out DIR`` writes the effective recipe (every setting and parameter filled in) to
``DIR/recipe.yaml``; ``--recipe DIR/recipe.yaml`` repeats the run.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

import yaml

from shuffleprune.errors import UserError
from shuffleprune.prune.registry import kind_of, stage_class
from shuffleprune.prune.stage import KINDS

SettingCheck = Callable[[str, Any], "str | None"]

# The measured choices behind each preset are in the README (*Recipes*, *Benchmarks → ShuffleSparse*).
PRESETS: dict[str, dict[str, Any]] = {
    "fast": {"about": "Wanda masks after a swap search of the input channels (no training).",
             "stages": [{"statistics": "auto"}, {"permutation": "search"}, {"prune": "wanda"}]},
    "balanced": {"about": "SparseGPT in swap-searched input coordinates (no weight update).",
                 "stages": [{"statistics": "auto"}, {"permutation": "search"}, {"prune": "sparsegpt"}]},
    "accurate": {"about": "SparseGPT in swap-searched input coordinates, then every layer's kept weights re-solved by "
                          "masked least squares in float32 (the default: most of best's gain in 1.6x SparseGPT's time).",
                 "stages": [{"statistics": "auto"}, {"permutation": "search"}, {"prune": "sparsegpt"},
                            {"update": "lsq", "precision": "float32", "iters": 40, "tol": 1e-4}]},
    "paper": {"about": "ShuffleSparse as the paper: learned block permutations (l1-l2, identity start), Wanda masks.",
              "stages": [{"statistics": "auto"},
                         {"permutation": "learned", "recon": "block", "init": "identity", "relax": "l1l2"},
                         {"prune": "wanda"}]},
    "best": {"about": "SparseGPT in swap-searched coordinates, then each block's kept weights fitted with Adam to the "
                      "unpruned model's activations (block reconstruction with a held-out stop).",
             "stages": [{"statistics": "auto"}, {"permutation": "search"}, {"prune": "sparsegpt"},
                        {"update": "blockrecon", "target": "model"}]},
    "learned": {"about": "Permutations learned jointly against the final hidden state, SparseGPT in those coordinates "
                         "(whole model on the device).",
                "stages": [{"statistics": "auto"}, {"permutation": "learned", "recon": "model", "init": "search"},
                           {"prune": "sparsegpt"}]},
}
DEFAULT_RECIPE = "accurate"
RUN_KEYS_NOT_IN_RECIPES = ("model", "device", "trust_remote_code")   # a recipe file never turns on running code


def is_recipe_file(recipe: str | Path) -> bool:
    return str(recipe).endswith((".yaml", ".yml"))


def load_recipe(recipe: str | Path, check_setting: SettingCheck) -> dict[str, Any]:
    """``{"recipe": label, "stages": [...], **run settings}`` of a preset name or a YAML file, with
    every key checked (unknown keys and wrong types name the key and its line; ``check_setting(key,
    value)`` says what is wrong with a run setting, or None)."""
    if not is_recipe_file(recipe):
        if recipe not in PRESETS:
            if re.fullmatch(r"\d+:\d+", str(recipe)):   # shuffleprune.prune(model, "2:4"): the pattern meant
                raise UserError(f"'{recipe}' is a pattern, not a recipe: give pattern='{recipe}' (--pattern {recipe})")
            raise UserError(f"unknown recipe '{recipe}'; use one of {', '.join(PRESETS)} or a .yaml file")
        return {"recipe": str(recipe), "stages": [dict(s) for s in PRESETS[str(recipe)]["stages"]]}
    path = Path(recipe)
    if not path.is_file():
        raise UserError(f"recipe file '{recipe}' does not exist")
    return parse_recipe_yaml(path.read_text(encoding="utf-8"), check_setting, str(path))


def _raw_value(node: yaml.Node) -> Any:
    """A scalar as YAML 1.1 reads it, except ``N:M`` patterns (which YAML would read as base-60 ints)."""
    return yaml.safe_load(yaml.serialize(node))


def parse_recipe_yaml(text: str, check_setting: SettingCheck, where: str = "<recipe>") -> dict[str, Any]:
    """Parse and check a recipe file's text (see the module docstring)."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{where}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from exc
    if root is None:
        raise UserError(f"{where}: empty recipe; it needs a 'stages:' list")
    if not isinstance(root, yaml.MappingNode):
        raise UserError(f"{where}:{root.start_mark.line + 1}: a recipe is a mapping with a 'stages:' list")
    out: dict[str, Any] = {"recipe": Path(where).name}
    for key_node, value_node in root.value:
        key, line = key_node.value, key_node.start_mark.line + 1
        if key == "stages":
            if not isinstance(value_node, yaml.SequenceNode) or not value_node.value:
                raise UserError(f"{where}:{line}: 'stages' must be a non-empty list of stages")
            out["stages"] = [_parse_stage(item, where, KINDS) for item in value_node.value]
        elif key in ("recipe", "about"):
            out[key] = _raw_value(value_node)
        else:
            value = value_node.value if key == "pattern" and isinstance(value_node, yaml.ScalarNode) else _raw_value(value_node)
            if key == "pattern" and value in ("null", "~", ""):
                value = None
            message = check_setting(key, value)
            if message:
                raise UserError(f"{where}:{line}: {message}")
            out[key] = value
    if "stages" not in out:
        raise UserError(f"{where}: the recipe has no 'stages:' list")
    return out


def _parse_stage(node: yaml.Node, where: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    line = node.start_mark.line + 1
    if not isinstance(node, yaml.MappingNode):
        raise UserError(f"{where}:{line}: a stage is a mapping like '- prune: wanda'")
    entry = {}
    for key_node, value_node in node.value:
        entry[key_node.value] = (_raw_value(value_node), key_node.start_mark.line + 1)
    named = [k for k in entry if k in kinds]
    if len(named) != 1:
        raise UserError(f"{where}:{line}: a stage names exactly one of {', '.join(kinds)} (got {', '.join(entry) or 'nothing'})")
    try:
        return check_stage_entry({k: v for k, (v, _) in entry.items()})
    except UserError as exc:
        key = getattr(exc, "key", None)
        at = entry[key][1] if key in entry else line
        raise UserError(f"{where}:{at}: {exc}") from exc


class StageKeyError(UserError):
    """A stage entry's bad key or value (``key`` names it, so a recipe file can point at its line)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def check_stage_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """Check one ``{kind: name, param: value}`` entry against its stage's parameters; return it."""
    kind = kind_of(entry)
    name = entry[kind]
    if name == "auto" and kind == "statistics":
        cls = None
    else:
        if not isinstance(name, str):
            raise StageKeyError(f"{kind}: expected a stage name, got {name!r}", kind)
        try:
            cls = stage_class(kind, name)
        except UserError as exc:
            raise StageKeyError(str(exc), kind) from exc
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
    for key, value in entry.items():
        if key == kind:
            continue
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise StageKeyError(f"unknown parameter '{key}' of {kind} stage '{name}' (its parameters: {known})", key)
        want = type(fields[key].default)
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            entry[key], ok = float(value), True
        if want is float and isinstance(value, str):   # YAML 1.1 reads '1e-3' (no dot) as text
            try:
                entry[key], ok = float(value), True
            except ValueError:
                pass
        if not ok:
            raise StageKeyError(f"{kind} '{name}': '{key}' must be {want.__name__}, got {value!r}", key)
    return entry


def dump_recipe(recipe: dict[str, Any]) -> str:
    """YAML text of an effective recipe (stable key order: label, settings, stages)."""
    return yaml.safe_dump(recipe, sort_keys=False, default_flow_style=False, allow_unicode=True)
