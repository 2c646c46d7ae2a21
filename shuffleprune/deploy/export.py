"""``shuffleprune export``: a pruned checkpoint → a deployable compressed N:M checkpoint, and back.

Layout of an exported directory::

    config.json, generation_config.json, tokenizer files   (a normal HF model directory)
    model.safetensors            every tensor except the sparsified linears' weights/biases
    sparse.safetensors           per sparsified linear NAME: NAME.values, NAME.meta (see
                                 sparse_format), NAME.perm (int32, only when not the identity),
                                 NAME.bias (when it has one); per expert e of a pruned fused MoE
                                 parameter P: P[e].values, P[e].meta (its [out, in] matrix, in
                                 its index map's order), P[e].perm (when it has one)
    shuffleprune_format.json     {"format": "shuffleprune.nm", "version": 2, pattern, dtype, layers,
                                  experts (P: count, [out, in], transposed, perm), folded permutations, source}
    shuffleprune_hf.py           + ``auto_map`` in config.json: ``AutoModelForCausalLM.from_pretrained(
                                 dir, trust_remote_code=True)`` loads it through shuffleprune

Index maps that cost nothing are folded into the layers that produce their input before compression
(:mod:`.fold`); the others stay gathers the runtime applies.
"""
from __future__ import annotations

import json
import shutil
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from shuffleprune.blocks import block_linears, expert_name, find_blocks, is_plain_linear, parse_expert_name
from shuffleprune.errors import UserError, given_path
from shuffleprune.masks import parse_pattern
from shuffleprune.outdir import check_writable, holds, space_errors, written_beside
from shuffleprune.perm.linear import INDEX_MAPS, apply_index_maps, load_index_maps, to_plain_linears
from shuffleprune.quiet import library_progress_bars
from shuffleprune.report import read_report
from shuffleprune.deploy.fold import fold_permutations
from shuffleprune.deploy.format import compress, meta_bits
from shuffleprune.deploy.load import FORMAT_FILE, FORMAT_NAME, FORMAT_VERSION, SPARSE_FILE, is_exported
from shuffleprune.deploy.experts_export import compress_experts, exportable_experts, was_pruned
from shuffleprune.stacked_experts import traced_stacked_experts
from shuffleprune.tokenizer_files import save_tokenizer

HF_LOADER_FILE = "shuffleprune_hf.py"
# Written next to an export so that transformers can load it too:
# AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) → shuffleprune.load(dir).
HF_LOADER = '''"""transformers entry point of a shuffleprune export (needs `pip install shuffleprune`)."""
from shuffleprune.deploy.hf_entry import load_for_transformers


class ShufflepruneForCausalLM:
    """`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` returns the model with its
    compressed N:M `SparseLinear` layers, exactly as `shuffleprune.load(dir)` does."""

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        return None

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        return load_for_transformers(path, *args, **kwargs)
'''


def runs_own_code(model: nn.Module) -> bool:
    """Whether ``model``'s class is code its checkpoint ships (loaded with ``trust_remote_code``), not transformers'."""
    return type(model).__module__.split(".")[0] == "transformers_modules"


def _run_report(pruned_dir: Path) -> tuple[str | None, dict | None]:
    """The report of the run that wrote ``pruned_dir``: ``("prune", its prune_report.json)``, or
    ``("dst", its dst run's dst_report.json)`` for a ``dst`` run's ``model/``; ``(None, None)``."""
    report, dst_report = pruned_dir / "prune_report.json", pruned_dir.parent / "dst_report.json"
    if report.is_file():
        return "prune", read_report(report)
    if dst_report.is_file():
        return "dst", read_report(dst_report)
    return None, None


def _pruned_outside_blocks(model: nn.Module, pruned: set[str] | None, done: set[str]) -> dict[str, nn.Linear]:
    """The linears a run sparsified outside the decoder blocks (``dst`` trains every linear: a vision
    tower's, Gemma 3n's AltUp projections, a second stack of layers, an untied ``--sparse-head``) that
    are linear layers of their own: plain, not sharing their weight with another module (a tied head)."""
    modules = dict(model.named_modules())
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {name: modules[name] for name in sorted((pruned or set()) - done)
            if parse_expert_name(name) is None and name in modules and is_plain_linear(modules[name])
            and owners.get(id(modules[name].weight)) == 1}


def _pruned_names(kind: str | None, report: dict | None) -> set[str] | None:
    """The layers (and expert matrices) the run sparsified, from its report; None without one (then
    a layer with zeros counts as pruned)."""
    if kind == "prune":
        return {layer["name"] for layer in report["layers"]}
    if kind == "dst":
        return set(report.get("layers") or {})
    return None


def _pattern_of(pruned_dir: Path, pattern: str | None, kind: str | None, report: dict | None) -> tuple[int, int]:
    """``(N, M)`` to export with: ``pattern``, else the one the run's report records; a pattern that
    differs from the recorded one, or a run that recorded none, is refused."""
    recorded = _recorded_pattern(kind, report)
    if pattern is None:
        if recorded is None:
            _refuse_unrecorded(pruned_dir, kind, report)
        pattern = recorded
    p = parse_pattern(pattern, None)
    if not p.is_nm:
        raise UserError(f"export needs an N:M pattern; '{pruned_dir}' was pruned {pattern}")
    if recorded is not None and parse_pattern(recorded, None) != p:
        raise UserError(f"'{pruned_dir}' was pruned {recorded} (its report says so): leave out --pattern, or give "
                        f"--pattern {recorded} (exporting it as {pattern} would lose the {recorded} kernels)")
    return p.n, p.m


def _recorded_pattern(kind: str | None, report: dict | None) -> str | None:
    """The N:M pattern a run's report records (None: unstructured, another dst method, or no report)."""
    if kind == "prune" and (report.get("recipe") or {}).get("sparsity") is None:
        return report["pattern"]
    if kind == "dst" and report["dst"].get("method") == "nm":
        return report["dst"]["pattern"]  # a `dst --method nm` run's model/
    return None


def _refuse_unrecorded(pruned_dir: Path, kind: str | None, report: dict | None) -> None:
    """Why a checkpoint whose report records no N:M pattern cannot be exported without ``--pattern``."""
    if kind == "prune":
        raise UserError(f"export compresses N:M checkpoints and '{pruned_dir}' was pruned unstructured "
                        f"({report['pattern']}); prune it with --pattern 2:4 (or another N:M)")
    if kind == "dst":
        raise UserError(f"export compresses N:M checkpoints and '{pruned_dir}' comes from a dst "
                        f"--method {report['dst'].get('method')} run; train with --method nm for one")
    raise UserError(f"'{pruned_dir}' has no prune_report.json (nor an N:M dst run's report); pass --pattern N:M")


def _kept_dense(pruned: set[str] | None, layers: dict, experts: dict) -> list[str]:
    """The matrices the run sparsified that the export stores dense (N:M-valued, exact, not smaller):
    a layer outside the decoder blocks that shares its weight (a tied head) or is no plain linear, and
    the experts of a fused tensor pruned only in part. Warns when there are any."""
    exported = set(layers) | {expert_name(name, e) for name, entry in experts.items() for e in range(entry["experts"])}
    kept = sorted((pruned or set()) - exported)
    if kept:
        warnings.warn(f"{len(kept)} pruned matrices stay dense in the export, N:M-valued and exact at the dense size "
                      f"(e.g. {kept[0]}): {_kept_dense_why(kept)}", UserWarning, stacklevel=3)
    return kept


def _kept_dense_why(kept: list[str]) -> str:
    """What the matrices an export keeps dense are, counted by kind."""
    experts = sum(parse_expert_name(n) is not None for n in kept)
    parts = ([f"{experts} experts of fused tensors pruned only in part"] if experts else []) + \
        ([f"{len(kept) - experts} outside the decoder blocks that share their weight or are no plain linear"]
         if len(kept) > experts else [])
    return "; ".join(parts)


def _stored_map(perm: torch.Tensor | None) -> torch.Tensor | None:
    """The index map an export stores for a layer: ``None`` for none or the identity (it is omitted)."""
    return None if perm is None or torch.equal(perm.cpu(), torch.arange(perm.numel())) else perm


def export_card(fmt: dict, report: dict | None, name: str) -> str:
    """A hub-style ``README.md`` for an export: what it holds and how to load it."""
    from shuffleprune.models import base_model_id

    base = (report or {}).get("model")
    hub_base = base_model_id(base) if base else None  # a local path names no hub model
    ppl = (report or {}).get("ppl") or {}
    ppl_lines = "".join(f"| {k} | {v:.2f} |\n" for k, v in ppl.items() if v is not None)
    ev = (report or {}).get("eval") or {}
    part = f", {ev['split']}" if ev.get("split") and ev["split"] != "test" else ""   # reports before the label said "test"
    ppl_note = (f"Perplexity from the pruning run ({ev.get('text')}{part}, windows of {ev.get('ctx')} tokens); "
                "the export computes the pruned model.\n")
    from shuffleprune.models import trust_snippets

    # the model's own code, kept here, runs only when trusted
    trust_arg, trust_flag = trust_snippets(fmt.get("model_class") is not None)
    return f"""---
{f"base_model: {hub_base}{chr(10)}" if hub_base else ""}library_name: transformers
tags:
- shuffleprune
- sparse
- sparsity-{fmt['pattern']}
---

# {name} · {fmt['pattern']}, compressed

A [shuffleprune](https://pypi.org/project/shuffleprune/) export{f" of a model pruned from `{base}`" if base else ""}:
{len(fmt['layers'])} linear layers{f" and the experts of {len(fmt['experts'])} fused MoE projections" if fmt['experts'] else ""}
stored as their kept values plus {fmt['meta_bits']}-bit in-group positions ({fmt['pattern']}), with an
input index map where the run's permutation could not be folded away ({len(fmt['runtime_gathers'])} layers;
{len(fmt['folded'])} folded into the layers that produce their input). Format `{fmt['format']}` v{fmt['version']},
{fmt['dtype']}.{f" Stored dense, N:M-valued: {_kept_dense_why(fmt['kept_dense'])}." if fmt.get('kept_dense') else ""}
{f"{chr(10)}| model | perplexity |{chr(10)}|---|---|{chr(10)}{ppl_lines}{chr(10)}{ppl_note}" if ppl_lines else ""}
## Load it

```python
import shuffleprune                      # pip install shuffleprune
model = shuffleprune.load("PATH", device="cuda"{trust_arg})   # the N:M kernels on the GPU; takes a hub id too
```

```python
from transformers import AutoModelForCausalLM   # shuffleprune must be installed
model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)
```

Without `trust_remote_code=True`, transformers would leave the compressed layers uninitialised.

## Evaluate it

```bash
shuffleprune eval PATH --tasks ppl,arc_easy,hellaswag{trust_flag}
lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True --tasks arc_easy,hellaswag
```
"""


def export_checkpoint(pruned_dir: str | Path, out_dir: str | Path, pattern: str | None = None,
                      fold: bool = True, overwrite: bool = False, progress: bool = True,
                      trust_remote_code: bool = False) -> dict:
    """Write the compressed checkpoint of ``pruned_dir`` to ``out_dir`` (atomically); return its format
    dict. ``progress=False`` silences the loading and writing bars of transformers; ``trust_remote_code``
    runs the model code a checkpoint ships (kept in the export, which then needs it to load too)."""
    if pattern is not None and not isinstance(pattern, str):
        raise UserError(f"'pattern' must be str such as '2:4', got {pattern!r}")
    with library_progress_bars(progress):
        return _compress_checkpoint(pruned_dir, out_dir, pattern, fold, overwrite, trust_remote_code)


def _compress_checkpoint(pruned_dir: str | Path, out_dir: str | Path, pattern: str | None, fold: bool, overwrite: bool,
                         trust_remote_code: bool) -> dict:
    from shuffleprune.models import load_model

    pruned_dir, out_dir = _checked_dirs(pruned_dir, out_dir, overwrite)
    kind, report = _run_report(pruned_dir)
    n, m = _pattern_of(pruned_dir, pattern, kind, report)
    lm = load_model(str(pruned_dir), trust_remote_code=trust_remote_code)
    model = lm.model  # every weight in input order, N:M in its map's order
    maps_file = pruned_dir / INDEX_MAPS
    maps = load_index_maps(maps_file) if maps_file.is_file() else {}
    apply_index_maps(model, maps)  # mapped linears as W[:, perm] reading x[perm]: N:M in memory order
    folded = fold_permutations(model) if fold else {}
    pruned = _pruned_names(kind, report)
    parts = _compress_model(model, pruned, maps, n, m)
    restored = to_plain_linears(model, keep=set(parts.layers))  # mapped linears not exported as N:M
    if not parts.layers and not parts.experts:
        raise UserError(f"no sparse nn.Linear layers in '{pruned_dir}' (export compresses the linears a pruning or dst run made N:M)")
    version = FORMAT_VERSION if any("stacked" in e for e in parts.experts.values()) else 2   # readable by older ones
    fmt = {"format": FORMAT_NAME, "version": version, "pattern": f"{n}:{m}", "n": n, "m": m,
           "meta_bits": meta_bits(m), "dtype": str(model.dtype).replace("torch.", ""),
           "layers": parts.layers, "experts": parts.experts, "folded": folded,
           "runtime_gathers": sorted(k for k, v in parts.layers.items() if v["perm"]), "dense_restored": restored,
           "kept_dense": _kept_dense(pruned, parts.layers, parts.experts),
           "source": str(pruned_dir)}
    _write_export(out_dir, lm, parts, fmt, (pruned_dir / "prune_report.json", report) if kind == "prune" else None)
    return fmt


def _checked_dirs(pruned_dir: str | Path, out_dir: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """The pruned checkpoint's directory (a hub id's snapshot, downloaded or cached) and the target,
    refused when the one is no checkpoint or the other a file or (without ``overwrite``) not empty."""
    from shuffleprune.hub import looks_like_hub_id
    from shuffleprune.models import hub_snapshot, inner_model_hint, refuse_uncached_offline

    pruned_dir, out_dir = given_path(pruned_dir, "the pruned checkpoint"), given_path(out_dir, "the export's OUT")
    if not pruned_dir.exists() and looks_like_hub_id(str(pruned_dir)):
        refuse_uncached_offline(str(pruned_dir), "pruned checkpoint", ("config.json",),
                                "; give the directory `prune --out` wrote, or fetch it where the hub is reachable")
        pruned_dir = Path(hub_snapshot(str(pruned_dir), any_repo=True))
    if not (pruned_dir / "config.json").is_file():
        raise UserError(f"'{pruned_dir}' is not a pruned checkpoint directory (no config.json)"
                        f"{inner_model_hint(pruned_dir, ' (give the directory `prune --out` wrote)')}")
    if is_exported(pruned_dir):
        raise UserError(f"'{pruned_dir}' is an export already (it has {FORMAT_FILE}); export the pruned checkpoint "
                        "it came from (prune --out), or load this one with shuffleprune.load")
    check_export_target(out_dir, pruned_dir, overwrite)
    return pruned_dir, out_dir


def check_export_target(out_dir: str | Path, pruned_dir: str | Path, overwrite: bool) -> None:
    """Refuse an export target that is, or holds, the pruned checkpoint (which need not exist yet:
    ``prune --export`` checks before pruning), that is a file, or (without ``overwrite``) not empty."""
    out_dir = Path(out_dir)
    if holds(out_dir, pruned_dir):
        what = "is" if holds(pruned_dir, out_dir) else "holds"
        raise UserError(f"export target '{out_dir}' {what} the pruned checkpoint '{pruned_dir}': replacing it would "
                        "delete that checkpoint; give another export target")
    check_writable(out_dir, "export target")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"output dir '{out_dir}' is not empty; use --overwrite or another dir")


@dataclass
class _Compressed:
    """What an export stores compressed: the tensors of ``sparse.safetensors``, the format's entries of
    its linears and of its experts' tensors, and the dense keys they replace."""

    sparse: dict[str, torch.Tensor] = field(default_factory=dict)
    layers: dict[str, dict] = field(default_factory=dict)
    experts: dict[str, dict] = field(default_factory=dict)
    skip_keys: set[str] = field(default_factory=set)

    def add_linear(self, name: str, lin: nn.Linear, n: int, m: int) -> None:
        """One N:M linear: its kept values, positions, stored map and bias, its entry, its dense keys."""
        w = lin.weight.data
        values, meta = compress(w, n, m, name)
        self.sparse[f"{name}.values"], self.sparse[f"{name}.meta"] = values, meta
        perm = _stored_map(getattr(lin, "perm", None))
        if perm is not None:
            self.sparse[f"{name}.perm"] = perm.to(torch.int32).cpu().contiguous()
        if lin.bias is not None:
            self.sparse[f"{name}.bias"] = lin.bias.data.contiguous()
        self.layers[name] = {"shape": list(w.shape), "perm": perm is not None, "bias": lin.bias is not None}
        self.skip_keys.update({f"{name}.weight", f"{name}.bias"})


def _compress_model(model: nn.Module, pruned: set[str] | None, maps: dict[str, torch.Tensor], n: int, m: int
                    ) -> _Compressed:
    """Compress what the run sparsified: the blocks' linears and MoE experts (each expert in its map's
    order; experts keep their column order in the dense part too), then the linears outside the blocks."""
    expert_maps = {name: perm for name, perm in maps.items() if parse_expert_name(name) is not None}
    blocks = find_blocks(model)
    stacked = traced_stacked_experts(model, blocks) if any(parse_expert_name(n) for n in pruned or ()) else None
    out = _Compressed()
    for i, block in enumerate(blocks.layers):
        for name, lin in block_linears(block, blocks.prefix(i)).items():
            if was_pruned(name, lin.weight.data, pruned):  # a linear left dense (--skip / --only) stays in model.safetensors
                out.add_linear(name, lin, n, m)
        for name, experts in exportable_experts(block, blocks.prefix(i), pruned, stacked and stacked[i]).items():
            stored = {e: _stored_map(expert_maps.get(expert_name(name, e))) for e in experts}
            tensors, out.experts[name] = compress_experts(name, experts, n, m,
                                                          {e: p for e, p in stored.items() if p is not None})
            out.sparse.update(tensors)
            out.skip_keys.add(name)
    for name, lin in _pruned_outside_blocks(model, pruned, set(out.layers)).items():
        out.add_linear(name, lin, n, m)
    return out


def _write_export(out_dir: Path, lm, parts: _Compressed, fmt: dict, prune_report: tuple[Path, dict] | None) -> None:
    """Write the export into a temporary sibling of ``out_dir`` and rename it into place: the dense
    rest (``model.safetensors``), tokenizer, transformers loader, ``sparse.safetensors``, the format,
    the run's report and a model card. A failure leaves nothing behind."""
    link, out_dir = out_dir, out_dir.resolve() if out_dir.is_symlink() else out_dir   # a link stays a link
    with written_beside(out_dir) as tmp, space_errors(tmp, "export target", shown=link):
        dense_state = {k: v for k, v in lm.model.state_dict().items()
                       if k not in parts.skip_keys and not k.endswith(".perm")}
        lm.model.save_pretrained(tmp, state_dict=dense_state)
        save_tokenizer(lm.tokenizer, tmp)
        (tmp / HF_LOADER_FILE).write_text(HF_LOADER)
        config = json.loads((tmp / "config.json").read_text())
        source_map = config.get("auto_map") or {}
        if runs_own_code(lm.model):   # its code files are kept; shuffleprune.load builds this class
            fmt["model_class"] = source_map["AutoModelForCausalLM"]
        config["auto_map"] = {**source_map, "AutoModelForCausalLM": f"{HF_LOADER_FILE[:-3]}.ShufflepruneForCausalLM"}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file({k: v.contiguous() for k, v in parts.sparse.items()}, str(tmp / SPARSE_FILE))
        (tmp / FORMAT_FILE).write_text(json.dumps(fmt, indent=2))
        if prune_report is not None:   # (its file, its contents)
            shutil.copy(prune_report[0], tmp / "prune_report.json")
        (tmp / "README.md").write_text(export_card(fmt, prune_report and prune_report[1], link.name))
