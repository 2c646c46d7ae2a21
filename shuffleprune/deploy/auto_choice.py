"""How ``policy="auto"`` picks a :class:`~shuffleprune.deploy.sparse_linear.SparseLinear`'s
implementation: each candidate (:meth:`SparseLinear.candidates`) checked against PyTorch and timed, once
per kind of layer and token bucket, and cuSPARSELt's configuration searched once per kind of layer.

``policy="auto"``: on the CPU ``scratch``; on CUDA the first call of each token-count bucket
(1, 2, 4, … tokens) checks the applicable candidates' outputs against PyTorch's (dropping one that
disagrees), times them, each as a CUDA graph of repeated calls (so the host's launch cost, which
graphs remove, does not decide) that cycle through copies of the weight larger together than the L2
(so each call reads its weight from DRAM, as a model's layers do: one 2:4 weight of a 7B model fits
in an H100's L2, and timed alone it is read from there), and keeps the fastest
(the layer's ``choices``); a first call made during a graph capture takes :func:`default_choice`. Where
that is one whose eager call costs more than its replay (``EAGER_CHECKED``: PyTorch builds
cuSPARSELt's plan on every ``_cslt_sparse_mm`` call before its 2026 fix, about half a millisecond on an
H100; the TMA-fed decodes make two tensor descriptors per call, which the launcher encodes at each
launch), it is timed eagerly against the fastest other candidate too, and calls outside a capture run
the eager winner (the layer's ``eager_choices``): a model served with CUDA graphs prefills on the sparse
tensor cores, and one run eagerly (``generate`` without graphs) does not pay the plan, or the
descriptors, per call. The
choices are shared by every layer of the same shape, pattern, bias and map span (none, a map within
blocks of 64 columns as ``prune`` makes, one over all columns: ``input_gather.map_span``, since how far
the map jumps decides what reading through it costs) on that device and dtype, so a 32-block model
measures each kind of layer once, not 32 times (:func:`release_choices` forgets them). Each answer is
also written to :mod:`.choice_store` and read back by a later process on the same kind of GPU and code,
which then measures only what it has not stored (or what names an implementation no longer weighed).
On Hopper and later the two fastest Triton kernels of the word layout (decode and GEMM) are timed
once more launched as programmatic dependents (``decode+pdl``, ``gemm_swap+pdl`` and so on,
``kernels/overlap.py``: each call's kernels start while the previous call's end and prefetch the
first part of their weight into L2; a mapped input's gather is then the Triton gather that lets the
kernel start early, not ``index_select``), and the fastest of all is kept (a plain launch on a tie).
"""
from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from shuffleprune.deploy import choice_store
from shuffleprune.deploy.impls import (EAGER_CHECKED, PDL_KERNELS, PDL_SUFFIX, default_choice, skip_advice,
                                       skipped_impls, split_pdl)
from shuffleprune.deploy.input_gather import release_gather_choices
from shuffleprune.runtime.faults import candidate_errors, finish_or_fault, raise_if_fault
from shuffleprune.runtime.graph_pools import capturing, outside_graph_pools
from shuffleprune.runtime.timing import cuda_graph_ms, eager_ms



class SparseLinear(Protocol):
    """What this module reads of a :class:`~shuffleprune.deploy.sparse_linear.SparseLinear` (named so
    here; the layer imports this module, not the other way round)."""

    values: torch.Tensor
    meta: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    n: int
    m: int
    tiled: bool
    map_span: int | None

    def candidates(self, x: torch.Tensor) -> list[str]: ...
    def run(self, impl: str, x: torch.Tensor) -> torch.Tensor: ...
    def run_on(self, weight: tuple, impl: str, x: torch.Tensor) -> torch.Tensor: ...
    def reference(self, x: torch.Tensor) -> torch.Tensor: ...
    def weight_copies(self, count: int) -> list[tuple]: ...
    def own_gather(self) -> AbstractContextManager[None]: ...

PDL_RETIMED = 2   # the fastest of PDL_KERNELS auto times again launched so (the order may change: a separate
                  # gather's launch is what a dependent launch hides best)
PDL_RETIME_WITHIN = 1.3   # and any other of them within this factor of the fastest candidate: on an H100 (2026-11-27,
                          # bench_kernel.json) a dependent launch made a decode up to 1.24× faster, and the winners
                          # at 2 tokens (1024×4096: decode 9.2 → 7.4 µs; 4096×4096: decode_swap 16.0 → 13.9) were
                          # 3rd–5th without it, so the two fastest alone missed them
COLD_L2 = 2.5     # auto times each candidate over copies of the weight that together exceed the L2 this many
                  # times, so no call finds its weight there (in a model every layer's weight comes from DRAM)
AGREE_RTOL = 2e-2   # auto drops a candidate whose largest error exceeds this share of the output's largest magnitude
                    # (16-bit rounding gives at most about 5e-3: scripts/results/bench_kernel.json's max_rel_err)

_CHOICES: dict[tuple, tuple[str, str]] = {}   # (device, dtype, rows, cols, N, M, map span, bias?, tiled?, bucket)
                                              # → (implementation in a CUDA graph, implementation eagerly)
_CSLT_CONFIGS: dict[tuple, tuple[int, ...]] = {}   # (device, dtype, rows, cols, bias?, tokens) → cslt_search's
                                                   # configuration: one search per kind of layer, as _CHOICES


def release_choices() -> None:
    """Forget the implementations ``auto`` measured, cuSPARSELt's searched configurations and the input
    gathers' measured orders in this process (the next call of each kind of layer takes the stored answer
    where :mod:`.choice_store` has one, else measures again)."""
    _CHOICES.clear()
    _CSLT_CONFIGS.clear()
    release_gather_choices()


def measured_choice(layer: SparseLinear, x: torch.Tensor, bucket: int) -> tuple[str, str]:
    """``(implementation in a CUDA graph, implementation eagerly)`` for ``layer`` on inputs like ``x`` (token
    bucket ``bucket``): :func:`measure`'s, made once per kind of layer (shape, pattern, map span, bias, layout)
    on that device and dtype, off any CUDA graph pool (the shared scratch it allocates is kept)."""
    key = (str(x.device), x.dtype, layer.out_features, layer.in_features, layer.n, layer.m,
           layer.map_span, layer.bias is not None, layer.tiled, bucket)
    if key not in _CHOICES:
        candidates = layer.candidates(x)
        stored = choice_store.recall("layers", key)
        if stored_applies(stored, candidates):
            _CHOICES[key] = tuple(stored)
        else:
            _CHOICES[key] = outside_graph_pools(lambda: measure(layer, x, candidates), x)
            choice_store.remember("layers", key, _CHOICES[key])
    return _CHOICES[key]


def stored_applies(stored, candidates: list[str]) -> bool:
    """Whether ``stored`` (:func:`.choice_store.recall`'s answer) is a pair of implementations this layer
    weighs now (``+pdl`` launches of them too): one stored under other conditions is measured again."""
    left_out = skipped_impls()
    return (isinstance(stored, list) and len(stored) == 2 and all(isinstance(impl, str) for impl in stored)
            and all(split_pdl(impl)[0] in candidates and impl not in left_out for impl in stored))


def measure(layer: SparseLinear, x: torch.Tensor, candidates: list[str], calls: int = 10,
            reps: int = 5) -> tuple[str, str]:
    """The fastest of ``candidates`` for ``layer`` on ``x`` in a CUDA graph and eagerly: each is compiled and
    run eagerly, its output checked against :meth:`SparseLinear.reference` (one that disagrees — a kernel
    miscompiled or racing on this GPU — is dropped with a warning), then at least ``calls`` calls, each on
    the next of :func:`weight_copies` (the weight read from DRAM, as in a model, not from L2), are
    captured in one CUDA graph whose replays are timed (median of ``reps``), as a model served with CUDA
    graphs runs them; a candidate that cannot be captured is timed eagerly. The graph's winner serves
    eager calls too unless it is in ``EAGER_CHECKED``: then it and the fastest other candidate are timed
    eagerly and the faster serves them. The shared gather is bypassed, so ``decode`` pays for its own
    gather."""
    fallback = default_choice(candidates)   # what runs if no candidate is timed
    timed: dict[str, float] = {}
    with layer.own_gather():
        ref = layer.reference(x)
        weights = weight_copies(layer)
        for impl in candidates:
            try:
                if agrees(layer, impl, x, ref):
                    ms, _, replayed_error = graph_ms(layer, impl, x, weights, calls, reps, ref)
                    if replay_agrees(layer, impl, replayed_error):
                        timed[impl] = ms
                        continue
                if fallback == impl:   # wrong on this device, in its eager call or as replayed
                    fallback = "scratch"
            except candidate_errors() as exc:  # e.g. a tile that does not fit this GPU's shared memory
                raise_if_fault(exc, *_culprit(layer, impl, x))   # not an illegal address: that ends the process
                continue
        if overlap_enabled(x) and timed:   # the fastest Triton kernels again, as programmatic dependents
            for impl in pdl_retimed(timed):
                time_pdl(layer, x, ref, impl, timed, weights, calls, reps)
        best = min(timed, key=timed.__getitem__) if timed else fallback   # the first of a tie, as before
        eager = best
        others = sorted((impl for impl in timed if split_pdl(impl)[0] not in EAGER_CHECKED), key=timed.__getitem__)
        if split_pdl(best)[0] in EAGER_CHECKED and others:
            eager = faster_eagerly([best, others[0]], lambda impl: layer.run(impl, x), calls, reps)
    return best, eager


def weight_copies(layer: SparseLinear) -> list[tuple]:
    """The layer's weight and copies of it, :func:`timing_copies` in all on a CUDA device
    (:meth:`SparseLinear.weight_copies`): the weights :func:`graph_ms` cycles through."""
    if not layer.values.is_cuda:
        return layer.weight_copies(1)
    from shuffleprune.kernels.gpu import l2_bytes

    count = timing_copies(layer.values.nbytes + layer.meta.nbytes, l2_bytes(layer.values.device),
                          torch.cuda.mem_get_info(layer.values.device)[0])
    return layer.weight_copies(count)


def time_pdl(layer: SparseLinear, x: torch.Tensor, ref: torch.Tensor, impl: str, timed: dict[str, float],
             weights: list[tuple], calls: int, reps: int) -> None:
    """Add ``impl`` launched as a programmatic dependent (``PDL_SUFFIX``) to ``timed`` where its output
    agrees and it can be captured in a CUDA graph: that graph's time (:func:`graph_ms`), each call's
    kernels starting while the previous call's end, as a model's layers do."""
    pdl = impl + PDL_SUFFIX
    if pdl in skipped_impls():
        return
    try:
        if agrees(layer, pdl, x, ref):
            ms, how, replayed_error = graph_ms(layer, pdl, x, weights, calls, reps, ref)
            if how == "cuda_graph" and replay_agrees(layer, pdl, replayed_error):
                timed[pdl] = ms
    except candidate_errors() as exc:
        raise_if_fault(exc, *_culprit(layer, pdl, x))


def _culprit(layer: SparseLinear, impl: str, x: torch.Tensor) -> tuple[str, str]:
    """What :func:`~shuffleprune.runtime.faults.raise_if_fault` says of ``impl`` failing on ``x``, and the fix."""
    return (f"SparseLinear {layer.out_features}x{layer.in_features}: {impl} on {x.numel() // x.shape[-1]} tokens",
            f"{skip_advice(impl)} and please report it")


def agrees(layer: SparseLinear, impl: str, x: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``impl``'s output on ``x`` (compiled and run eagerly) is within :data:`AGREE_RTOL` of
    ``ref``; a warning where it is not (a kernel miscompiled or racing on this GPU)."""
    y = layer.run(impl, x)
    finish_or_fault(y, *_culprit(layer, impl, x))   # a candidate that never finishes names itself
    return _within_rtol(layer, impl, relative_error(y, ref), "")


def graph_ms(layer: SparseLinear, impl: str, x: torch.Tensor, weights: list[tuple], calls: int, reps: int,
             ref: torch.Tensor | None = None) -> tuple[float, str, float]:
    """Milliseconds per call of ``impl`` on ``x``: at least ``calls`` calls in one CUDA graph, in turn on
    each of ``weights`` (:func:`weight_copies`, the same weight in new memory), median of ``reps`` replays
    (eagerly timed where it cannot be captured), how (:func:`~shuffleprune.runtime.timing.cuda_graph_ms`), and the
    largest :func:`relative_error` against ``ref`` of the last calls' outputs as the replays left them (0
    without ``ref``): in a graph consecutive calls may overlap (programmatic dependents), which one eager call
    does not show."""
    turns = [weights[i % len(weights)] for i in range(max(calls, len(weights)))]
    outputs: list = []
    what, fix = _culprit(layer, impl, x)   # a call that never finishes as timed names itself
    ms, how = cuda_graph_ms([lambda w=w: layer.run_on(w, impl, x) for w in turns], reps, warm=3, outputs=outputs,
                            what=what, fix=fix)
    return ms, how, max((relative_error(y, ref) for y in outputs), default=0.0) if ref is not None else 0.0


def replay_agrees(layer: SparseLinear, impl: str, error: float) -> bool:
    """Whether ``impl``'s outputs as replayed (:func:`graph_ms`'s error) are within :data:`AGREE_RTOL`; a
    warning where they are not (a race between consecutive calls, a workspace one call leaves wrong)."""
    return _within_rtol(layer, impl, error, " as replayed in a CUDA graph")


def _within_rtol(layer: SparseLinear, impl: str, error: float, how: str) -> bool:
    """Whether ``error`` is within :data:`AGREE_RTOL`; a warning naming ``impl`` (and ``how`` it ran) where not."""
    if error <= AGREE_RTOL:
        return True
    warnings.warn(f"SparseLinear {layer.out_features}x{layer.in_features}: {impl} is off by {error:.3g} of the "
                  f"output's scale{how} on this device; not used", RuntimeWarning, stacklevel=4)
    return False


def pdl_retimed(timed: dict[str, float]) -> list[str]:
    """The candidates of ``timed`` (ms each) that ``auto`` times again as programmatic dependents: the
    :data:`PDL_RETIMED` fastest of ``PDL_KERNELS``, and every other one within
    :data:`PDL_RETIME_WITHIN` of the fastest candidate of all, fastest first."""
    fastest = min(timed.values())
    kernels = sorted((impl for impl in timed if impl in PDL_KERNELS), key=timed.__getitem__)
    near = [impl for impl in kernels[PDL_RETIMED:] if timed[impl] <= PDL_RETIME_WITHIN * fastest]
    return kernels[:PDL_RETIMED] + near


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute difference over the largest magnitude of ``ref`` (``inf`` for a shape
    mismatch or a non-finite value)."""
    if y.shape != ref.shape:
        return float("inf")
    diff = (y.float() - ref.float()).abs().max()
    return float(diff / ref.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny))


def timing_copies(weight_bytes: int, l2_bytes: int, free_bytes: int) -> int:
    """How many weights of ``weight_bytes`` ``auto``'s timing cycles through (the layer's own and
    copies): together more than :data:`COLD_L2` times the L2, at most 64; only the layer's own where
    it alone is that large or the copies would leave less than 256 MiB of the device's
    ``free_bytes`` (it is then timed partly from L2)."""
    count = min(64, -(-int(COLD_L2 * l2_bytes) // weight_bytes))
    return 1 if count <= 1 or (count - 1) * weight_bytes + 2**28 > free_bytes else count


def faster_eagerly(impls: list[str], run, calls: int, reps: int) -> str:
    """The one of ``impls`` whose ``calls`` calls of ``run(impl)`` take least time run eagerly (the
    host's launches and any per-call setup counted; the first of a tie)."""
    times = {impl: eager_ms([lambda impl=impl: run(impl)] * calls, reps) for impl in impls}
    return min(impls, key=times.__getitem__)


def overlap_enabled(x: torch.Tensor) -> bool:
    """Whether the decode kernels may launch as programmatic dependents on ``x``'s device (Hopper on)."""
    from shuffleprune.kernels.overlap import enabled

    return enabled(x)


def cslt_config(packed: torch.Tensor, xt: torch.Tensor, bias: torch.Tensor | None, rows: int) -> tuple[int, ...]:
    """cuSPARSELt's configuration for ``packed @ xt`` (``rows`` output rows, transposed): :func:`cslt_search`'s, searched
    eagerly at the first call of each shape, bias and token count and shared by every layer of that kind
    (``auto`` measures one of them, and the others' first call may be inside a CUDA graph capture, where
    nothing is searched and cuSPARSELt's default configuration, ``()``, runs)."""
    key = (str(xt.device), xt.dtype, rows, xt.shape[0], bias is not None, xt.shape[1])
    config = _CSLT_CONFIGS.get(key)
    if config is None:
        stored = choice_store.recall("cslt", key)
        if isinstance(stored, list) and len(stored) in (1, 3) and all(isinstance(i, int) for i in stored):
            config = _CSLT_CONFIGS[key] = tuple(stored)
        elif capturing(xt):
            config = ()
        else:
            config = _CSLT_CONFIGS[key] = cslt_search(packed, xt, bias)
            choice_store.remember("cslt", key, config)
    return config


def cslt_search(packed: torch.Tensor, xt: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...]:
    """cuSPARSELt's fastest configuration for ``packed @ xt`` (output transposed): ``(alg_id, split_k,
    split_k_mode)`` from ``torch._C._cusparselt.mm_search``, the trailing arguments of
    ``torch._cslt_sparse_mm``. PyTorch builds without it have only the deprecated search, which
    returns the algorithm alone and runs it unsplit (``split_k = 1``)."""
    search = getattr(getattr(torch._C, "_cusparselt", None), "mm_search", None)
    if search is None:
        return (int(torch._cslt_sparse_mm_search(packed, xt, bias, transpose_result=True)),)
    alg_id, split_k, split_k_mode, _ = search(packed, xt, bias, None, None, True)
    return int(alg_id), int(split_k), int(split_k_mode)
