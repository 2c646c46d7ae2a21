"""What a pruning run leaves behind: ``prune_report.json``, the HF checkpoint (permuted linears in
N:M memory order plus their index maps), ``recipe.yaml`` and a ``README.md`` model card."""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from shuffleprune.blocks import OUTSIDE_LINEARS_WARN_SHARE
from shuffleprune.calib.sources import MEMORY_PREFIX, held_out_part
from shuffleprune.version import __version__
from shuffleprune.masks import Pattern
from shuffleprune.models import LoadedModel, base_model_id, is_embedded, trust_snippets
from shuffleprune.perm.linear import INDEX_MAPS, save_index_maps
from shuffleprune.prune.config import PruneConfig
from shuffleprune.report import tokens_scored
from shuffleprune.runtime.facts import cpu_facts, gpu_facts, versions
from shuffleprune.runtime.memory import peak_rss_mb, tensor_bytes
from shuffleprune.tokenizer_files import save_tokenizer

REPORT_NAME = "prune_report.json"
RECIPE_NAME = "recipe.yaml"
CARD_NAME = "README.md"


def _overall_sparsity(layers: list[dict]) -> float:
    total = sum(l["shape"][0] * l["shape"][1] for l in layers)
    zeros = sum(l["sparsity"] * l["shape"][0] * l["shape"][1] for l in layers)
    return round(zeros / total, 6) if total else 0.0


def _experts_line(report: dict) -> str:
    """The model card's line on the pruned experts of fused MoE layers, when there are any."""
    experts = [l for l in report["layers"] if l.get("expert")]
    if not experts:
        return ""
    by_magnitude = sum(len(b.get("experts_pruned_by_magnitude", [])) for b in report.get("stage_blocks", []))
    mapped = sum("perm_strength" in l for l in experts)
    return (f"\n- MoE experts: {len(experts)} expert matrices pruned on the calibration tokens routed to each"
            f"{f' ({by_magnitude} that no token reached by magnitude)' if by_magnitude else ''}"
            f"{f', {mapped} with their own index map (kept in their own column order here)' if mapped else ''}.")


def _outside_line(report: dict) -> str:
    """The model card's line on matrix weights outside ``nn.Linear`` layers and fused experts, when there are many."""
    unseen = report.get("outside_linears") or {}
    if unseen.get("share", 0) <= OUTSIDE_LINEARS_WARN_SHARE:
        return ""
    return (f"\n- Not pruned: {unseen['share']:.0%} of the decoder blocks' weights are outside `nn.Linear` layers "
            f"and fused experts (e.g. `{unseen['names'][0]}`: custom layers) and stay dense.")


def build_report(config: PruneConfig, lm: LoadedModel, state: dict, pattern: Pattern, perms: dict,
                 device: torch.device, compute_dtype: str, save_dtype: str, resumed: bool, seconds: float) -> dict:
    """The run's ``prune_report.json`` contents."""
    texts = state["texts"]
    perm_stage = next((s for s in config.stages if "permutation" in s), None)
    perm = None
    if perm_stage is not None:
        name = perm_stage["permutation"]
        options = {k: v for k, v in perm_stage.items() if k != "permutation"}
        perm = {"perm": "none" if name == "from" else name, **options,
                "from": options.get("path") if name == "from" else None, "blocks": state["perm_blocks"],
                "model": state.get("perm_model"), "index_maps": INDEX_MAPS if perms else None}
    stats = config.stage_name("statistics")
    gpu = gpu_facts(device)
    return {
        "tool": "shuffleprune", "version": __version__,
        "model": lm.source, "model_path": lm.path, "recipe": config.effective_recipe(),
        "stages": config.stage_labels(),
        "method": config.method, "pattern": str(pattern), "target_sparsity": pattern.sparsity,
        "calib": {"source": config.calib, "nsamples": config.nsamples, "seqlen": state["seqlen"], "seed": config.seed,
                  "documents": texts["calib"]["documents"], "tokens": texts["calib"]["tokens"],
                  "split_from_shared_file": texts["shared_file_split"],
                  **{key: texts["calib"][key] for key in ("conversations", "chat_template") if key in texts["calib"]}},
        "eval": {"text": texts["eval_text"],
                 "split": held_out_part(texts["eval_text"], texts["shared_file_split"]) if texts["eval_text"] else None,
                 "ctx": state["eval_ctx"], "tokens": state["eval_tokens"],
                 **({"documents": texts["eval"]["documents"], "tokens_available": texts["eval"]["tokens_available"],
                     "tokens_scored": texts["eval"]["tokens_scored"],
                     "block_by_block": texts["eval"].get("block_by_block", False)} if texts["eval"] else {})},
        "bos": texts["bos"], "bos_mode": texts.get("bos_mode"),
        "ppl": {"dense": state["dense_ppl"], "pruned": state["pruned_ppl"]},
        "sparsity": _overall_sparsity(state["layers"]),
        "nm_ok": all(l["nm_ok"] for l in state["layers"]) if pattern.is_nm else None,
        "layers": state["layers"],
        "perm": perm,
        "stage_blocks": state.get("stage_blocks", []),
        # per stage: seconds in all, per block, and the peak memory (process RSS on the CPU, CUDA
        # allocated on a GPU) while it ran; prepare-time work (whole-model passes) is in seconds.prune
        "stage_cost": {k: {"seconds": round(v["seconds"], 2), "seconds_per_block": round(v["seconds"] / max(1, v["blocks"]), 3),
                           "peak_mb": round(v["peak_mb"], 1)} for k, v in state.get("stage_cost", {}).items()},
        "mask_stats": stats if config.method != "magnitude" else None,
        "seconds": {"calibration": round(state["calib_seconds"], 2), "prune": round(state["prune_seconds"], 2),
                    "eval": round(state["eval_seconds"], 2), "this_process": round(seconds, 2)},
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "peak_cuda_mb": gpu.get("peak_cuda_mb"),
        "device": str(device), "compute_dtype": compute_dtype, "saved_dtype": save_dtype,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "machine": {**cpu_facts(), **({"gpu": gpu["gpu"]} if gpu else {})},
        "resumed": resumed, "command": " ".join(sys.argv),
        "versions": versions(),
        "config": asdict(config),
    }


def _disk_full(exc: BaseException) -> bool:
    """``OSError(ENOSPC)``, or safetensors' wrapped form of it (not an ``OSError``)."""
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)


def write_checkpoint(out: Path, model, tokenizer, report: dict, perms: dict[str, torch.Tensor],
                     config: PruneConfig) -> None:
    """Write into ``out/.staging``, then move the files into ``out`` (a failed write leaves none)."""
    from shuffleprune.errors import UserError

    staging = out / ".staging"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        # every weight in its input's own column order: any client computes the pruned model; N:M
        # holds in each map's order, which the maps file gives to `export` and the N:M check
        model.save_pretrained(staging)
        save_tokenizer(tokenizer, staging)
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2))
        (staging / RECIPE_NAME).write_text(config.to_yaml())
        (staging / CARD_NAME).write_text(model_card(report))
        if perms:
            save_index_maps(perms, staging / INDEX_MAPS)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if _disk_full(exc):
            need = tensor_bytes(model.state_dict().values()) / 2**30
            raise UserError(f"no space left on the device of '{out}' for the checkpoint (~{need:.1f} GiB): free "
                            "space or pick another --out; rerun the same command with --resume to write it "
                            "without pruning again") from exc
        raise
    for item in staging.iterdir():
        os.replace(item, out / item.name)
    staging.rmdir()


def _ppl(x: float | None) -> str:
    return "not measured" if x is None else f"{x:.2f}"


def _bos_note(report: dict) -> str:
    if report["bos"]:
        return ", each starting with BOS"
    return ", BOS only at the start of the text, as SparseGPT and Wanda" if report.get("bos_mode") == "text" else ""


def _repeat_line(report: dict) -> str:
    """The command that repeats the run; a Python call when its texts were documents in memory."""
    base = report["model"]
    trust_arg, trust_flag = trust_snippets(_runs_own_code(report))
    in_memory = [k for k, t in (("calib", report["calib"]["source"]), ("eval_text", report["eval"]["text"]))
                 if str(t).startswith(MEMORY_PREFIX)]
    if in_memory:
        texts = ", ".join(f"{k}=<the same documents>" for k in in_memory)
        return (f"`shuffleprune.prune({None if base.startswith('embedded:') else base!r}, \"PATH/recipe.yaml\", "
                f"{texts}{trust_arg})`")
    return f"`shuffleprune prune {'' if base.startswith('embedded:') else base + ' '}--recipe PATH/recipe.yaml{trust_flag} --out OUT`"


def _runs_own_code(report: dict) -> bool:
    """Whether the run loaded a model that ships its own code (``trust_remote_code``)."""
    return bool((report.get("config") or {}).get("trust_remote_code"))


def model_card(report: dict) -> str:
    """A hub-style ``README.md`` for the pruned checkpoint."""
    base = report["model"]
    base_line = "the embedded SmolLM2-135M-Instruct (GGUF)" if is_embedded(base) or base.startswith("embedded:") else f"`{base}`"
    calib, ev, recipe = report["calib"], report["eval"], report["recipe"]
    stages = "\n".join(f"  - {s}" for s in report["stages"])
    perm_note = ("The weights are stored in their usual column order, so `AutoModelForCausalLM.from_pretrained` "
                 "(and lm-eval, vLLM, …) computes the pruned model. A permuted layer is N:M in the order of its "
                 "input index map (`index_maps.safetensors`), not in memory order: `shuffleprune export` "
                 "compresses it in that order for the 2:4 runtime.\n"
                 if report["perm"] and report["perm"].get("index_maps") else "")
    part = held_out_part(str(ev["text"]), calib["split_from_shared_file"]) if ev["text"] else ""
    eval_line = (f"{ev['text']} ({part}, {tokens_scored(ev)} tokens scored in windows of "
                 f"{ev['ctx']}{_bos_note(report)})" if ev["text"] else "not measured")
    # its model code, saved beside it, runs only when trusted
    trust_arg, trust_flag = trust_snippets(_runs_own_code(report))
    tags = ["shuffleprune", "pruned", "sparse", f"sparsity-{report['pattern']}"]
    hub_base = base_model_id(base)
    return f"""---
{f"base_model: {hub_base}{chr(10)}" if hub_base else ""}library_name: transformers
tags:
{chr(10).join('- ' + t for t in tags)}
---

# {Path(str(base)).name} · {report['pattern']} ({recipe['recipe']})

Pruned from {base_line} to **{report['pattern']}** sparsity ({report['sparsity']:.2%} of the pruned layers' weights
are zero) with [shuffleprune](https://pypi.org/project/shuffleprune/) {report['version']}.

| | perplexity |
|---|---|
| dense | {_ppl(report['ppl']['dense'])} |
| pruned | {_ppl(report['ppl']['pruned'])} |

Perplexity text: {eval_line}.

## How it was made

- Recipe `{recipe['recipe']}` (all settings in `recipe.yaml`), stages:
{stages}
- Calibration: {calib['source']}, {calib['nsamples']} windows of {calib['seqlen']} tokens, seed {calib['seed']}
  ({calib['documents']} document{'' if calib['documents'] == 1 else 's'}{'' if calib['tokens'] is None else f", {calib['tokens']} tokens"}{
  ", the rest of the text perplexity reads" if calib['split_from_shared_file'] else ""}).
- N:M holds for every pruned layer in the column order the export stores it: {report['nm_ok']}.{_experts_line(report)}{_outside_line(report)}
- Saved in {report['saved_dtype'].replace('torch.', '')}; computed in {report['compute_dtype'].replace('torch.', '')} on {report['device']}.

Repeat the run: {_repeat_line(report)}.

## Load it

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("PATH"{trust_arg})   # the pruned model, like any HF checkpoint
```

{perm_note}For a compressed, deployable copy: `shuffleprune export PATH DEPLOYED{trust_flag}`, then
`AutoModelForCausalLM.from_pretrained("DEPLOYED", trust_remote_code=True)` or `shuffleprune.load("DEPLOYED")`.
"""
