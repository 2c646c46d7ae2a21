"""Dynamic sparse training: a sparsifier in the torch.ao.pruning style for a user's own training loop.

    sparsifier = DynamicSparsifier(DSTConfig(method="rigl", sparsity=0.9, t_end=7500))
    sparsifier.prepare(model, optimizer)          # masks every nn.Linear / transformers Conv1D (except
    for batch in data:                            # the layer tied to the input embeddings, and routers,
                                                  # gates and coefficient layers) and MoE expert
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
- ``keep``: the zeros the model has when ``prepare`` is called stay zero, and nothing else changes:
  fine-tuning a pruned checkpoint (``prune`` or ``dst``) in your own loop keeps its N:M pattern,
  in whatever column order it holds (a ``--perm`` checkpoint's index maps stay valid), so
  ``export`` compresses the result. Only layers holding zeros get a mask.

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

MoE experts (transformers' fused ``[experts, out, in]`` parameters, or a layout of the model's own
such as Llama 4's and DBRX's, found by one traced probe forward): every expert matrix is a layer of
its own (``….experts.down_proj[3]``) for the methods that only add a mask (rigl, set, srigl, dsb,
nm), with its own permutation under ``perm``. A soft one mixes the expert's slice of its parameter
in the forward of the module that holds every use of it (the experts layer); when it hardens, the expert (weight, mask, Adam
moments) is stored in its plain column order, as ``prune --perm`` checkpoints keep experts, and its
map orders the mask's structure (exactly N:M in ``W[:, perm]``). pixelfly and diag change a layer's
forward, so under them the experts stay dense (warned).

Layer densities: ``erk`` (Erdős–Rényi–Kernel: density ∝ (fan_in + fan_out)/(fan_in·fan_out),
capped at 1, rescaled to the global budget) or ``uniform``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict

import torch
from torch import nn

from shuffleprune.blocks import ExpertWeight
from shuffleprune.dst.config import MASK_METHODS, DSTConfig
from shuffleprune.dst.input_perm import InputPermutation, attach_to_experts, attach_to_linear, average_across_processes
from shuffleprune.dst.layers import (Layer, grad_of, is_conv1d, layer_densities, moments_of, shape_of, sparsifiable_layers,
                                     stored_param, weight_of)
from shuffleprune.dst.structures import (DiagonalSelect, add_lowrank, butterfly_mask, expand, kept_first, pool,
                                         select_mask, srigl_mask, top_entries)
from shuffleprune.errors import UserError
from shuffleprune.perm.core import PermSchedule, penalty_grad, project_doubly_stochastic, strength

__all__ = ["DynamicSparsifier"]


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
        random masks at the configured densities (srigl: constant fan-in). Learned permutations are
        made on their layers' device: move the model to its device first."""
        found = sparsifiable_layers(model, experts=self.config.method in MASK_METHODS + ("dense",),
                                    head=self.config.sparse_head)
        if layers is not None:
            missing = [n for n in layers if n not in found]
            if missing:
                raise UserError(f"not sparsifiable layers of this model: {', '.join(missing)}")
            found = {n: found[n] for n in layers}
        self.layers, self.optimizer = found, optimizer
        if self.config.method == "dense":
            return
        if self.config.method == "keep":   # a pruned model's zeros, never updated
            for name, module in found.items():
                kept = weight_of(module).detach() != 0
                self.densities[name] = kept.float().mean().item()
                if not kept.all():
                    self.masks[name] = kept.cpu()
            return
        shapes = {n: shape_of(m) for n, m in found.items()}
        if not shapes:   # a model of no layers (--config-kw n_layer=0): no weights to sparsify
            raise UserError("this model has no layers to sparsify; check --arch and --config-kw (a layer count of 0?)")
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
                select = DiagonalSelect(out_f, in_f, k, is_conv1d(module), self.generator).to(module.weight.device)
                select.tau = self.config.tau_start
                parametrize.register_parametrization(module, "weight", select)
                self.selectors[name] = select
                self.masks[name] = select.hard().cpu()
            else:
                scores = torch.rand(out_f, in_f, generator=self.generator)
            if self.config.perm != "none":
                fixed = torch.randperm(in_f, generator=self.generator) if self.config.perm == "random" else None
                self.perms[name] = perm = InputPermutation(in_f, fixed, self.config.perm_init)
                if perm.soft is not None:   # M trains beside its layer: no copy across devices per step
                    perm.soft.to(stored_param(module).device)
                if not isinstance(module, ExpertWeight):
                    attach_to_linear(module, perm)
                elif perm.soft is not None:  # a hard (random) map needs no forward: the expert stays in plain order
                    attach_to_experts(module, perm, module.owner if module.scope is None else model.get_submodule(module.scope))
            if self.config.method not in ("pixelfly", "diag"):
                self.masks[name] = self._from_structure(name, select_mask(self.config, scores, self._budget(name)))
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
        if self.step_count % c.delta_t == 0 and self.step_count < c.t_end and c.method not in ("pixelfly", "diag", "keep"):
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
        """End of training: harden the permutations still soft (the model then computes what it
        saves with its index maps) and bake ``diag``'s frozen mask into plain weights (removes the
        parametrization, so the model saves as an ordinary checkpoint)."""
        from torch.nn.utils import parametrize

        for name in [n for n, p in self.perms.items() if p.soft is not None]:
            self._harden(name, self.step_count)
        self.apply_masks()
        for name, sel in list(self.selectors.items()):
            if not sel.is_frozen:
                sel.frozen.copy_(sel.hard())
                sel.is_frozen = True
            parametrize.remove_parametrizations(self.layers[name], "weight", leave_parametrized=True)
        self.selectors.clear()

    @torch.no_grad()
    def checkpoint_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` as a checkpoint stores it, after :meth:`finalize`: a linear with a
        hard map (which holds ``W`` acting on ``x[perm]``) in its input's own column order,
        ``W[:, perm⁻¹]``, so the saved model computes the trained one without its maps (experts
        are kept in that order already)."""
        state = dict(model.state_dict())
        for name, p in self.perms.items():
            layer = self.layers[name]
            if isinstance(layer, ExpertWeight) or p.hard is None:
                continue
            plain = p.weight_view(weight_of(layer))
            state[f"{name}.weight"] = (plain.t() if is_conv1d(layer) else plain).contiguous()
        return state

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
        average_across_processes([b for p in soft.values() for b in p.soft.blocks])
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
        for name, p in soft.items():
            if p.current_penalty() < self.config.delta or self.step_count >= self.config.t_perm:
                self._harden(name, self.step_count)

    @torch.no_grad()
    def _harden(self, name: str, step: int) -> None:
        """Hungarian on the layer's soft permutation. An expert then moves to its plain column
        order (weight, Adam moments and mask: ``W_plain = W[:, perm⁻¹]``, the function it computed
        with the hard map) and leaves the experts forward's mixing."""
        p = self.perms[name]
        p.harden(step)
        layer = self.layers[name]
        if isinstance(layer, ExpertWeight):
            for t in [weight_of(layer)] + moments_of(layer, self.optimizer):
                t.copy_(p.weight_view(t))
            if name in self.masks:
                self.masks[name] = self._from_structure(name, self.masks[name])

    def _structure_order(self, name: str) -> torch.Tensor | None:
        """The column order a layer's mask structure lives in when it is not the stored order: an
        expert's hard map (the expert is stored in plain order)."""
        p = self.perms.get(name)
        return p.hard if p is not None and p.hard is not None and isinstance(self.layers[name], ExpertWeight) else None

    def _from_structure(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        """A mask in structure order → the stored order."""
        order = self._structure_order(name)
        return mask if order is None else mask.index_select(1, torch.argsort(order))

    def structure_mask(self, name: str) -> torch.Tensor:
        """The layer's mask in the column order its structure holds in (N:M groups, blocks): the
        stored order, or an expert's map order (``mask[:, perm]``)."""
        order = self._structure_order(name)
        return self.masks[name] if order is None else self.masks[name][:, order]

    def drop_fraction(self, t: int) -> float:
        """``α/2·(1 + cos(π t / t_end))``."""
        return self.config.alpha / 2 * (1 + math.cos(math.pi * t / self.config.t_end))

    def _budget(self, name: str) -> int:
        out_f, in_f = shape_of(self.layers[name])
        return int(round(self.densities[name] * out_f * in_f))

    @torch.no_grad()
    def apply_masks(self) -> None:
        for name, mask in self.masks.items():
            if name in self.selectors and not self.selectors[name].is_frozen:
                continue  # diag while selecting: the soft weighting is the mask
            w = weight_of(self.layers[name])
            w.mul_(mask.to(w.device, w.dtype))

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
        budget = self._budget(name)
        mask = butterfly_mask(out_f, in_f, self.config.block, (1.0 - self.config.lowrank_share) * budget)
        rank = max(0, (budget - int(mask.sum())) // (out_f + in_f))
        if rank:
            w = module.weight
            u = torch.zeros(out_f, rank, dtype=w.dtype, device=w.device)
            v = torch.randn(rank, in_f, generator=self.generator).to(w.dtype) / math.sqrt(in_f)
            module.register_parameter("lowrank_u", nn.Parameter(u))
            module.register_parameter("lowrank_v", nn.Parameter(v.to(w.device)))
            self._hooks.append(module.register_forward_hook(add_lowrank))
        self.lowrank_params[name] = rank * (out_f + in_f)
        return mask

    @torch.no_grad()
    def update_masks(self, fraction: float) -> None:
        """One prune-and-grow update of every layer (drop ``fraction`` of its active weights; ``keep``: none)."""
        c = self.config
        if c.method == "keep":
            return
        record = {"step": self.step_count, "drop_fraction": round(fraction, 6), "layers": {}}
        for name, layer in self.layers.items():
            w = weight_of(layer).float().cpu()
            g = grad_of(layer)
            g = torch.zeros_like(w) if g is None else g.float().cpu().abs()
            order = self._structure_order(name)  # chosen in the structure's column order, stored in the layer's
            if order is not None:
                w, g = w[:, order], g[:, order]
            mask = self.structure_mask(name)
            if c.method == "dsb":  # whole blocks: pooled magnitudes and gradients
                w, g = pool(w.abs().pow(2), c.block).sqrt(), pool(g.pow(2), c.block).sqrt()
                mask = pool(mask.float(), c.block) > 0
            active = int(mask.sum())
            k = int(round(fraction * active))
            if k == 0:
                continue
            # drop: the k active weights of smallest magnitude
            kept = top_entries(torch.where(mask, w.abs(), torch.full_like(w, -1.0)), active - k)
            # grow: k of the rest, by gradient (rigl/srigl) or at random (set)
            grow_score = g.clone() if c.method != "set" else torch.rand(w.shape, generator=self.generator)
            grow_score[kept] = -1.0
            if c.method == "nm":  # refill every group to N: its kept weights, then by growth score
                new = select_mask(c, kept_first(kept, w, grow_score), active)
            else:
                new = kept | top_entries(grow_score, k)
            if c.method == "srigl":
                new = srigl_mask(c, new, kept, grow_score, w, active)
            if c.method == "dsb":
                new = expand(new, c.block)
            mask, new = self.masks[name], self._from_structure(name, new)
            started = new & ~mask
            self.masks[name] = new
            self._reset_moments(layer, started)
            record["layers"][name] = {"dropped": int((mask & ~new).sum()), "grown": int(started.sum())}
        self.history.append(record)

    def _reset_moments(self, layer: Layer, started: torch.Tensor) -> None:
        """Grown weights start at zero, with zero optimizer moments."""
        if not started.any():
            return
        for t in [weight_of(layer)] + moments_of(layer, self.optimizer):
            t[started.to(t.device)] = 0.0

    def density(self) -> float:
        """Overall fraction of active weights over the sparsified layers (low-rank factors included)."""
        total = sum(math.prod(shape_of(self.layers[n])) for n in self.masks)
        used = sum(int(m.sum()) for m in self.masks.values()) + sum(self.lowrank_params.values())
        return used / total if total else 1.0
