"""Input statistics of linear layers, gathered with forward hooks during the calibration pass.

Layers that read the very same input tensor (q/k/v, gate/up in LLaMA-style blocks) are found from
the forward pass itself and share one statistics object, so a Gram matrix is built once per group.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn


class InputStats:
    """Running sums over all calibration tokens of a layer's input ``X`` ``[tokens, C]``:
    ``sq_norm[j] = Σ_t x_tj²`` always, and the Gram matrix ``XᵀX`` when ``gram=True``."""

    def __init__(self, cols: int, gram: bool, device: torch.device):
        self.tokens = 0
        self.sq_norm = torch.zeros(cols, dtype=torch.float64, device=device)
        self.gram = torch.zeros(cols, cols, dtype=torch.float32, device=device) if gram else None

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.tokens += x.shape[0]
        self.sq_norm += x.double().pow(2).sum(0)
        if self.gram is not None:
            self.gram.addmm_(x.t(), x)

    def permuted(self, perm: torch.Tensor) -> "InputStats":
        """The statistics of the permuted input ``x[:, perm]`` (norms and Gram re-indexed, no new pass)."""
        out = InputStats(0, gram=False, device=self.sq_norm.device)
        perm = perm.to(self.sq_norm.device)
        out.tokens = self.tokens
        out.sq_norm = self.sq_norm[perm]
        out.gram = None if self.gram is None else self.gram[perm][:, perm]
        return out

    @property
    def col_norm(self) -> torch.Tensor:
        """``‖X_j‖₂`` per input column (float32)."""
        return self.sq_norm.sqrt().float()


@contextmanager
def collect_input_stats(linears: dict[str, nn.Linear], gram: bool) -> Iterator[dict[str, InputStats]]:
    """Hook ``linears``; yields ``{name: InputStats}`` where layers fed the same tensor share one object."""
    stats: dict[str, InputStats] = {}
    # Keeps the first-seen input tensors alive while hooked, so no later tensor can reuse an address.
    seen: dict[tuple, tuple[InputStats, torch.Tensor]] = {}
    grouped: dict[str, bool] = {}

    def hook_for(name: str):
        def hook(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0]
            key = (x.data_ptr(), tuple(x.shape), x.stride())
            if name not in stats:  # first call: join the group of any layer that read this tensor
                if key in seen:
                    shared = seen[key][0]
                    grouped[name] = False
                else:
                    shared = InputStats(x.shape[-1], gram, x.device)
                    seen[key] = (shared, x)
                    grouped[name] = True  # this layer accumulates for its group
                stats[name] = shared
            if grouped[name]:
                stats[name].add(x.detach())
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in linears.items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


def input_groups(stats: dict[str, InputStats]) -> list[list[str]]:
    """Names of layers that share one input, in first-seen order (e.g. [[q,k,v],[o],[gate,up],[down]])."""
    groups: dict[int, list[str]] = {}
    for name, s in stats.items():
        groups.setdefault(id(s), []).append(name)
    return list(groups.values())


def save_norms(stats: dict[str, InputStats], path) -> None:
    """Write each layer's ``Σ x²`` per input column (no Gram matrices) and which layers share an
    input to a safetensors file."""
    tokens = {s.tokens for s in stats.values()}
    save_file({name: s.sq_norm.detach().cpu().clone() for name, s in stats.items()}, str(path),
              metadata={"tokens": str(max(tokens) if tokens else 0), "groups": json.dumps(input_groups(stats))})


def load_norms(path) -> dict[str, InputStats]:
    """Read :func:`save_norms` back: norm-only ``InputStats``, one object per input group as collected."""
    out: dict[str, InputStats] = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        for group in json.loads(meta["groups"]):
            s = InputStats(0, gram=False, device=torch.device("cpu"))
            s.sq_norm, s.tokens = f.get_tensor(group[0]), int(meta["tokens"])
            out.update({name: s for name in group})
    return out
