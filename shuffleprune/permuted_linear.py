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

from .errors import UserError


class PermutedLinear(nn.Module):
    """``y = weight · x[..., perm] + bias`` with ``weight`` in permuted column order."""

    def __init__(self, weight: torch.Tensor, perm: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if perm.numel() != weight.shape[1] or not torch.equal(perm.sort().values.cpu(), torch.arange(perm.numel())):
            raise UserError(f"index map of length {perm.numel()} is not a permutation of {weight.shape[1]} inputs")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("perm", perm.to(torch.long))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, perm: torch.Tensor) -> "PermutedLinear":
        """From a linear whose weight is in the original column order."""
        perm = perm.to(linear.weight.device, torch.long)
        return cls(linear.weight.detach()[:, perm].contiguous(), perm,
                   None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.index_select(-1, self.perm), self.weight, self.bias)


def apply_index_maps(model: nn.Module, maps: dict[str, torch.Tensor]) -> nn.Module:
    """Replace every ``nn.Linear`` named in ``maps`` by a :class:`PermutedLinear` (in place)."""
    for name, perm in maps.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child, None)
        if not isinstance(linear, nn.Linear):
            raise UserError(f"index map names '{name}', which is not an nn.Linear of this model")
        setattr(parent, child, PermutedLinear.from_linear(linear, perm))
    return model


def save_index_maps(maps: dict[str, torch.Tensor], path: Path | str) -> None:
    """Write index maps as int32 tensors (``index_maps.safetensors``)."""
    save_file({k: v.to(torch.int32).contiguous() for k, v in maps.items()}, str(path))


def load_index_maps(path: Path | str) -> dict[str, torch.Tensor]:
    """Index maps saved by ``prune --perm`` (``index_maps.safetensors``), as int64 tensors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no index maps at '{path}'")
    return {k: v.long() for k, v in load_file(str(path)).items()}
