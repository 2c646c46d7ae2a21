"""Fused MoE experts in an export: every expert's matrix held compressed, stacked per projection.

transformers 5 stores a layer's experts as one ``[experts, out, in]`` parameter per projection
(``[experts, in, out]`` when the layer ``is_transposed``) and picks the experts forward by name from
its experts interface (``config._experts_implementation``). ``export`` compresses each expert of a
pruned fused parameter like a linear layer (:mod:`.experts_export`: ``NAME[e].values`` / ``NAME[e].meta``,
and the expert's index map ``NAME[e].perm`` when it has one: the kernel reads its input through it);
on load :func:`~shuffleprune.deploy.experts_load.attach_sparse_experts` stacks them in
``module.nm_experts[param]`` (expert ``e`` is ``module.nm_experts[param][e]``), drops the dense
parameter, and selects :func:`nm_experts_forward`, registered with transformers as ``"shuffleprune_nm"``:
gate or activation, biases, post-expert norm and routing weights as transformers computes them, each
projection run sparse, or by its dense slice where a parameter was left dense.

A fused projection is held as one :class:`SparseExperts`: every expert's values, positions and map
stacked (``[E, R, K]``, ``[E, R, B]``, ``[E, C]``), with each expert's :class:`SparseLinear` a view.
Its forward takes one of two ways (``mode``):

- ``grouped``: both projections by one launch each of :func:`shuffleprune.kernels.nm_experts.nm_experts`
  over all the router's (token, slot) pairs, grouped by expert on the device — no host
  synchronisation, so a decode step captures into a CUDA graph; each expert's weight is read once
  per block of its pairs.
- ``loop``: transformers' eager loop over the experts some token chose (one host synchronisation
  to group the tokens), each projection by the expert's :class:`SparseLinear` (``auto``'s measured
  kernel choice per token count).

``auto`` (:func:`experts_mode`) runs the loop where the grouped kernel cannot run (the CPU, N:M other
than powers of two, a projection left dense), the grouped kernel inside a CUDA graph capture, and
otherwise the faster of the two for that kind of layer and token bucket, measured once on CUDA
(:func:`measure_experts_mode`, which also drops a grouped kernel whose output disagrees).

Under ``torch.compile`` the layer's experts forward is one custom operator (:func:`nm_experts_op`),
found by its projection's key: the compiled model stays one graph, and a CUDA graph of it captures
the grouped kernel's launches.
"""
from __future__ import annotations

import itertools
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from shuffleprune.deploy import choice_store
from shuffleprune.deploy.format import meta_bits
from shuffleprune.deploy.input_gather import token_bucket
from shuffleprune.deploy.auto_choice import AGREE_RTOL, relative_error
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.errors import UserError
from shuffleprune.runtime.faults import candidate_errors, first_line, raise_if_fault
from shuffleprune.runtime.graph_pools import capturing, outside_graph_pools
from shuffleprune.runtime.timing import eager_ms

IMPLEMENTATION = "shuffleprune_nm"
MODES = ("auto", "grouped", "loop")


class SparseExperts(nn.Module):
    """One fused expert projection of an export held compressed: ``values`` ``[E, R, K]``, ``meta``
    ``[E, R, B]`` (the export's bytes), ``perm`` ``[E, C]`` int32 or ``None`` (an expert without a map
    holds the identity there, ``mapped`` says which have one). ``self[e]`` is expert ``e`` as a
    :class:`SparseLinear` over views of these (no copy; made again after ``.to()`` moved them);
    :meth:`grouped` runs every expert at once; ``gather_first`` (default) gathers each pair's input in
    its expert's map order before the grouped kernel, ``False`` has the kernel read the maps itself
    (kept for ``scripts/bench_moe.py`` to time both)."""

    gather_first: bool = True

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, in_features: int, n: int, m: int,
                 perm: torch.Tensor | None, mapped: list[bool], policy: str = "auto", mode: str = "auto"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown experts mode {mode!r}; use one of {', '.join(MODES)}")
        self.in_features, self.n, self.m = in_features, n, m
        self.register_buffer("values", values)
        self.register_buffer("meta", meta)
        self.register_buffer("perm", perm)
        self.mapped, self.policy, self.mode = list(mapped), policy, mode
        self._views: dict = {}      # (values' address) → the experts' SparseLinear views
        self._words: tuple | None = None
        self.owner: nn.Module | None = None   # the experts layer holding this projection (a plain attribute)
        self._register()

    def _register(self) -> None:
        """A key of this projection's own, by which the compiled op (:func:`nm_experts_op`) finds its layer."""
        self._key = next(_KEYS)
        _HELD[self._key] = self

    def __setstate__(self, state: dict) -> None:   # a deepcopy's owner is the copied layer (deepcopy's memo)
        super().__setstate__(state)
        self._register()

    def __setattr__(self, name: str, value) -> None:
        if name == "owner":   # not a submodule: the layer holds this projection, not the other way round
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __len__(self) -> int:
        return self.values.shape[0]

    def __getitem__(self, expert: int) -> SparseLinear:
        key = (self.values.data_ptr(), self.meta.data_ptr(), None if self.perm is None else self.perm.data_ptr())
        if key not in self._views:
            self._views = {key: [SparseLinear(self.values[e], self.meta[e], self.in_features, self.n, self.m,
                                              self.perm[e] if self.mapped[e] else None, None, policy=self.policy)
                                 for e in range(len(self))]}
        return self._views[key][expert]

    def extra_repr(self) -> str:
        experts, rows, _ = self.values.shape
        return (f"experts={experts}, in_features={self.in_features}, out_features={rows}, {self.n}:{self.m}, "
                f"mapped={sum(self.mapped)}, mode={self.mode}")

    def kernels_apply(self) -> bool:
        """Whether the word-layout kernels take this pattern (N and M powers of two)."""
        return not (self.n & (self.n - 1) or self.m & (self.m - 1))

    def kind(self) -> tuple:
        """What ``auto``'s measured mode depends on besides the call: shape, pattern, maps."""
        return (*self.values.shape, self.in_features, self.n, self.m, any(self.mapped))

    def words(self) -> torch.Tensor:
        """The positions as int32 words ``[E, R, W]`` (a view of ``meta`` when rows are whole words)."""
        from shuffleprune.kernels.nm_words import position_words

        if self._words is None or self._words[0] is not self.meta:
            experts, rows, nbytes = self.meta.shape
            words = outside_graph_pools(lambda: position_words(self.meta.reshape(experts * rows, nbytes)), self.meta)
            self._words = (self.meta, words.view(experts, rows, -1))
        return self._words[1]

    def grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, x_div: int, routes=None) -> tuple:
        """``y[p] = x[p // x_div][perm_e] @ W_eᵀ`` for each pair ``p`` of ``expert_ids`` (expert ``e``): one
        launch of the grouped kernel (:func:`shuffleprune.kernels.nm_experts.nm_experts`); returns ``y``
        and the pairs' grouping, which the layer's other projection takes as ``routes``."""
        from shuffleprune.kernels.nm_experts import nm_experts

        return nm_experts(x, self.values, self.words(), self.n, self.m, meta_bits(self.m), expert_ids, x_div,
                          self.perm, routes=routes, gather_first=self.gather_first)


def _project(module: nn.Module, param: str, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` through expert ``expert``'s ``param`` projection (sparse when exported so), plus its bias."""
    held = getattr(module, "nm_experts", {})
    if param in held:
        out = held[param][expert](x)
    else:
        w = getattr(module, param)[expert]
        out = x @ w if module.is_transposed else F.linear(x, w)
    if getattr(module, "has_bias", False):
        out = out + getattr(module, f"{param}_bias")[expert]
    return out


def nm_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts forward of a layer with compressed experts: the grouped kernel or the per-expert
    loop (:func:`experts_mode`); under ``torch.compile`` one opaque operator (:func:`nm_experts_op`)."""
    if torch.compiler.is_compiling():
        key = next(iter(self.nm_experts.values()))._key
        return torch.ops.shuffleprune.nm_experts(hidden_states, top_k_index, top_k_weights, key)
    return eager_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def eager_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`nm_experts_forward` run eagerly: the mode :func:`experts_mode` picks for this call."""
    if experts_mode(self, hidden_states, top_k_index, top_k_weights) == "grouped":
        return grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return loop_experts_forward(self, hidden_states, top_k_index, top_k_weights)


_KEYS = itertools.count()
_HELD: "weakref.WeakValueDictionary[int, SparseExperts]" = weakref.WeakValueDictionary()


@torch.library.custom_op("shuffleprune::nm_experts", mutates_args=())
def nm_experts_op(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  key: int) -> torch.Tensor:
    """The compressed experts layer that holds projection ``key``, run eagerly as one operator, which
    ``torch.compile`` keeps whole in its graph (the dense model's experts compile to one graph too):
    the mode choice and the loop's host synchronisation stay inside it, and inside a CUDA graph
    capture (``mode="reduce-overhead"``) ``auto`` runs the grouped kernel, which has none."""
    return eager_experts_forward(_HELD[key].owner, hidden_states, top_k_index, top_k_weights)


@nm_experts_op.register_fake
def _nm_experts_shape(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      key: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)


def experts_mode(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                 top_k_weights: torch.Tensor | None = None) -> str:
    """``grouped`` or ``loop`` for this call: the projections' ``mode`` where one is set (``grouped`` needs
    both projections compressed). ``auto``: the loop where the grouped kernel cannot run (the CPU, N:M
    not powers of two, a projection left dense), the grouped kernel inside a CUDA graph capture (the
    loop waits on the host), else what :func:`measure_experts_mode` found faster for this kind of
    layer and token bucket (measured on the first such call with its routing; the loop without one)."""
    store = getattr(module, "nm_experts", {})
    up = "gate_up_proj" if module.has_gate else "up_proj"
    if up not in store or "down_proj" not in store:   # a projection left dense: only the loop runs it
        return "loop"
    held = [store[up], store["down_proj"]]
    modes = {h.mode for h in held} - {"auto"}
    if len(modes) > 1:
        raise ValueError(f"the experts' projections ask for different modes: {sorted(modes)}")
    if modes:
        return modes.pop()
    if not all(h.kernels_apply() for h in held) or not grouped_runs_on(hidden_states):
        return "loop"
    if capturing(hidden_states):
        return "grouped"
    if top_k_index is None or top_k_weights is None or hidden_states.shape[0] == 0:   # nothing to measure with
        return "loop"
    key = (str(hidden_states.device), hidden_states.dtype, top_k_index.shape[-1], getattr(module, "has_bias", False),
           token_bucket(hidden_states.shape[0]), *(h.kind() for h in held))
    if key not in _MODE_CHOICES:   # off any CUDA graph pool, as SparseLinear measures (what it makes lazily is kept)
        stored = choice_store.recall("experts", key)
        if stored in ("grouped", "loop"):
            _MODE_CHOICES[key] = stored
        else:
            _MODE_CHOICES[key] = outside_graph_pools(
                lambda: measure_experts_mode(module, hidden_states, top_k_index, top_k_weights), hidden_states)
            choice_store.remember("experts", key, _MODE_CHOICES[key])
    return _MODE_CHOICES[key]


_MODE_CHOICES: dict[tuple, str] = {}   # (device, dtype, top-k, bias?, bucket, projections' kinds) → mode


def release_mode_choices() -> None:
    """Forget the experts modes ``auto`` measured (the next call of each kind of layer measures again)."""
    _MODE_CHOICES.clear()


def grouped_runs_on(x: torch.Tensor) -> bool:
    """Whether ``auto`` may run the grouped kernel on ``x``'s device: compiled Triton on CUDA."""
    from shuffleprune.kernels.gpu import kernels_build

    return x.is_cuda and kernels_build()


def measure_experts_mode(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> str:
    """The faster of the grouped kernel and the per-expert loop on this call's tokens and routing, both
    run eagerly (:func:`shuffleprune.runtime.timing.eager_ms`, 5 calls, median of 3; inside a capture only
    the grouped one can run at all). The grouped
    output is first checked against the loop's (whose sparse layers check their own kernels against
    PyTorch): one that disagrees — a kernel miscompiled on this GPU — is not used, with a warning, nor
    one that cannot run here (a Triton or CUDA error, as ``auto`` skips a SparseLinear candidate); an
    error that ends the process's use of the GPU is raised as a ``DeviceFault``."""
    args = (module, hidden_states, top_k_index, top_k_weights)
    with torch.no_grad():
        try:
            grouped = grouped_experts_forward(*args)
        except candidate_errors() as exc:   # a kernel this GPU or Triton cannot build or launch: the loop runs
            raise_if_fault(exc, "the grouped experts kernel", "run the per-expert loop, shuffleprune.deploy."
                           "sparse_experts.set_experts_mode(model, 'loop'), and please report it")
            warnings.warn(f"the grouped experts kernel cannot run on this device ({type(exc).__name__}: "
                          f"{first_line(exc)}); "
                          "the per-expert loop runs instead", RuntimeWarning, stacklevel=2)
            return "loop"
        error = relative_error(grouped, loop_experts_forward(*args))
    if not error <= AGREE_RTOL:
        warnings.warn(f"the grouped experts kernel is off by {error:.3g} of the output's scale on this device; "
                      "the per-expert loop runs instead", RuntimeWarning, stacklevel=2)
        return "loop"
    with torch.no_grad():
        ms = {"grouped": eager_ms([lambda: grouped_experts_forward(*args)] * 5, reps=3),
              "loop": eager_ms([lambda: loop_experts_forward(*args)] * 5, reps=3)}
    return min(ms, key=ms.get)


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every (token, slot) pair through its expert's up (or gate-up) projection, the gate or activation,
    and down, each projection one grouped launch; weighted and summed over each token's slots in
    float32 (transformers' ``batched_mm`` order). Pairs routed to no local expert add nothing."""
    up = "gate_up_proj" if self.has_gate else "up_proj"
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    local = (ids >= 0) & (ids < self.num_experts)
    h, routes = self.nm_experts[up].grouped(hidden_states, ids, k)   # the pairs grouped once for both
    bias_ids = ids.clamp(0, self.num_experts - 1)
    if getattr(self, "has_bias", False):
        h = h + getattr(self, f"{up}_bias")[bias_ids]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y, _ = self.nm_experts["down_proj"].grouped(h, ids, 1, routes)
    if getattr(self, "has_bias", False):
        y = y + self.down_proj_bias[bias_ids]
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    weights = top_k_weights.reshape(-1).float() * local
    out = (y.float() * weights[:, None]).view(hidden_states.shape[0], k, y.shape[-1]).sum(1)   # also no tokens
    return out.to(hidden_states.dtype)


def loop_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """For each expert some token chose, its tokens through up (or gate-up), the gate or activation,
    and down (each projection by the expert's :class:`SparseLinear`, or its dense slice where the
    parameter was left dense), weighted and summed per token."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    up = "gate_up_proj" if self.has_gate else "up_proj"
    k = top_k_index.shape[-1]
    chosen = top_k_index.reshape(-1)
    order = chosen.argsort(stable=True)                   # (token, slot) pairs grouped by expert
    counts = torch.bincount(chosen, minlength=self.num_experts).tolist()   # the one host sync
    ends = torch.tensor(counts).cumsum(0).tolist()
    for expert in range(self.num_experts):               # ids past num_experts: expert-parallel sentinels
        if counts[expert] == 0:
            continue
        pairs = order[ends[expert] - counts[expert]:ends[expert]]
        token, slot = pairs // k, pairs % k
        h = _project(self, up, expert, hidden_states[token])
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        y = _project(self, "down_proj", expert, h)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        out.index_add_(0, token, y.float() * top_k_weights[token, slot, None].float())
    return out.to(hidden_states.dtype)


def register_experts_forward() -> None:
    """Register :func:`nm_experts_forward` with transformers' experts interface as :data:`IMPLEMENTATION`."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as exc:  # transformers 4 has no experts interface (nor fused experts)
        raise UserError("this export holds fused MoE experts, which need transformers 5 or newer; "
                        "pip install -U transformers") from exc

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, nm_experts_forward)


def set_experts_mode(model: nn.Module, mode: str) -> int:
    """Set every compressed experts projection of ``model`` to ``mode`` (``auto``, ``grouped`` or ``loop``,
    see :class:`SparseExperts`); returns how many were set."""
    if mode not in MODES:
        raise ValueError(f"unknown experts mode {mode!r}; use one of {', '.join(MODES)}")
    held = [m for m in model.modules() if isinstance(m, SparseExperts)]
    for m in held:
        m.mode = mode
    return len(held)
