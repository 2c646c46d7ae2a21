"""The start of a fine-tuning run (``shuffleprune finetune``): a pruned checkpoint, checked before anything is
written, loaded in float32 to train, and the files of the run that pruned it carried to the fine-tuned copy."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from shuffleprune.errors import UserError

# What a pruned checkpoint holds beside its weights that stays true of its fine-tuned copy: the report `export`
# reads the pattern and the pruned layers from, the index maps (the column order N:M holds in), the recipe.
RUN_FILES = ("prune_report.json", "index_maps.safetensors", "recipe.yaml")


def check_start(spec: str) -> None:
    """Refuse, before anything is read or written, a start that cannot be fine-tuned: one that cannot be loaded,
    or an export (its layers are compressed; fine-tune the checkpoint it was exported from)."""
    from shuffleprune.deploy.load import is_exported
    from shuffleprune.models import check_model_spec

    check_model_spec(spec)
    if is_exported(Path(spec).expanduser()):
        raise UserError(f"'{spec}' is an export (compressed N:M layers); fine-tune the pruned checkpoint it was "
                        "exported from, then export the result")


def pruned_start(cfg, tokenizer) -> tuple[torch.nn.Module, torch.dtype]:
    """``cfg.init`` loaded with ``tokenizer`` and raised to float32 (AdamW in 16 bits loses the small updates a
    fine-tune makes), and the dtype its fine-tuned copy is saved in: the checkpoint's own (bfloat16 for a GGUF)."""
    from shuffleprune.models import load_model

    loaded = load_model(cfg.init, tokenizer=tokenizer, trust_remote_code=cfg.trust_remote_code)
    save_dtype = loaded.save_dtype or loaded.model.dtype
    return loaded.model.float(), save_dtype


@torch.no_grad()
def round_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round ``model``'s floating-point parameters (what its checkpoint saves) to the values ``dtype`` holds, kept
    in their own dtype (a 16-bit forward on a CPU is many times slower than a float32 one of the same values)."""
    for tensor in model.parameters():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor.copy_(tensor.to(dtype))


def copy_run_files(spec: str | Path, into: Path) -> list[str]:
    """Copy :data:`RUN_FILES` that the checkpoint ``spec`` has into ``into``; the names copied."""
    from shuffleprune.models import resolve_model_path

    source = Path(resolve_model_path(str(spec)))
    copied = [name for name in RUN_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copy(source / name, into / name)
    return copied
