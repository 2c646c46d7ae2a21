"""Input statistics of linear layers, gathered with forward hooks during the calibration pass.

Layers that read the very same input tensor (q/k/v, gate/up in LLaMA-style blocks) are found from
the forward pass itself and share one statistics object, so a Gram matrix is built once per group.
The experts of fused MoE layers get the statistics of the tokens routed to each of them.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode

from shuffleprune.blocks import ExpertWeight, expert_name, experts_by_tensor, is_fused_experts
from shuffleprune.errors import UserError
from shuffleprune.stacked_experts import matmul_operands, operand_key


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
def collect_input_stats(linears: dict[str, nn.Module | ExpertWeight], gram: bool) -> Iterator[dict[str, InputStats]]:
    """Hook ``linears``; yields ``{name: InputStats}`` where layers fed the same tensor share one object.

    An :class:`ExpertWeight` entry gathers the tokens routed to its expert: while collecting, its
    experts layer runs transformers' eager experts forward (one ``F.linear``/matmul per expert) and a
    torch function mode catches the calls on that expert's slice. An expert no token reached keeps
    ``tokens == 0``.
    """
    stats: dict[str, InputStats] = {}
    # Keeps the first-seen input tensors alive while hooked, so no later tensor can reuse an address.
    seen: dict[tuple, tuple[InputStats, torch.Tensor]] = {}
    grouped: dict[str, bool] = {}

    def record(name: str, x: torch.Tensor) -> None:
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

    modules = {n: m for n, m in linears.items() if not isinstance(m, ExpertWeight)}
    experts = {n: e for n, e in linears.items() if isinstance(e, ExpertWeight)}
    handles = [m.register_forward_pre_hook(lambda _m, inputs, n=n: record(n, inputs[0])) for n, m in modules.items()]
    try:
        if experts:
            with _RoutedInputs(experts, record):
                yield stats
            _check_experts_seen(experts, stats)
            for name, e in experts.items():  # experts that no calibration token reached
                if name not in stats:
                    stats[name] = InputStats(e.in_features, gram, e.weight.device)
        else:
            yield stats
    finally:
        for h in handles:
            h.remove()


def _check_experts_seen(experts: dict[str, ExpertWeight], stats: dict[str, InputStats]) -> None:
    """Every token is routed to some expert of each experts layer it passes, so a layer none of whose
    experts saw a token (after a forward pass that reached its linears) applies them in a way the
    routed-input capture does not see: refuse it rather than prune it blind."""
    if not stats:
        return  # nothing ran
    for fused, members in experts_by_tensor(experts).items():
        if not any(expert_name(fused, e) in stats for e in members):
            layer = fused.rpartition(".")[0]
            raise UserError(f"no calibration token reached the experts of '{layer}' through F.linear or a matmul on "
                            f"one expert's slice (an experts forward shuffleprune cannot follow); leave them dense "
                            f"with --skip '{layer}.*'")


class _RoutedInputs(TorchFunctionMode):
    """While active: fused experts layers run transformers' eager experts forward, and each
    ``F.linear(x, P[e])`` / ``x @ P[e]`` on an expert slice of ``experts`` passes ``x`` (the tokens
    routed to that expert) to ``record``. A product over all of a parameter's experts at once
    (``torch.bmm(x, P)``, every token through every expert with its router weight folded into ``x``)
    passes each expert its rows of ``x`` that are not zero (the tokens routed to it)."""

    def __init__(self, experts: dict[str, ExpertWeight], record: Callable[[str, torch.Tensor], None]):
        super().__init__()
        self.record = record
        self.experts = experts
        owners = [e.owner for e in experts.values() if is_fused_experts(e.owner)]
        self.configs = {id(o.config): o.config for o in owners}
        self.saved: dict[int, str | None] = {}

    def __enter__(self):
        # Keyed by each operand's start, shape and strides as the layer passes it ([in, out]): one
        # expert's slice, or all of a parameter's experts as [experts, in, out].
        self.slices, self.stacks = {}, {}
        for name, e in self.experts.items():
            self.slices[operand_key(e.weight.t())] = name
            stack = e.fused() if e.transposed else e.fused().transpose(1, 2)
            self.stacks.setdefault(operand_key(stack), {})[e.index] = name
        for key, config in self.configs.items():
            self.saved[key] = config._experts_implementation
            config._experts_implementation = "eager"
        return super().__enter__()

    def __exit__(self, *exc):
        for key, config in self.configs.items():
            config._experts_implementation = self.saved[key]
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        operands = matmul_operands(func, args, kwargs)
        if operands is not None:
            x, w = operands
            if w.dim() == 2:
                name = self.slices.get(operand_key(w))
                if name is not None:
                    self.record(name, x)
            elif x.dim() == 3 and x.shape[0] == w.shape[0]:
                for e, name in self.stacks.get(operand_key(w), {}).items():
                    rows = x[e]
                    rows = rows[rows.abs().amax(-1) > 0]
                    if rows.shape[0]:
                        self.record(name, rows)
        return func(*args, **(kwargs or {}))


def input_groups(stats: dict[str, InputStats]) -> list[list[str]]:
    """Names of layers that share one input, in first-seen order (e.g. [[q,k,v],[o],[gate,up],[down]])."""
    groups: dict[int, list[str]] = {}
    for name, s in stats.items():
        groups.setdefault(id(s), []).append(name)
    return list(groups.values())


def save_norms(stats: dict[str, InputStats], path) -> None:
    """Write each layer's ``Σ x²`` per input column (no Gram matrices), which layers share an input
    and each group's token count (experts see only their routed tokens) to a safetensors file."""
    groups = input_groups(stats)
    save_file({name: s.sq_norm.detach().cpu().clone() for name, s in stats.items()}, str(path),
              metadata={"groups": json.dumps(groups), "group_tokens": json.dumps([stats[g[0]].tokens for g in groups])})


def load_norms(path) -> dict[str, InputStats]:
    """Read :func:`save_norms` back: norm-only ``InputStats``, one object per input group as collected."""
    out: dict[str, InputStats] = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        groups = json.loads(meta["groups"])
        tokens = json.loads(meta["group_tokens"]) if "group_tokens" in meta else [int(meta["tokens"])] * len(groups)
        for group, count in zip(groups, tokens):
            s = InputStats(0, gram=False, device=torch.device("cpu"))
            s.sq_norm, s.tokens = f.get_tensor(group[0]), count
            out.update({name: s for name in group})
    return out
