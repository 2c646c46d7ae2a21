"""Dynamic sparse training: a sparsifier in the torch.ao.pruning style for a user's own training loop.

    sparsifier = DynamicSparsifier(DSTConfig(method="rigl", sparsity=0.9, t_end=7500))
    sparsifier.prepare(model, optimizer)          # masks every nn.Linear / transformers Conv1D
    for batch in data:                            # (except the layer tied to the input embeddings)
        loss = model(**batch).loss; loss.backward()
        optimizer.step(); sparsifier.step(); optimizer.zero_grad()

To resume: ``prepare`` (which draws fresh masks), then load the model's, optimizer's and
``sparsifier.load_state_dict(...)`` state.

Distributed (DDP): ``prepare`` before wrapping the model, the same ``config.seed`` on every
process. Mask updates read the DDP-averaged gradients and the sparsifier averages the soft
permutations' gradients across processes itself, so every process makes the same decisions.

``step()`` keeps pruned weights at zero after every optimizer step and, every ``delta_t`` steps
until ``t_end``, drops the fraction ``α/2·(1 + cos(π t / t_end))`` of each layer's active weights
with the smallest magnitude and grows as many where the method says (RigL: largest dense gradient;
SET: uniformly at random). Grown weights start at zero, with their optimizer moments reset.

Methods (structure of every mask, after every update):

- ``rigl``, ``set``: unstructured; each layer keeps exactly its budget of weights.
- ``srigl``: constant fan-in (every output neuron keeps the same number of inputs) with neuron
  ablation: a neuron whose salient weights — those RigL's unstructured rule would keep — number
  fewer than ``γ_sal``·fan-in is switched off, and the layer's budget is spread over the others.
- ``dsb``: blocks of ``block``×``block`` weights; prune-and-grow works on whole blocks (drop the
  active blocks of smallest ‖W‖, grow the inactive ones of largest ‖∇W‖).
- ``pixelfly`` (Pixelated Butterfly): a static flat block-butterfly mask (block (i, j) active when
  i = j or i XOR j is a power of two, on the block grid scaled to a square power of two; as many
  butterfly levels as fit in ``1 − lowrank_share`` of the layer's budget) plus a dense low-rank
  term ``U Vᵀ`` in parallel whose rank uses the rest of the budget. The mask never changes.
- ``diag`` (DynaDiag): ``K`` wrapped diagonals (entries ``(r, (r + d) mod in)``), ``K`` from the
  layer's density. Until ``t_end`` every diagonal is weighted by a soft top-K of learnable scores
  (``sigmoid((α_d − t)/τ)``, ``t`` midway between the K-th and (K+1)-th score, τ annealed
  ``tau_start`` → ``tau_end``), trained with the model through a weight parametrization; at
  ``t_end`` the top-K diagonals are frozen as a hard mask. (Before freezing, compute is dense.)
- ``nm``: N:M (``pattern``, e.g. 2:4): every row keeps exactly N of every M consecutive input
  columns, so the layer is exactly N:M in memory order and ``shuffleprune export`` can compress
  it. Prune-and-grow as RigL (drop the smallest magnitudes of the layer), then every group is
  refilled to N with its inactive weights of largest gradient (``set``-style random growth is not
  offered). Densities are N/M in every layer (``distribution`` does not apply). With ``perm``, the
  groups are formed in permuted coordinates — the export's index map.
- ``dense``: no masks.

Permutations (``perm``, structured methods; srigl's constant fan-in is row-wise, so there only the
soft phase's mixing can matter): ``random`` fixes a random input permutation
at initialisation; ``learned`` is ShuffleSparse's DST regime — each layer computes ``W · (x M)``
with a full soft permutation ``M`` (doubly stochastic, from ``shuffleprune.permutation``),
trained by its own Adam on the task gradient plus ``λ_t·P(M)`` (λ ramped 0 → ``lambda_max`` over
``t_perm`` steps), projected after every step; a layer hardens (Hungarian) as soon as its
``P(M) < delta`` and reads ``x[perm]`` from then on; at ``t_perm`` every layer hardens. The
weights, their masks and prune-and-grow live in the permuted coordinates. Permutation parameters
are not counted in the sparsity budget.

The low-rank factors of ``pixelfly`` (``lowrank_u``, ``lowrank_v``) and the diagonal scores of
``diag`` (a ``weight`` parametrization) are registered on their layer, so create the optimizer
*after* ``prepare`` (and pass it with ``sparsifier.optimizer = opt``).

Layer densities: ``erk`` (Erdős–Rényi–Kernel: density ∝ (fan_in + fan_out)/(fan_in·fan_out),
capped at 1, rescaled to the global budget) or ``uniform``.
"""
from __future__ import annotations

import copy
import math
import types
import warnings
from dataclasses import asdict, dataclass

import torch
from torch import nn

from shuffleprune.blocks import OUTSIDE_LINEARS_WARN_SHARE, is_fused_experts, is_plain_linear
from shuffleprune.errors import UserError
from shuffleprune.masks import nm_keep_mask, parse_pattern
from shuffleprune.perm.core import (PermSchedule, SoftPermutation, penalty_grad, project_doubly_stochastic, strength,
                          unpermute_columns)

METHODS = ("dense", "rigl", "set", "srigl", "dsb", "pixelfly", "diag", "nm")


@dataclass
class DSTConfig:
    method: str = "rigl"
    sparsity: float = 0.9
    distribution: str = "erk"     # erk | uniform
    delta_t: int = 100            # steps between mask updates
    alpha: float = 0.3            # initial drop fraction
    t_end: int = 1000             # no updates from here on (RigL: 75% of training)
    gamma_sal: float = 0.3        # srigl: neuron ablation threshold
    block: int = 16               # dsb / pixelfly: block size (rows and columns)
    lowrank_share: float = 0.25   # pixelfly: share of a layer's budget given to the low-rank term
    tau_start: float = 1.0        # diag: soft top-K temperature, annealed geometrically to tau_end
    tau_end: float = 0.01         #       over the first t_end steps, then the K diagonals are frozen
    pattern: str = "2:4"          # nm: keep N of every M consecutive input columns (sparsity must be 1 − N/M)
    perm: str = "none"            # none | random | learned (ShuffleSparse, for column-structured methods)
    perm_lr: float = 1e-3         # Adam on the soft permutations
    lambda_max: float = 1e-4      # l1−l2 penalty weight, ramped from 0 over t_perm steps
    t_perm: int = 1000            # permutation learning stops (all layers hardened) at this step
    delta: float = 0.22           # a layer hardens once its P(M) < delta
    perm_init: float = 0.5        # soft start α·I + (1−α)/d·11ᵀ
    seed: int = 0

    def check(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown DST method '{self.method}'; use one of {', '.join(METHODS)}")
        if not 0.0 <= self.sparsity < 1.0:
            raise UserError("--sparsity must be in [0, 1)")
        if self.distribution not in ("erk", "uniform"):
            raise UserError("--distribution must be erk or uniform")
        if self.delta_t < 1 or self.t_end < 0 or not 0 <= self.alpha <= 1:
            raise UserError("--delta-t must be ≥ 1, --t-end ≥ 0 and --alpha in [0, 1]")
        if not 0.0 <= self.perm_init <= 1.0:
            raise UserError("--perm-start must be in [0, 1]")
        if self.perm not in ("none", "random", "learned"):
            raise UserError(f"unknown --perm '{self.perm}'; use none, random or learned")
        if self.perm != "none" and self.method in ("dense", "rigl", "set"):
            raise UserError(f"--perm needs a structured method (srigl, dsb, pixelfly, diag, nm); {self.method} has no "
                            "structure for a permutation to help")
        if self.method == "nm":
            n, m = self.nm()
            if abs(self.sparsity - (1 - n / m)) > 1e-9:
                raise UserError(f"--method nm --pattern {self.pattern} means sparsity {1 - n / m:g}; "
                                f"pass --sparsity {1 - n / m:g} (or leave it out)")

    def nm(self) -> tuple[int, int]:
        """``(N, M)`` of ``pattern``."""
        p = parse_pattern(self.pattern, None)
        return p.n, p.m


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2 ``Conv1D`` (also when a parametrization has subclassed it)."""
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__) and hasattr(module, "nf")


def sparsifiable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``nn.Linear`` (:func:`~shuffleprune.blocks.is_plain_linear`: not a subclass with its own
    ``forward``, like a MoE router) and transformers ``Conv1D``, except a layer sharing its weight with
    the input embeddings (a tied LM head). Warns when fused MoE experts, which these do not include,
    hold a large share of the weights."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = embed.weight if embed is not None else None
    found = {n: m for n, m in model.named_modules()
             if (is_plain_linear(m) or _is_conv1d(m)) and m.weight is not tied}
    fused = sum(p.numel() for m in model.modules() if is_fused_experts(m)
                for p in m.parameters(recurse=False) if p.dim() == 3)
    share = fused / max(1, fused + sum(m.weight.numel() for m in found.values()))
    if share > OUTSIDE_LINEARS_WARN_SHARE:
        warnings.warn(f"{share:.0%} of the model's weights are fused MoE experts, which dst does not sparsify "
                      "(they stay dense); dst masks nn.Linear layers only", UserWarning, stacklevel=3)
    return found


def _out_in(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """A view ``[out, in]`` of a weight-shaped tensor (``Conv1D`` stores ``[in, out]``)."""
    return t.t() if _is_conv1d(module) else t


def layer_densities(shapes: dict[str, tuple[int, int]], density: float, distribution: str) -> dict[str, float]:
    """Per-layer densities (``shapes``: name → (out, in)) whose weighted mean is ``density``."""
    if distribution == "uniform" or density >= 1.0:
        return {n: density for n in shapes}
    sizes = {n: o * i for n, (o, i) in shapes.items()}
    raw = {n: (o + i) / (o * i) for n, (o, i) in shapes.items()}
    dense: set[str] = set()
    budget = density * sum(sizes.values())
    while True:  # ERK with layers capped at density 1 (the budget of capped layers is set aside)
        free = budget - sum(sizes[n] for n in dense)
        scale = free / sum(raw[n] * sizes[n] for n in shapes if n not in dense)
        over = [n for n in shapes if n not in dense and raw[n] * scale > 1.0]
        if not over:
            return {n: 1.0 if n in dense else raw[n] * scale for n in shapes}
        dense.update(over)


def diagonal_offsets(out_f: int, in_f: int) -> torch.Tensor:
    """``[out, in]``: the wrapped diagonal each entry lies on (entry ``(r, c)`` is on ``(c − r) mod in``)."""
    return (torch.arange(in_f).unsqueeze(0) - torch.arange(out_f).unsqueeze(1)) % in_f


def _raw_weight(module: nn.Module) -> torch.Tensor:
    """The stored weight (under a ``diag`` parametrization: its unmasked original)."""
    if hasattr(module, "parametrizations") and "weight" in module.parametrizations:
        return module.parametrizations.weight.original
    return module.weight


class DiagonalSelect(nn.Module):
    """``weight`` parametrization of ``diag``: ``W ⊙ Σ_d s_d D_d`` with soft top-K ``s`` while
    selecting, ``W ⊙ mask`` (the frozen K diagonals) after."""

    def __init__(self, out_f: int, in_f: int, k: int, conv1d: bool, generator: torch.Generator):
        super().__init__()
        self.out_f, self.in_f, self.k, self.conv1d = out_f, in_f, k, conv1d
        self.alpha = nn.Parameter(torch.randn(in_f, generator=generator) * 1e-2)
        self.tau = 1.0
        self.register_buffer("frozen", torch.zeros(out_f, in_f, dtype=torch.bool))
        self.is_frozen = False
        self.register_buffer("offset", diagonal_offsets(out_f, in_f), persistent=False)

    def soft(self) -> torch.Tensor:
        top = self.alpha.topk(min(self.k + 1, self.in_f)).values
        t = (top[self.k - 1] + top[-1]) / 2 if self.k < self.in_f else top[-1] - 1.0
        return torch.sigmoid((self.alpha - t.detach()) / self.tau)

    def hard(self) -> torch.Tensor:
        """``[out, in]`` mask of the current top-K diagonals."""
        chosen = torch.zeros(self.in_f, dtype=torch.bool, device=self.alpha.device)
        chosen[self.alpha.detach().topk(self.k).indices] = True
        return chosen[self.offset]

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        mask = self.frozen.to(w.dtype) if self.is_frozen else self.soft().to(w.dtype)[self.offset]
        return w * (mask.t() if self.conv1d else mask)


def _add_lowrank(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """pixelfly: ``y += x' Vᵀ Uᵀ`` on the same (possibly permuted) input ``x'`` as the layer."""
    x, v = args[0], module.lowrank_v
    perm = getattr(module, "_input_perm", None)
    if perm is not None:
        v = perm.weight_view(v)  # the permutation is applied on the weight side (see _permuted_forward)
    return output + (x @ v.t()) @ module.lowrank_u.t()


def _permuted_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a layer with an input permutation, applied on the weight side:
    ``x (W Mᵀ)ᵀ + b`` while soft — the same product as ``(x M) Wᵀ + b``, at ``out·d²`` instead of
    ``tokens·d²`` per pass — and ``x (W[:, perm⁻¹])ᵀ + b`` once hard, the same as
    ``x[perm] Wᵀ + b`` with the gather on the weight (``out × d``) instead of on the activations
    (``tokens × d``). Training steps have far more tokens than a layer has outputs. (An exported
    model gathers the input instead: at inference the token count is small.)"""
    w = module._input_perm.weight_view(_out_in(module, module.weight))
    return nn.functional.linear(x, w, module.bias)


def _average_across_processes(params: list[torch.Tensor]) -> None:
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


class InputPermutation:
    """The input permutation of one layer: soft (mixing ``M``, learned) until hardened, then the
    index map ``perm`` (the layer computes ``W · x[perm]``). Installs :func:`_permuted_forward` on
    the layer; ``M`` is not a parameter of the model (the sparsifier owns it)."""

    def __init__(self, module: nn.Module, size: int, perm: torch.Tensor | None = None, init: float = 0.5):
        self.size = size
        self.soft = None if perm is not None else SoftPermutation(size, block=size, init_identity=init)
        self.hard = perm
        self.hardened_at: int | None = None if perm is None else 0
        self.penalty_curve: list[float] = []
        self.penalty_now: float | None = None  # P(M) of the current soft M (cached between steps)
        module._input_perm = self
        module.forward = types.MethodType(_permuted_forward, module)

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


class DynamicSparsifier:
    """Masks, their schedule and their updates; ``state_dict`` holds everything needed to resume."""

    def __init__(self, config: DSTConfig):
        config.check()
        self.config = config
        self.masks: dict[str, torch.Tensor] = {}
        self.layers: dict[str, nn.Module] = {}
        self.densities: dict[str, float] = {}
        self.step_count = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.generator = torch.Generator().manual_seed(config.seed)
        self.history: list[dict] = []
        self.perms: dict[str, InputPermutation] = {}
        self.perm_optimizer: torch.optim.Optimizer | None = None
        self.schedule = PermSchedule(steps=config.t_perm, lambda_max=config.lambda_max)
        self._hooks: list = []
        self.lowrank_params: dict[str, int] = {}
        self.selectors: dict[str, DiagonalSelect] = {}

    # ---- torch.ao.pruning-style contract -------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                layers: list[str] | None = None) -> None:
        """Attach to ``model`` (all sparsifiable layers, or the named ones) and draw the initial
        random masks at the configured densities (srigl: constant fan-in)."""
        found = sparsifiable_layers(model)
        if layers is not None:
            missing = [n for n in layers if n not in found]
            if missing:
                raise UserError(f"not sparsifiable layers of this model: {', '.join(missing)}")
            found = {n: found[n] for n in layers}
        self.layers, self.optimizer = found, optimizer
        if self.config.method == "dense":
            return
        shapes = {n: tuple(_out_in(m, m.weight).shape) for n, m in found.items()}
        distribution = "uniform" if self.config.method == "nm" else self.config.distribution
        self.densities = layer_densities(shapes, 1.0 - self.config.sparsity, distribution)
        for name, module in found.items():
            out_f, in_f = shapes[name]
            if self.config.method in ("dsb", "pixelfly") and (out_f % self.config.block or in_f % self.config.block):
                raise UserError(f"{name} ({out_f}×{in_f}) is not a multiple of --block {self.config.block}")
            if self.config.method == "nm" and in_f % self.config.nm()[1]:
                raise UserError(f"{name} has {in_f} inputs, not a multiple of M={self.config.nm()[1]}; "
                                "use a --pattern whose M divides every layer's input width")
            if self.config.method == "pixelfly":
                self.masks[name] = self._pixelfly(name, module, out_f, in_f)
            elif self.config.method == "diag":
                from torch.nn.utils import parametrize

                k = max(1, min(in_f, round(self.densities[name] * in_f)))
                select = DiagonalSelect(out_f, in_f, k, _is_conv1d(module), self.generator).to(module.weight.device)
                select.tau = self.config.tau_start
                parametrize.register_parametrization(module, "weight", select)
                self.selectors[name] = select
                self.masks[name] = select.hard().cpu()
            else:
                scores = torch.rand(out_f, in_f, generator=self.generator)
                self.masks[name] = self._select(scores, self._budget(name), None)
            if self.config.perm != "none":
                fixed = torch.randperm(in_f, generator=self.generator) if self.config.perm == "random" else None
                self.perms[name] = InputPermutation(module, in_f, fixed, self.config.perm_init)
        soft = [p for perm in self.perms.values() if perm.soft is not None for p in perm.soft.parameters()]
        if soft:
            self.perm_optimizer = torch.optim.Adam(soft, lr=self.config.perm_lr)
        self.apply_masks()

    def step(self) -> None:
        """Call after ``optimizer.step()``: zero the pruned weights; every ``delta_t`` steps (until
        ``t_end``) update the masks from the current weights and gradients."""
        if self.config.method == "dense":
            return
        self.step_count += 1
        c = self.config
        self._permutation_step()
        if self.selectors:
            self._diagonal_step()
        if self.step_count % c.delta_t == 0 and self.step_count < c.t_end and c.method not in ("pixelfly", "diag"):
            self.update_masks(self.drop_fraction(self.step_count))
        self.apply_masks()

    def state_dict(self) -> dict:
        """A snapshot (copies, not views) of everything a resumed run needs."""
        perms = {n: {"hard": None if p.hard is None else p.hard.clone(), "hardened_at": p.hardened_at,
                     "soft": None if p.soft is None else [b.detach().clone() for b in p.soft.blocks],
                     "penalty_curve": list(p.penalty_curve)} for n, p in self.perms.items()}
        return {"config": asdict(self.config), "step_count": self.step_count,
                "masks": {n: m.clone() for n, m in self.masks.items()}, "densities": dict(self.densities),
                "generator": self.generator.get_state(), "history": list(self.history), "perms": perms,
                "diag": {n: {"tau": sel.tau, "is_frozen": sel.is_frozen, "frozen": sel.frozen.clone(),
                             "alpha": sel.alpha.detach().clone()} for n, sel in self.selectors.items()},
                "perm_optimizer": None if self.perm_optimizer is None else copy.deepcopy(self.perm_optimizer.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        if state["config"] != asdict(self.config):
            raise UserError("sparsifier state was saved with different settings; resume with the same options")
        self.step_count = state["step_count"]
        self.masks = {n: m.clone() for n, m in state["masks"].items()}
        self.densities = dict(state["densities"])
        self.generator.set_state(state["generator"])
        self.history = list(state["history"])
        for name, saved in state.get("perms", {}).items():
            p = self.perms[name]
            p.penalty_curve = list(saved["penalty_curve"])
            if saved["soft"] is None and p.soft is not None:
                p.harden(saved["hardened_at"], saved["hard"])
            elif saved["soft"] is None:
                p.hard, p.hardened_at = saved["hard"], saved["hardened_at"]
            else:
                with torch.no_grad():
                    for b, v in zip(p.soft.blocks, saved["soft"]):
                        b.copy_(v)
                p.penalty_now = None
        for name, saved in state.get("diag", {}).items():
            sel = self.selectors[name]
            sel.tau, sel.is_frozen = saved["tau"], saved["is_frozen"]
            with torch.no_grad():
                sel.frozen.copy_(saved["frozen"])
                sel.alpha.copy_(saved["alpha"])
            sel.alpha.requires_grad_(not sel.is_frozen)
        if self.perm_optimizer is not None and state.get("perm_optimizer") is not None:
            self.perm_optimizer.load_state_dict(state["perm_optimizer"])
        if self.layers:
            self.apply_masks()

    def finalize(self) -> None:
        """End of training: bake ``diag``'s frozen mask into plain weights (removes the
        parametrization, so the model saves as an ordinary checkpoint)."""
        from torch.nn.utils import parametrize

        for name, sel in list(self.selectors.items()):
            if not sel.is_frozen:
                sel.frozen.copy_(sel.hard())
                sel.is_frozen = True
            parametrize.remove_parametrizations(self.layers[name], "weight", leave_parametrized=True)
        self.selectors.clear()

    def permutation_strength(self) -> dict[str, float | None]:
        """Per layer ``1 − ‖P − I‖_F/√(2N)`` of the hardened permutation (None while soft)."""
        return {n: None if p.hard is None else strength(p.hard.cpu()) for n, p in self.perms.items()}

    # ---- internals -------------------------------------------------------------------------------
    def _permutation_step(self) -> None:
        """Adam step on the soft permutations (task gradient + λ_t·∇P, the latter in closed form),
        projection, hardening."""
        soft = {n: p for n, p in self.perms.items() if p.soft is not None}
        if not soft:
            return
        lam = self.schedule.lam(self.step_count)
        _average_across_processes([b for p in soft.values() for b in p.soft.blocks])
        for p in soft.values():
            p.penalty_curve.append(p.current_penalty())
            if lam > 0:
                for block, grad in zip(p.soft.blocks, penalty_grad(list(p.soft.blocks))):
                    block.grad = lam * grad if block.grad is None else block.grad.add_(grad, alpha=lam)
        self.perm_optimizer.step()
        self.perm_optimizer.zero_grad(set_to_none=True)
        for p in soft.values():
            project_doubly_stochastic(list(p.soft.blocks), tol=1e-6)
            p.penalty_now = None
            if p.current_penalty() < self.config.delta or self.step_count >= self.config.t_perm:
                p.harden(self.step_count)

    def drop_fraction(self, t: int) -> float:
        """``α/2·(1 + cos(π t / t_end))``."""
        return self.config.alpha / 2 * (1 + math.cos(math.pi * t / self.config.t_end))

    def _budget(self, name: str) -> int:
        w = self.layers[name].weight
        return int(round(self.densities[name] * w.numel()))

    @torch.no_grad()
    def apply_masks(self) -> None:
        for name, mask in self.masks.items():
            if name in self.selectors and not self.selectors[name].is_frozen:
                continue  # diag while selecting: the soft weighting is the mask
            w = _raw_weight(self.layers[name])
            _out_in(self.layers[name], w.data).mul_(mask.to(w.device, w.dtype))

    def _diagonal_step(self) -> None:
        """diag: anneal τ; at ``t_end`` freeze the top-K diagonals of every layer."""
        c = self.config
        frac = min(1.0, self.step_count / max(c.t_end, 1))
        for name, sel in self.selectors.items():
            if sel.is_frozen:
                continue
            sel.tau = c.tau_start * (c.tau_end / c.tau_start) ** frac
            self.masks[name] = sel.hard().cpu()
            if self.step_count >= c.t_end:
                sel.frozen.copy_(sel.hard())
                sel.is_frozen = True
                sel.alpha.requires_grad_(False)
                self.history.append({"step": self.step_count, "frozen": name})

    def _pixelfly(self, name: str, module: nn.Module, out_f: int, in_f: int) -> torch.Tensor:
        """Static flat block-butterfly mask + a low-rank term registered on the layer."""
        b, budget = self.config.block, self._budget(name)
        rows, cols = out_f // b, in_f // b
        n = 1 << (max(rows, cols) - 1).bit_length()  # the next power of two
        i = torch.arange(rows).unsqueeze(1) * n // rows
        j = torch.arange(cols).unsqueeze(0) * n // cols
        x = i ^ j
        butterfly_budget = (1.0 - self.config.lowrank_share) * budget
        blocks = x == 0
        stride = 1
        while stride < n:
            candidate = blocks | (x == stride)
            if int(candidate.sum()) * b * b > butterfly_budget and blocks.any():
                break
            blocks, stride = candidate, stride * 2
        mask = self._expand(blocks)
        rank = max(0, (budget - int(mask.sum())) // (out_f + in_f))
        if rank:
            w = module.weight
            u = torch.zeros(out_f, rank, dtype=w.dtype, device=w.device)
            v = torch.randn(rank, in_f, generator=self.generator).to(w.dtype) / math.sqrt(in_f)
            module.register_parameter("lowrank_u", nn.Parameter(u))
            module.register_parameter("lowrank_v", nn.Parameter(v.to(w.device)))
            self._hooks.append(module.register_forward_hook(_add_lowrank))
        self.lowrank_params[name] = rank * (out_f + in_f)
        return mask

    def _pool(self, t: torch.Tensor) -> torch.Tensor:
        """dsb: ``[out, in]`` → per-block sums ``[out/b, in/b]``."""
        b = self.config.block
        return t.reshape(t.shape[0] // b, b, t.shape[1] // b, b).sum((1, 3))

    def _expand(self, blocks: torch.Tensor) -> torch.Tensor:
        b = self.config.block
        return blocks.repeat_interleave(b, 0).repeat_interleave(b, 1)

    def _select(self, scores: torch.Tensor, budget: int, alive: torch.Tensor | None) -> torch.Tensor:
        """A mask with ``budget`` entries of highest ``scores``, in the method's structure."""
        out_f, in_f = scores.shape
        if self.config.method == "dsb":
            n_blocks = max(1, round(budget / self.config.block ** 2))
            return self._expand(self._unstructured_top(self._pool(scores), n_blocks))
        if self.config.method == "nm":  # the top N of every M consecutive inputs of every row
            return nm_keep_mask(scores, *self.config.nm())
        if self.config.method != "srigl":
            mask = torch.zeros(out_f * in_f, dtype=torch.bool)
            mask[scores.flatten().topk(budget).indices] = True
            return mask.view(out_f, in_f)
        alive = torch.ones(out_f, dtype=torch.bool) if alive is None else alive
        fan_in = min(in_f, budget // max(int(alive.sum()), 1))
        mask = torch.zeros(out_f, in_f, dtype=torch.bool)
        if fan_in > 0:
            mask.scatter_(1, scores.topk(fan_in, dim=1).indices, True)
        mask &= alive.unsqueeze(1)
        return mask

    @torch.no_grad()
    def update_masks(self, fraction: float) -> None:
        """One prune-and-grow update of every layer (drop ``fraction`` of its active weights)."""
        record = {"step": self.step_count, "drop_fraction": round(fraction, 6), "layers": {}}
        for name, module in self.layers.items():
            mask = self.masks[name]
            w = _out_in(module, module.weight.data).float().cpu()
            g = module.weight.grad
            g = torch.zeros_like(w) if g is None else _out_in(module, g).float().cpu().abs()
            if self.config.method == "dsb":  # whole blocks: pooled magnitudes and gradients
                w, g = self._pool(w.abs().pow(2)).sqrt(), self._pool(g.pow(2)).sqrt()
                mask = self._pool(mask.float()) > 0
            active = int(mask.sum())
            k = int(round(fraction * active))
            if k == 0:
                continue
            # drop: the k active weights of smallest magnitude
            keep_score = torch.where(mask, w.abs(), torch.full_like(w, -1.0))
            kept = self._unstructured_top(keep_score, active - k)
            # grow: k of the rest, by gradient (rigl/srigl) or at random (set)
            grow_score = g.clone() if self.config.method != "set" else torch.rand(w.shape, generator=self.generator)
            grow_score[kept] = -1.0
            if self.config.method == "nm":  # refill every group to N: its kept weights, then by growth score
                new = self._select(torch.where(kept, w.abs() + grow_score.abs().max() + 1.0, grow_score), active, None)
            else:
                new = kept | self._unstructured_top(grow_score, k)
            if self.config.method == "srigl":
                new = self._srigl(new, kept, grow_score, w, active, module)
            if self.config.method == "dsb":
                mask, new = self.masks[name], self._expand(new)
            started = new & ~mask
            self.masks[name] = new
            self._reset_moments(module, started)
            record["layers"][name] = {"dropped": int((mask & ~new).sum()), "grown": int(started.sum())}
        self.history.append(record)

    @staticmethod
    def _unstructured_top(score: torch.Tensor, k: int) -> torch.Tensor:
        mask = torch.zeros(score.numel(), dtype=torch.bool)
        if k > 0:
            mask[score.flatten().topk(k).indices] = True
        return mask.view_as(score)

    def _srigl(self, salient: torch.Tensor, kept: torch.Tensor, grow_score: torch.Tensor, w: torch.Tensor,
               budget: int, module: nn.Module) -> torch.Tensor:
        """Constant fan-in with neuron ablation, from RigL's unstructured choice ``salient``."""
        out_f, in_f = salient.shape
        fan_in = max(1, budget // out_f)
        alive = salient.sum(1) >= self.config.gamma_sal * fan_in
        if not alive.any():
            alive[salient.sum(1).argmax()] = True
        # within each live neuron: its kept weights first (by magnitude), then grown (by gradient)
        rank = torch.where(kept, w.abs() + grow_score.abs().max() + 1.0, grow_score)
        rank = torch.where(salient, rank + (rank.abs().max() + 1.0), rank)
        return self._select(rank, budget, alive)

    def _reset_moments(self, module: nn.Module, started: torch.Tensor) -> None:
        """Grown weights start at zero, with zero optimizer moments."""
        if not started.any():
            return
        w = module.weight
        _out_in(module, w.data)[started.to(w.device)] = 0.0
        if self.optimizer is None:
            return
        state = self.optimizer.state.get(w, {})
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == w.shape:
                _out_in(module, value)[started.to(value.device)] = 0.0

    def density(self) -> float:
        """Overall fraction of active weights over the sparsified layers (low-rank factors included)."""
        total = sum(self.layers[n].weight.numel() for n in self.masks)
        used = sum(int(m.sum()) for m in self.masks.values()) + sum(self.lowrank_params.values())
        return used / total if total else 1.0
