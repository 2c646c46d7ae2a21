"""A linear layer that reads its input at permuted addresses: ``y = W_p · x[perm] + b``.

``W_p = W[:, perm]`` is the pruned weight in the order an N:M kernel stores it (exactly N:M in
memory order); ``perm`` is the int index map saved next to a checkpoint pruned with ``--perm``.
This is the plain-PyTorch reference of what the deployable format runs.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from shuffleprune.blocks import parse_expert_name
from shuffleprune.errors import UserError

INDEX_MAPS = "index_maps.safetensors"  # a --perm checkpoint's int32 input map per permuted linear (weights stored as W[:, perm])


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
        return cls(weight, perm, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.index_select(-1, self.perm), self.weight, self.bias)


def apply_index_maps(model: nn.Module, maps: dict[str, torch.Tensor], weights_are_permuted: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` named in ``maps`` by a :class:`PermutedLinear` (in place).
    ``weights_are_permuted``: the model was loaded from a ``--perm`` checkpoint, whose weights are
    stored in permuted column order. Maps of MoE experts (:func:`~shuffleprune.blocks.expert_name`)
    are skipped: a checkpoint keeps experts in their own column order (the fused tensor computes the
    pruned model as it is) and only ``export`` reads their maps."""
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


def permuted_state_dict(model: nn.Module, maps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with the weight of every linear in ``maps`` in permuted column order
    (``W[:, perm]``: exactly N:M in memory order) — what a ``--perm`` checkpoint stores. MoE experts
    keep their column order (see :func:`apply_index_maps`)."""
    state = dict(model.state_dict())
    for name, perm in maps.items():
        if parse_expert_name(name) is not None:
            continue
        key = f"{name}.weight"
        state[key] = state[key][:, perm.to(state[key].device)].contiguous()
    return state


def save_index_maps(maps: dict[str, torch.Tensor], path: Path | str) -> None:
    """Write index maps as int32 tensors (``index_maps.safetensors``)."""
    save_file({k: v.to(torch.int32).contiguous() for k, v in maps.items()}, str(path))


def load_index_maps(path: Path | str) -> dict[str, torch.Tensor]:
    """Index maps saved by ``prune --perm`` (``index_maps.safetensors``), as int64 tensors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no index maps at '{path}'")
    return {k: v.long() for k, v in load_file(str(path)).items()}
