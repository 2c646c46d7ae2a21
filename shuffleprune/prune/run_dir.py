"""A prune run's ``--out``: checked before the run, cleared once its inputs have loaded, checkpointed
after every block under ``.resume/`` (which ``--resume`` continues from), and cleaned after a failure.

This is the one module that knows the ``.resume/`` layout: ``state.json`` (the state every checkpoint
updates), ``data.pt`` (calibration windows and held-out tokens), and per block ``block_{i}.safetensors``,
``perms_{i}.safetensors``, then the next block's inputs ``hidden_{i+1}.pt`` (``dense_hidden_{i+1}.pt``
for the dense stream).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shuffleprune.blocks import Blocks, text_config
from shuffleprune.errors import UserError
from shuffleprune.outdir import clear_dir, check_writable, refuse_clearing_inputs
from shuffleprune.perm.linear import load_index_maps, save_index_maps
from shuffleprune.prune.atomic import atomic_json, atomic_save
from shuffleprune.runtime.memory import tensor_bytes

RESUME_DIR = ".resume"
STATE_FILE = "state.json"


def resumable(out: Path | str | None) -> bool:
    """Whether ``out`` holds the state of an interrupted run that ``--resume`` can continue."""
    return out is not None and (Path(out) / RESUME_DIR / STATE_FILE).is_file()


def work_dir(out: Path | None) -> Path | None:
    """Where a run with ``--out`` keeps its checkpoints (None without ``--out``)."""
    return out / RESUME_DIR if out is not None else None


def prepare_out(out: Path | None, resume: bool, overwrite: bool, inputs: list[str | None]) -> dict | None:
    """Validate ``--out`` (never one holding the run's ``inputs``); return the saved resume state when resuming.
    A fresh run's ``--out`` is emptied later, once the model has loaded (:func:`clear_out`)."""
    if out is None:
        if resume:
            raise UserError("--resume needs --out DIR (where the interrupted run checkpointed)")
        return None
    check_writable(out, "--out")
    state_file = out / RESUME_DIR / STATE_FILE
    if resume:
        if not state_file.is_file():
            raise UserError(f"nothing to resume in '{out}': no {RESUME_DIR}/{STATE_FILE} (run without --resume)")
        return json.loads(state_file.read_text())
    if out.exists() and any(out.iterdir()):
        refuse_clearing_inputs(out, inputs)
        leftover = [p.name for p in out.iterdir()] == [RESUME_DIR] and not state_file.is_file()
        if not overwrite and not leftover:  # a run stopped before its first checkpoint left nothing to keep
            hint = "--resume to continue it, or " if state_file.is_file() else ""
            raise UserError(f"output dir '{out}' is not empty; use {hint}--overwrite, or another --out")
    return None


def clear_out(out: Path | None, resume: bool) -> None:
    """Empty a fresh run's ``--out`` (checked by :func:`prepare_out`): only once the model has
    loaded and its layers are selected, so a model that fails to load never costs an earlier run's output."""
    if out is not None and not resume and out.exists() and any(out.iterdir()):
        clear_dir(out)


def discard_unresumable(out: Path, existed: bool) -> None:
    """After a failed run: remove what it wrote before its first checkpoint (``.resume`` without a
    ``state.json``: nothing ``--resume`` could continue), and ``out`` itself if this run created it
    and it is empty again."""
    work = out / RESUME_DIR
    if work.is_dir() and not (work / STATE_FILE).is_file():
        shutil.rmtree(work, ignore_errors=True)
    if not existed and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def finish(out: Path) -> None:
    """A run's checkpoint is written: its ``.resume`` goes."""
    shutil.rmtree(out / RESUME_DIR, ignore_errors=True)


def disk_need(model: torch.nn.Module, blocks: Blocks, tokens: int, dense_stream: bool,
              save_dtype: torch.dtype) -> tuple[int, int]:
    """About the bytes a run writes in ``--out``: the checkpoint it ends with (every parameter in
    ``save_dtype``), and its peak, with the per-block checkpoints (in the compute dtype) and two
    copies of the calibration activations between blocks (per stream) still there."""
    result = sum(p.numel() for p in model.parameters()) * torch.finfo(save_dtype).bits // 8
    block_files = tensor_bytes(blocks.layers.parameters())
    return result, result + block_files + 2 * activation_bytes(model, tokens) * (2 if dense_stream else 1)


def activation_bytes(model: torch.nn.Module, tokens: int) -> int:
    """The bytes of one block's inputs (or outputs) for ``tokens`` calibration tokens in the compute dtype."""
    embed = model.get_input_embeddings()
    width = getattr(text_config(model), "hidden_size", None) or (embed.weight.shape[1] if embed is not None else 0)
    return tokens * width * next(model.parameters()).element_size()


def save_state(state: dict, work: Path) -> None:
    """Write the run's state whole (a reader sees the old or the new one)."""
    atomic_json(state, work / STATE_FILE)


def save_data(work: Path, tokens: torch.Tensor, held_out: torch.Tensor | None) -> None:
    """Keep a new run's calibration windows and held-out tokens for ``--resume``."""
    atomic_save({"tokens": tokens, "held_out": held_out}, work / "data.pt")


def load_data(work: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The calibration windows and held-out tokens an interrupted run saved."""
    data = torch.load(work / "data.pt")
    return data["tokens"], data["held_out"]


def _inputs_file(work: Path, index: int, dense: bool = False) -> Path:
    """Where block ``index``'s inputs are kept (``dense``: the dense stream's)."""
    return work / f"{'dense_' if dense else ''}hidden_{index}.pt"


def _block_file(work: Path, index: int) -> Path:
    """Where block ``index``'s pruned weights are kept."""
    return work / f"block_{index}.safetensors"


def _maps_file(work: Path, index: int) -> Path:
    """Where block ``index``'s index maps are kept (a block without maps has none)."""
    return work / f"perms_{index}.safetensors"


def load_inputs(work: Path, index: int, dense: bool = False) -> torch.Tensor:
    """Block ``index``'s inputs as the interrupted run checkpointed them (``dense``: the dense stream's)."""
    return torch.load(_inputs_file(work, index, dense))


def load_block(work: Path, index: int, block: torch.nn.Module) -> None:
    """Load block ``index``'s pruned weights, as the interrupted run checkpointed them, into ``block``."""
    block.load_state_dict(load_file(str(_block_file(work, index))))


def done_index_maps(work: Path, start: int) -> dict[str, torch.Tensor]:
    """The index maps of the ``start`` blocks an interrupted run finished."""
    maps: dict[str, torch.Tensor] = {}
    for j in range(start):
        if _maps_file(work, j).is_file():
            maps.update(load_index_maps(_maps_file(work, j)))
    return maps


def checkpoint_block(work: Path, i: int, block: torch.nn.Module, perms: dict, next_hidden: torch.Tensor | None,
                     state: dict, next_dense: torch.Tensor | None = None) -> None:
    """Save block ``i``'s weights, maps and outputs (and the dense stream's), then the state that
    points past it (a resume finds either the old state or all of the new files)."""
    save_file({k: v.contiguous() for k, v in block.state_dict().items()}, str(_block_file(work, i)))
    if perms:
        save_index_maps(perms, _maps_file(work, i))
    if next_hidden is not None:
        atomic_save(next_hidden.cpu(), _inputs_file(work, i + 1))
    if next_dense is not None:
        atomic_save(next_dense.cpu(), _inputs_file(work, i + 1, dense=True))
    save_state(state, work)
    _inputs_file(work, i).unlink(missing_ok=True)
    _inputs_file(work, i, dense=True).unlink(missing_ok=True)
