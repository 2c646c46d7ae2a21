"""ShuffleSparse's DST regime on one layer: its input permutation, soft (a doubly stochastic mixing
``M`` trained with the model) until hardened into an index map, applied on the weight side.

A linear layer gets a forward that applies it (:func:`attach_to_linear`). The experts of a fused MoE
layer, or of a model's own stacked layout (:func:`attach_to_experts`), run the module's own forward
on their parameters rebuilt with each soft expert's mixed weight; once an expert's map is hard the sparsifier stores that expert in its
plain column order (as a ``prune --perm`` checkpoint keeps experts) and the map only orders its mask."""
from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from shuffleprune.blocks import ExpertWeight
from shuffleprune.dst.layers import out_in
from shuffleprune.perm.core import SoftPermutation, unpermute_columns


def permuted_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a layer with an input permutation, applied on the weight side:
    ``x (W Mᵀ)ᵀ + b`` while soft — the same product as ``(x M) Wᵀ + b``, at ``out·d²`` instead of
    ``tokens·d²`` per pass — and ``x (W[:, perm⁻¹])ᵀ + b`` once hard, the same as
    ``x[perm] Wᵀ + b`` with the gather on the weight (``out × d``) instead of on the activations
    (``tokens × d``). Training steps have far more tokens than a layer has outputs. (An exported
    model gathers the input instead: at inference the token count is small.)"""
    w = module._input_perm.weight_view(out_in(module, module.weight))
    return nn.functional.linear(x, w, module.bias)


def average_across_processes(params: list[torch.Tensor]) -> None:
    """Average the task gradients of parameters that are not the model's (the soft permutations)
    over the processes of a distributed run, as DDP does for the model's own: every process then
    takes the same permutation step. No-op in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]).to(device)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p).to(p.device, p.dtype)


def permuted_experts_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module that runs experts with soft input permutations (a fused experts layer,
    or the scope of experts stacked in a model's own layout): the module's own forward, with each
    parameter that holds such experts rebuilt with their ``W_e M_eᵀ`` (differentiable in ``W`` and
    ``M``); experts with a hard map or none are used as stored."""
    swapped = {}
    for (owner, pname), perms in module._expert_perms.items():
        soft = [(expert, p) for expert, p in perms.values() if p.soft is not None]
        if soft:
            param = owner._parameters[pname]
            weights = {e.index: p.weight_view(e.matrix(param)) for e, p in soft}
            swapped[(owner, pname)] = soft[0][0].rebuilt(weights, param)
    stored = {key: key[0]._parameters[key[1]] for key in swapped}
    for (owner, pname), t in swapped.items():  # read by attribute inside the forward, restored below
        owner._parameters[pname] = t
    try:
        return module._unpermuted_forward(*args, **kwargs)
    finally:
        for (owner, pname), p in stored.items():
            owner._parameters[pname] = p


class InputPermutation:
    """The input permutation of one layer: soft (mixing ``M``, learned) until hardened, then the
    index map ``perm`` (the layer computes ``W · x[perm]``). ``M`` is not a parameter of the model
    (the sparsifier owns it)."""

    def __init__(self, size: int, perm: torch.Tensor | None = None, init: float = 0.5):
        self.size = size
        self.soft = None if perm is not None else SoftPermutation(size, block=size, init_identity=init)
        self.hard = perm
        self.hardened_at: int | None = None if perm is None else 0
        self.penalty_curve: list[float] = []
        self.penalty_now: float | None = None  # P(M) of the current soft M (cached between steps)

    @property
    def hard(self) -> torch.Tensor | None:
        return self._hard

    @hard.setter
    def hard(self, perm: torch.Tensor | None) -> None:
        self._hard = perm
        self._inverse = None if perm is None else torch.argsort(perm)

    def weight_view(self, w: torch.Tensor) -> torch.Tensor:
        """``W`` ``[rows, in]`` acting on the permuted input, re-expressed on the plain input."""
        if self.soft is None:
            return w.index_select(1, self._inverse.to(w.device))
        return unpermute_columns(w, [b.to(w.device, w.dtype) for b in self.soft.soft()])

    @torch.no_grad()
    def current_penalty(self) -> float:
        if self.penalty_now is None:
            self.penalty_now = float(self.soft.penalty())
        return self.penalty_now

    def harden(self, step: int, perm: torch.Tensor | None = None) -> None:
        """Hungarian on the soft ``M`` (or the given ``perm``, when resuming); from now on ``x[perm]``."""
        self.hard = self.soft.harden() if perm is None else perm
        self.hardened_at, self.soft, self.penalty_now = step, None, None


def attach_to_linear(module: nn.Module, perm: InputPermutation) -> None:
    """The linear (or ``Conv1D``) computes :func:`permuted_forward` from now on."""
    module._input_perm = perm
    module.forward = types.MethodType(permuted_forward, module)


def attach_to_experts(expert: ExpertWeight, perm: InputPermutation, host: nn.Module) -> None:
    """``expert`` (one matrix of a fused or stacked experts parameter) reads its input through
    ``perm`` while ``perm`` is soft: ``host``, the module whose forward holds every use of the
    parameter (the experts layer, or a traced layout's scope), runs :func:`permuted_experts_forward`."""
    if not hasattr(host, "_expert_perms"):
        host._expert_perms = {}
        host._unpermuted_forward = host.forward
        host.forward = types.MethodType(permuted_experts_forward, host)
    host._expert_perms.setdefault((expert.owner, expert.param), {})[expert.index] = (expert, perm)
