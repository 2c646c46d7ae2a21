"""A layer's input read through its index map, ``x[..., perm]``, gathered the fastest way where it runs.

On the CPU (and inside ``torch.compile``'s tracing) it is PyTorch's ``index_select``. On a CUDA GPU
there are three ways (:data:`GATHERS`): ``index_select``, and the two Triton gathers of
:mod:`shuffleprune.kernels.gather`, ``columns`` (many small programs, one load per element) and
``rows`` (whole rows staged in shared memory). Which is fastest depends on the token count and the
width: on an H100 the column kernel took about half of ``index_select``'s time at 1–16 tokens (2.1–3.0
µs against 5.1–5.5) and 1.5× more at 2048 × 14336, where both moved under 0.6 TB/s
(``scripts/results/bench_kernel.json``, ``norm_rows``). So the first gather of each device, dtype,
width, token-count bucket (1, 2, 4, … tokens) and map span (:func:`map_span`: a map kept within
blocks of 64 columns, as ``prune``'s, reads memory nearly in order; one over all columns jumps)
checks each way against ``index_select``, times each as a CUDA graph of repeated calls (what a
model served with CUDA graphs runs) and keeps their order, fastest first
(:func:`gather_order`); every later gather of that kind runs the first. A gather launched as a
programmatic dependent (``pdl``, :mod:`shuffleprune.kernels.overlap`) runs the fastest Triton one
(``index_select`` cannot launch so). Met first inside a CUDA graph capture, where nothing can be
timed, a gather takes ``index_select`` (``columns`` with ``pdl``) without keeping that choice.
"""
from __future__ import annotations

import warnings

import torch

from shuffleprune.deploy import choice_store
from shuffleprune.kernels.gpu import kernels_build, next_pow2
from shuffleprune.runtime.faults import candidate_errors, raise_if_fault
from shuffleprune.runtime.graph_pools import capturing, outside_graph_pools
from shuffleprune.runtime.timing import cuda_graph_ms

GATHERS = ("index_select", "columns", "rows")
TRITON_GATHERS = ("columns", "rows")
TIMED_CALLS = 8   # gathers per timed CUDA graph, at most
TIMED_BYTES = 1 << 30   # ... and no more than this many bytes of outputs held by that graph (a long prompt's
                        # activation is hundreds of MB: 32k tokens × 14336 columns in bf16, 0.9 GB)
TIMED_REPS = 5    # replays; the median is kept

_ORDERS: dict[tuple, tuple[str, ...]] = {}   # (device, dtype, width, token bucket, map span) → ways, fastest first


def token_bucket(tokens: int) -> int:
    """Token counts grouped by powers of two (1, 2, 4, …): one measured choice per bucket (the gathers'
    and :class:`~shuffleprune.deploy.sparse_linear.SparseLinear`'s). No tokens: bucket 0, which nothing
    is measured on (an empty input would otherwise pass for two tokens)."""
    return next_pow2(tokens)


def map_span(perm: torch.Tensor) -> int:
    """The smallest power of two ``B`` such that ``perm`` keeps every index in its aligned block of
    ``B`` (``perm[j] // B == j // B``): 1 for the identity, at most 64 for the maps ``prune`` makes
    (block-diagonal, block 64), the width rounded up to a power of two for a map over all columns
    (``dst``'s). How far a read of ``x[perm]`` jumps, and so what it costs: gathers and kernels are
    measured per span. Reads ``perm`` on the host (a device map: one synchronization)."""
    p = perm.detach().to("cpu", torch.int64).reshape(-1)
    if p.numel() == 0:
        return 1
    moved = int((p ^ torch.arange(p.numel())).max())   # the highest bit in which perm[j] and j differ
    return 1 << moved.bit_length()


def gather_orders(device: torch.device | str | None = None) -> dict[tuple[int, int, int | None], tuple[str, ...]]:
    """The measured orders, fastest first, by ``(width, token bucket, map span)`` (of ``device`` where
    given; of the last dtype measured where several were): what a benchmark records beside its timings."""
    return {(width, bucket, span): order for (dev, _, width, bucket, span), order in _ORDERS.items()
            if device is None or dev == torch.device(device)}


def release_gather_choices() -> None:
    """Forget the measured orders (the next gather of each kind measures again)."""
    _ORDERS.clear()


def gather_input(x: torch.Tensor, perm: torch.Tensor, pdl: bool = False, span: int | None = None) -> torch.Tensor:
    """``x[..., perm]`` (``perm``: int32 ``[C]`` on ``x``'s device) by the way measured fastest for this
    kind of input (module docstring); ``pdl``: by a Triton gather launched as a programmatic dependent.
    ``span``: the map's :func:`map_span`, where the caller knows it (measured apart from other spans)."""
    if not measured_here(x) or x.numel() == 0:   # nothing to time on an empty input
        return x.index_select(-1, perm)
    order = gather_order(x, perm, span)
    if pdl:
        how = next(h for h in (*order, "columns") if h in TRITON_GATHERS)
    else:
        how = order[0]
    return run_gather(how, x, perm, pdl)


def run_gather(how: str, x: torch.Tensor, perm: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``x[..., perm]`` by one of :data:`GATHERS` (``pdl`` applies to the Triton ones)."""
    if how == "index_select":
        return x.index_select(-1, perm)
    from shuffleprune.kernels.gather import gather_columns, gather_rows

    if how == "columns":
        return gather_columns(x, perm, pdl=pdl)
    if how == "rows":
        return gather_rows(x, perm, pdl=pdl)
    raise ValueError(f"unknown gather {how!r}; use one of {', '.join(GATHERS)}")


def gather_ways(x: torch.Tensor) -> list[str]:
    """The gathers that apply to ``x``: ``index_select`` always; the Triton ones where Triton is
    installed, ``rows`` where a row fits its shared memory."""
    if not _triton_gathers(x):
        return ["index_select"]
    from shuffleprune.kernels.gather import rows_fit

    return ["index_select", "columns", *(["rows"] if rows_fit(x.shape[-1], x.dtype) else [])]


def gather_order(x: torch.Tensor, perm: torch.Tensor, span: int | None = None) -> tuple[str, ...]:
    """The ways of :func:`gather_ways` that agree with ``index_select`` on ``x``, fastest first: measured
    at the first gather of this device, dtype, width, token bucket and map span (``None``: not given),
    then looked up. Inside a CUDA graph capture with nothing measured yet: ``("index_select",)``, not kept."""
    width = x.shape[-1]
    key = (x.device, x.dtype, width, token_bucket(x.numel() // width if width else 0), span)
    order = _ORDERS.get(key)
    if order is None:
        stored = choice_store.recall("gathers", key)
        if isinstance(stored, list) and stored and set(stored) <= set(gather_ways(x)):
            order = _ORDERS[key] = tuple(stored)
        elif capturing(x):
            return ("index_select",)
        else:
            order = _ORDERS[key] = outside_graph_pools(lambda: _measure(x, perm), x)
            choice_store.remember("gathers", key, order)
    return order


def _measure(x: torch.Tensor, perm: torch.Tensor) -> tuple[str, ...]:
    """Each way of :func:`gather_ways` checked against ``index_select`` (one that differs, or cannot run
    on this device, is dropped, with a warning for a difference) and timed; their names, fastest first."""
    ref = x.index_select(-1, perm)
    calls = timed_calls(x.numel() * x.element_size())
    times: dict[str, float] = {}
    for how in gather_ways(x):
        try:
            if not torch.equal(run_gather(how, x, perm), ref):
                warnings.warn(f"the {how} gather of {x.shape[-1]} columns differs from index_select on this "
                              "device; not used", RuntimeWarning, stacklevel=4)
                continue
            times[how] = cuda_graph_ms([lambda how=how: run_gather(how, x, perm)] * calls, TIMED_REPS)[0]
        except candidate_errors() as exc:   # e.g. a staged row larger than this GPU's shared memory
            raise_if_fault(exc, f"the {how} gather of {x.shape[-1]} columns", "please report it")
            continue
    return tuple(sorted(times, key=times.__getitem__)) or ("index_select",)


def timed_calls(nbytes: int) -> int:
    """Gathers of ``nbytes`` of output per timed CUDA graph: :data:`TIMED_CALLS`, fewer where their
    outputs together would pass :data:`TIMED_BYTES` (one at least)."""
    return max(1, min(TIMED_CALLS, TIMED_BYTES // max(1, nbytes)))


def measured_here(x: torch.Tensor) -> bool:
    """Whether gathers of ``x`` choose by measurement: on a CUDA device, outside ``torch.compile``'s
    tracing (where ``index_select`` is an op it knows), with Triton installed."""
    return x.is_cuda and not torch.compiler.is_compiling() and _triton_gathers(x)


def _triton_gathers(x: torch.Tensor) -> bool:
    return kernels_build() and x.dim() > 0 and x.shape[-1] > 0
