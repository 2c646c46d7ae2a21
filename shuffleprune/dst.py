"""Dynamic sparse training: a sparsifier in the torch.ao.pruning style for a user's own training loop.

    sparsifier = DynamicSparsifier(DSTConfig(method="rigl", sparsity=0.9, t_end=7500))
    sparsifier.prepare(model, optimizer)          # masks every nn.Linear / transformers Conv1D
    for batch in data:                            # (except the layer tied to the input embeddings)
        loss = model(**batch).loss; loss.backward()
        optimizer.step(); sparsifier.step(); optimizer.zero_grad()

To resume: ``prepare`` (which draws fresh masks), then load the model's, optimizer's and
``sparsifier.load_state_dict(...)`` state.

``step()`` keeps pruned weights at zero after every optimizer step and, every ``delta_t`` steps
until ``t_end``, drops the fraction ``α/2·(1 + cos(π t / t_end))`` of each layer's active weights
with the smallest magnitude and grows as many where the method says (RigL: largest dense gradient;
SET: uniformly at random). Grown weights start at zero, with their optimizer moments reset.

Methods (structure of every mask, after every update):

- ``rigl``, ``set``: unstructured; each layer keeps exactly its budget of weights.
- ``srigl``: constant fan-in (every output neuron keeps the same number of inputs) with neuron
  ablation: a neuron whose salient weights — those RigL's unstructured rule would keep — number
  fewer than ``γ_sal``·fan-in is switched off, and the layer's budget is spread over the others.
- ``dense``: no masks.

Layer densities: ``erk`` (Erdős–Rényi–Kernel: density ∝ (fan_in + fan_out)/(fan_in·fan_out),
capped at 1, rescaled to the global budget) or ``uniform``. The structured block methods (DSB,
PixelatedBFly, DynaDiag) and learned permutations are not implemented yet.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .errors import UserError

METHODS = ("dense", "rigl", "set", "srigl")


@dataclass
class DSTConfig:
    method: str = "rigl"
    sparsity: float = 0.9
    distribution: str = "erk"     # erk | uniform
    delta_t: int = 100            # steps between mask updates
    alpha: float = 0.3            # initial drop fraction
    t_end: int = 1000             # no updates from here on (RigL: 75% of training)
    gamma_sal: float = 0.3        # srigl: neuron ablation threshold
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


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def sparsifiable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``nn.Linear`` and transformers ``Conv1D``, except a layer sharing its weight with the
    input embeddings (a tied LM head)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = embed.weight if embed is not None else None
    return {n: m for n, m in model.named_modules()
            if (isinstance(m, nn.Linear) or _is_conv1d(m)) and m.weight is not tied}


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
        self.densities = layer_densities(shapes, 1.0 - self.config.sparsity, self.config.distribution)
        for name, module in found.items():
            out_f, in_f = shapes[name]
            scores = torch.rand(out_f, in_f, generator=self.generator)
            self.masks[name] = self._select(scores, self._budget(name), None)
        self.apply_masks()

    def step(self) -> None:
        """Call after ``optimizer.step()``: zero the pruned weights; every ``delta_t`` steps (until
        ``t_end``) update the masks from the current weights and gradients."""
        if self.config.method == "dense":
            return
        self.step_count += 1
        c = self.config
        if self.step_count % c.delta_t == 0 and self.step_count < c.t_end:
            self.update_masks(self.drop_fraction(self.step_count))
        self.apply_masks()

    def state_dict(self) -> dict:
        return {"config": asdict(self.config), "step_count": self.step_count,
                "masks": {n: m.clone() for n, m in self.masks.items()}, "densities": dict(self.densities),
                "generator": self.generator.get_state(), "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        if state["config"] != asdict(self.config):
            raise UserError("sparsifier state was saved with different settings; resume with the same options")
        self.step_count = state["step_count"]
        self.masks = {n: m.clone() for n, m in state["masks"].items()}
        self.densities = dict(state["densities"])
        self.generator.set_state(state["generator"])
        self.history = list(state["history"])
        if self.layers:
            self.apply_masks()

    # ---- internals -------------------------------------------------------------------------------
    def drop_fraction(self, t: int) -> float:
        """``α/2·(1 + cos(π t / t_end))``."""
        return self.config.alpha / 2 * (1 + math.cos(math.pi * t / self.config.t_end))

    def _budget(self, name: str) -> int:
        w = self.layers[name].weight
        return int(round(self.densities[name] * w.numel()))

    @torch.no_grad()
    def apply_masks(self) -> None:
        for name, mask in self.masks.items():
            w = self.layers[name].weight
            _out_in(self.layers[name], w.data).mul_(mask.to(w.device, w.dtype))

    def _select(self, scores: torch.Tensor, budget: int, alive: torch.Tensor | None) -> torch.Tensor:
        """A mask with ``budget`` entries of highest ``scores``, in the method's structure."""
        out_f, in_f = scores.shape
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
            grown = self._unstructured_top(grow_score, k)
            new = kept | grown
            if self.config.method == "srigl":
                new = self._srigl(new, kept, grow_score, w, active, module)
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
        """Overall fraction of active weights over the sparsified layers."""
        total = sum(self.layers[n].weight.numel() for n in self.masks)
        return sum(int(m.sum()) for m in self.masks.values()) / total if total else 1.0
