"""A linear layer that reads its input at permuted addresses: ``y = W_p · x[perm] + b``, and the
index maps a ``--perm`` checkpoint keeps beside its weights.

``W_p = W[:, perm]`` is the pruned weight in the order an N:M kernel stores it (exactly N:M in
memory order); ``perm`` is the int index map saved next to a checkpoint pruned with ``--perm``.
This is the plain-PyTorch reference of what the deployable format runs.

A checkpoint stores every weight in its input's own column order (``W``, N:M in the map's order),
so any client that loads it as a plain transformers model computes the pruned model; the maps
(``index_maps.safetensors``) say in which order N:M holds, for ``export`` and the N:M check.
Checkpoints written before that stored mapped linears as ``W[:, perm]`` (their maps file carries
no ``weight_columns`` entry); :func:`weights_stored_permuted` tells them apart.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from shuffleprune.blocks import parse_expert_name
from shuffleprune.conv1d import plain_linear_like
from shuffleprune.errors import UserError, reason

INDEX_MAPS = "index_maps.safetensors"  # a --perm checkpoint's int32 input map per permuted linear
_LAYOUT_KEY = "weight_columns"  # the maps file's metadata: how the checkpoint stores mapped weights
_ORIGINAL = "original"


class PermutedLinear(nn.Linear):
    """``y = weight · x[..., perm] + bias`` with ``weight`` in permuted column order.

    A subclass of ``nn.Linear`` (same ``weight``/``bias`` attributes and shapes), so code that walks
    a model's linears — sparsity counts, device placement, lm-eval — sees it as one."""

    is_linear_map = True   # x ↦ W x + b, its W held in permuted column order (blocks.is_plain_linear)

    def __init__(self, weight: torch.Tensor, perm: torch.Tensor, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)
        if perm.numel() != weight.shape[1] or not torch.equal(perm.sort().values.cpu(), torch.arange(perm.numel())):
            raise UserError(f"index map of length {perm.numel()} is not a permutation of {weight.shape[1]} inputs")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("perm", perm.to(weight.device, torch.long))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, perm: torch.Tensor, weight_is_permuted: bool = False) -> "PermutedLinear":
        """From a linear whose weight is in the original column order (or already in permuted
        order, as stored in a ``--perm`` checkpoint, with ``weight_is_permuted``)."""
        perm = perm.to(linear.weight.device, torch.long)
        weight = linear.weight.detach() if weight_is_permuted else linear.weight.detach()[:, perm].contiguous()
        permuted = cls(weight, perm, None if linear.bias is None else linear.bias.detach())
        permuted.stores_transposed = getattr(linear, "stores_transposed", False)   # a GPT-2 Conv1D's, restored later
        return permuted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.index_select(-1, self.perm), self.weight, self.bias)


def apply_index_maps(model: nn.Module, maps: dict[str, torch.Tensor], weights_are_permuted: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` named in ``maps`` by a :class:`PermutedLinear` (in place), which
    computes the same function with its weight in the map's order (N:M in memory order).
    ``weights_are_permuted``: the model was loaded from a checkpoint of the older layout, whose
    mapped linears are stored as ``W[:, perm]``. Maps of MoE experts
    (:func:`~shuffleprune.blocks.expert_name`) are skipped: the fused tensor computes the pruned
    model as it is and only ``export`` reads their maps. (GPT-2's ``Conv1D`` layers are linears here:
    ``load_model`` holds them as :class:`~shuffleprune.conv1d.Conv1DAsLinear`.)"""
    for name, perm in maps.items():
        if parse_expert_name(name) is not None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child, None)
        if not isinstance(linear, nn.Linear) or isinstance(linear, PermutedLinear):
            raise UserError(f"index map names '{name}', which is not an (unpermuted) nn.Linear of this model")
        if perm.numel() != linear.in_features:
            raise UserError(f"index map '{name}' has {perm.numel()} entries for {linear.in_features} inputs: "
                            "index_maps.safetensors does not belong to this checkpoint")
        setattr(parent, child, PermutedLinear.from_linear(linear, perm, weights_are_permuted))
    return model


def to_plain_linears(model: nn.Module, keep: set[str] = frozenset()) -> list[str]:
    """Turn every :class:`PermutedLinear` not named in ``keep`` back into a plain ``nn.Linear`` with
    its weight in input order (``W_p[:, perm⁻¹]``, the same function), in place; returns their names."""
    restored = []
    for name, module in list(model.named_modules()):
        if isinstance(module, PermutedLinear) and name not in keep:
            plain = plain_linear_like(module, module.in_features, module.out_features, bias=module.bias is not None,
                                      device=module.weight.device, dtype=module.weight.dtype)
            plain.weight.data = module.weight.data[:, torch.argsort(module.perm)].contiguous()
            if module.bias is not None:
                plain.bias.data = module.bias.data
            model.set_submodule(name, plain)
            restored.append(name)
    return restored


def save_index_maps(maps: dict[str, torch.Tensor], path: Path | str) -> None:
    """Write index maps as int32 tensors (``index_maps.safetensors``) for a checkpoint that stores
    every weight in its input's own column order (recorded in the file's metadata)."""
    save_file({k: v.to(torch.int32).contiguous() for k, v in maps.items()}, str(path),
              metadata={_LAYOUT_KEY: _ORIGINAL})


def _unreadable(path: Path | str, exc: Exception) -> UserError:
    return UserError(f"cannot read the index maps '{path}': the file is truncated or corrupt ({reason(exc, 120)}); "
                     "write or copy that checkpoint again")


def weights_stored_permuted(path: Path | str) -> bool:
    """Whether the checkpoint whose maps file is ``path`` stores its mapped linears as ``W[:, perm]``
    (the layout before maps files recorded ``weight_columns``) rather than in input order."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(_LAYOUT_KEY) != _ORIGINAL
    except (OSError, SafetensorError) as exc:
        raise _unreadable(path, exc) from exc


def load_index_maps(path: Path | str) -> dict[str, torch.Tensor]:
    """Index maps saved by ``prune --perm`` (``index_maps.safetensors``), as int64 tensors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no index maps at '{path}'")
    try:
        return {k: v.long() for k, v in load_file(str(path)).items()}
    except (OSError, SafetensorError) as exc:
        raise _unreadable(path, exc) from exc
