"""GPU time per call, as a server runs it: replays of one CUDA graph, or eager launches, timed with events."""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from shuffleprune.runtime.faults import sync_or_fault, wait_or_fault


REPLAYED_KEPT = 2   # cuda_graph_ms keeps the outputs of this many last calls: a call and the one before, which a
                   # programmatic dependent launch lets overlap it (sharing, say, a split-K workspace)


def cuda_graph_ms(calls: Sequence[Callable[[], object]], reps: int, warm: int = 2,
                  outputs: list | None = None, what: str = "a timed call", fix: str = "",
                  limit_s: float | None = None) -> tuple[float, str]:
    """Milliseconds per call of ``calls`` (run in turn, e.g. one per rotating weight copy) as a model
    served with CUDA graphs runs them: ``warm`` eager rounds on the capturing stream (compiles,
    library handles, workspaces), then one graph of every call whose replays are timed with events,
    the median of ``reps`` over the number of calls. Where capture fails, the rounds run eagerly
    and the host's launch cost counts. Returns ``(ms, "cuda_graph" | "events")``. ``outputs``, where
    given, receives what the last :data:`REPLAYED_KEPT` calls returned as the timed runs left it (a
    replay rewrites the captured outputs in place): a check of the results as served, where consecutive
    calls may overlap, not only of one eager call. Every wait for the GPU polls (:func:`.faults.wait_or_fault`): a
    call that never finishes, in the warm rounds or only as replayed, is a :class:`.faults.DeviceFault` naming
    ``what`` and ``fix`` after ``limit_s`` (default :data:`.faults.HANG_LIMIT_S`), not a process hung until its step's
    limit."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            for call in calls:
                call()
    sync_or_fault(what, fix, limit_s, stream=side)
    kept: list = []
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            kept[:] = last_outputs(calls)
        torch.cuda.synchronize()
        run, how = graph.replay, "cuda_graph"
    except Exception:  # noqa: BLE001 - some paths cannot be captured: timed eagerly
        torch.cuda.synchronize()

        def run() -> None:
            kept[:] = last_outputs(calls)
        how = "events"
    run()   # one replay untimed, waited for with a limit
    sync_or_fault(what, fix, limit_s)
    ms = _events_ms(run, reps, len(calls), what, fix, limit_s)
    if outputs is not None:
        outputs.extend(kept)
    return ms, how


def last_outputs(calls: Sequence[Callable[[], object]]) -> list:
    """Run ``calls`` in turn and return what the last :data:`REPLAYED_KEPT` returned (the others' outputs
    are let go as they go, so a capture's pool reuses their memory)."""
    last: list = []
    for call in calls:
        last = [*last, call()][-REPLAYED_KEPT:]
    return last


def eager_ms(calls: Sequence[Callable[[], object]], reps: int, warm: int = 1) -> float:
    """Milliseconds per call of ``calls`` (run in turn) run eagerly, the host's launches and
    synchronisations included, as a model run without CUDA graphs runs them: ``warm`` rounds, then
    CUDA events around each round, the median of ``reps``."""
    def run() -> None:
        for call in calls:
            call()

    for _ in range(warm):
        run()
    return _events_ms(run, reps, len(calls))


def _events_ms(run: Callable[[], None], reps: int, calls: int, what: str = "a timed call",
               fix: str = "", limit_s: float | None = None) -> float:
    """The median over ``reps`` of ``run``'s time between two CUDA events, per one of its ``calls``; each wait
    polls (:func:`.faults.wait_or_fault`, naming ``what`` and ``fix``)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        wait_or_fault(end, what, fix, limit_s)
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
