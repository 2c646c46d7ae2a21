"""Read a checkpoint written by ``shuffleprune export``: its format file and its compressed linears.

``attach_sparse_layers`` swaps a model's exported ``nn.Linear`` layers for :class:`SparseLinear`
modules built from ``sparse.safetensors`` (and holds its exported MoE experts compressed,
:mod:`shuffleprune.deploy.sparse_experts`) (N:M checked on load; a missing, truncated or corrupt
tensor is a one-line ``UserError``).
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from shuffleprune.deploy.format import check_compressed, check_index_map
from shuffleprune.deploy.shared_input import SharedGather
from shuffleprune.deploy.experts_load import attach_sparse_experts
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.errors import UserError

FORMAT_FILE = "shuffleprune_format.json"
SPARSE_FILE = "sparse.safetensors"
FORMAT_NAME, FORMAT_VERSION = "shuffleprune.nm", 3
READABLE_VERSIONS = (1, 2, 3)   # 2 added the fused MoE experts (``experts``), 3 experts in a layout of the model's own
                                # (an export without those is written as v2)


def is_exported(path: str | Path) -> bool:
    return (Path(path) / FORMAT_FILE).is_file()


def read_format(path: Path) -> dict:
    try:
        fmt = json.loads((path / FORMAT_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"unreadable {FORMAT_FILE} in '{path}': {exc}") from exc
    if fmt.get("format") != FORMAT_NAME or fmt.get("version") not in READABLE_VERSIONS:
        raise UserError(f"'{path}' has format {fmt.get('format')} v{fmt.get('version')}; "
                        f"this shuffleprune reads {FORMAT_NAME} v{', v'.join(map(str, READABLE_VERSIONS))}")
    return fmt


def attach_sparse_layers(model: nn.Module, path: Path, fmt: dict, policy: str = "auto") -> nn.Module:
    """Replace the exported linears of ``model`` by :class:`SparseLinear` from ``sparse.safetensors``."""
    try:
        tensors = load_file(str(path / SPARSE_FILE))
    except (OSError, SafetensorError) as exc:
        raise UserError(f"cannot read '{path / SPARSE_FILE}' (truncated or corrupt?): {exc}") from exc
    n, m = fmt["n"], fmt["m"]
    shares: dict[tuple, SharedGather] = {}
    for name, info in fmt["layers"].items():
        rows, cols = info["shape"]
        for part in ("values", "meta") + (("perm",) if info["perm"] else ()) + (("bias",) if info["bias"] else ()):
            if f"{name}.{part}" not in tensors:
                raise UserError(f"corrupt export: tensor '{name}.{part}' missing from {SPARSE_FILE}")
        values, meta = tensors[f"{name}.values"], tensors[f"{name}.meta"]
        check_compressed(f"{name}.values/meta", values, meta, (rows, cols), n, m)
        perm = tensors.get(f"{name}.perm")
        check_index_map(name, perm, cols)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child, None)
        if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != (rows, cols):
            raise UserError(f"exported layer '{name}' ({rows}×{cols}) does not match the model config")
        dtype = old.weight.dtype   # the dtype the model was loaded in, which may not be the export's
        bias = tensors.get(f"{name}.bias")
        layer = SparseLinear(values.to(dtype), meta, cols, n, m, perm, None if bias is None else bias.to(dtype),
                             policy=policy)
        if perm is not None:  # siblings (same parent module) with the same map share one gather
            key = (parent_name, tuple(perm.tolist()))
            layer.shared_gather = shares.setdefault(key, SharedGather()).join()
        setattr(parent, child, layer)
    attach_sparse_experts(model, tensors, fmt, policy)
    return model


def refuse_saving(model: nn.Module, path: Path | str) -> None:
    """Make ``save_pretrained`` and ``push_to_hub`` of a model loaded from an export a one-line error
    (before any repo is made): transformers would write its compressed layers in a form nothing reads
    back, as an untrained model. The export directory itself is the checkpoint to copy or upload."""
    def refused(*args, **kwargs):
        raise UserError(f"a model loaded from the export '{path}' cannot be saved with save_pretrained or push_to_hub "
                        f"(its compressed layers would be lost): copy or upload that directory itself "
                        f"(hf upload OWNER/NAME '{path}')")

    model.save_pretrained = model.push_to_hub = refused
