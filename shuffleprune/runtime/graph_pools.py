"""Work kept by a layer, allocated outside any CUDA graph's memory pool (as ``torch.compile``'s
``reduce-overhead`` mode routes a thread's allocations into its own)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch


T = TypeVar("T")


def capturing(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on a CUDA device whose current stream is capturing a CUDA graph (where
    nothing may be timed, searched or allocated anew)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# PyTorch 2.8 on routes a CUDA graph pool's allocations by thread (every allocation the capturing or
# warming-up thread makes); before, by stream
_POOLS_BY_THREAD = hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool")
_ASIDE = threading.local()   # .active on outside_graph_pools' own threads


def outside_graph_pools(fn: Callable[[], T], x: torch.Tensor | torch.device) -> T:
    """``fn()`` with every tensor it allocates taken from PyTorch's ordinary allocator, never from a
    CUDA graph's memory pool: for what a layer builds at its first call and keeps (measured choices,
    the shared scratch, stacked weights, split-K counters). ``torch.compile(mode="reduce-overhead")``
    runs its first calls with the calling thread's allocations routed into its graphs' pool (by
    stream before PyTorch 2.8), which may hold nothing but the compiled graphs' outputs: a tensor
    kept there fails the compiled model ("Detected … tensor(s) in the cudagraph pool not tracked as
    outputs"). Where that can happen (:func:`pool_may_route`) ``fn`` runs on a thread of its own (the
    caller waits; its grad and inference modes carry over), on the caller's stream, or before
    PyTorch 2.8 on a stream of its own ordered after the caller's, which waits for it; elsewhere it
    is simply called."""
    device = x.device if isinstance(x, torch.Tensor) else torch.device(x)
    if not pool_may_route(device):
        return fn()
    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run() -> T:
        _ASIDE.active = True   # this thread's allocations are nobody's pool's: nested calls run in place
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            if caller is None:
                return fn()
            stream = caller if _POOLS_BY_THREAD else torch.cuda.Stream(device)
            stream.wait_stream(caller)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                out = fn()
            caller.wait_stream(stream)
            return out

    with ThreadPoolExecutor(1, thread_name_prefix="shuffleprune-outside-pools") as worker:
        return worker.submit(run).result()


def pool_may_route(device: torch.device) -> bool:
    """Whether the calling thread's allocations on ``device`` may be going to a CUDA graph pool it
    cannot keep tensors in: a CUDA device, not capturing (a capture's allocations belong to its
    graph, which nothing here escapes), and not already :func:`outside_graph_pools`' own thread."""
    return device.type == "cuda" and not getattr(_ASIDE, "active", False) and \
        not torch.cuda.is_current_stream_capturing()
