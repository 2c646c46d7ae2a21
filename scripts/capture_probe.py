"""The end-to-end benchmark's two diagnoses: where a CUDA graph capture of a model's call broke, and
where an eager decode step's host time goes (:func:`step_profile`, and by Python package and function:
:func:`python_profile`).

A capture can be invalidated by a call that raises nothing (a launch whose error goes unchecked); the
next checked call then fails with "operation failed due to a previous error during capture", which
names the wrong place. :func:`where_capture_broke` captures the call again with a hook before and
after every module's forward that reads the capturing stream's status from the CUDA driver
(``cuStreamIsCapturing``: active or invalidated), so the first module that ends with the capture
invalidated is named, with the sparse layer's state where it is one, and the error and its last
frames. :func:`capture_modes` tries each of PyTorch's capture error modes: a capture that only
``"relaxed"`` allows made a call that is unsafe in a capture (an allocation, a module load)."""
from __future__ import annotations

import ctypes
import functools
import traceback
from pathlib import Path
from typing import Callable

import torch
from torch import nn

INVALIDATED = 2   # CUstreamCaptureStatus: 0 none, 1 active, 2 invalidated
E2E_HANG_LIMIT_S = 60.0   # the end-to-end step's waits: a timed prompt or 128-token decode, a probed call, a failed
                          # capture's leftover work, still running this long after it was queued, has hung
SUSPECT_FIX = "SHUFFLEPRUNE_SKIP_IMPLS=<implementation> leaves a suspect out of auto"


def wait(what: str, stream: torch.cuda.Stream | None = None) -> None:
    """``torch.cuda.synchronize()`` with the end-to-end step's hang limit, spinning the whole wait so a wall time
    ends with the GPU (``bench_e2e``'s timer and these probes): a call that never ends is a
    :class:`~shuffleprune.runtime.faults.DeviceFault` naming ``what``, not a step that hangs until its time limit."""
    from shuffleprune.runtime.faults import sync_or_fault

    sync_or_fault(what, SUSPECT_FIX, limit_s=E2E_HANG_LIMIT_S, spin_s=E2E_HANG_LIMIT_S, stream=stream)


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def capture_status() -> int:
    """The current stream's capture status from the driver (0 none, 1 active, 2 invalidated)."""
    status = ctypes.c_int(-1)
    _driver().cuStreamIsCapturing(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ctypes.byref(status))
    return status.value


def layer_state(module: nn.Module) -> dict:
    """What a sparse layer would run (its choices, layout, map, group), for the report."""
    out = {"type": type(module).__name__}
    for attr in ("policy", "choices", "eager_choices", "tiled", "map_span", "in_features", "out_features"):
        if hasattr(module, attr):
            try:
                value = getattr(module, attr)
            except Exception as exc:  # noqa: BLE001 - a property that cannot be read in this state
                value = f"unreadable: {exc}"
            out[attr] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    fused = getattr(module, "fused_inputs", None)
    if fused is not None:
        out["stacked_current"] = fused._current()
    return out


def where_capture_broke(model: nn.Module, call: Callable[[], object], mode: str = "global") -> dict:
    """Capture ``call`` (after one eager run on the capturing stream) with status hooks on every module
    of ``model``; returns ``{"ok": bool, "first_invalidated": "in NAME" | "before NAME" | None,
    "last_ok": NAME, "state": layer_state, "error": str, "frames": [...], "raised_inside": {...}}``:
    ``last_ok`` is the last module whose forward ended with the capture intact, and where the call
    itself raised (on an H100 a library refused to set itself up in the capture), ``raised_inside``
    holds that error, which the capture's failing end otherwise hides."""
    found: dict = {}
    last_ok: list[str] = [""]

    def check(name: str, where: str, module: nn.Module) -> None:
        if "first_invalidated" in found:
            return
        if capture_status() == INVALIDATED:
            found["first_invalidated"] = f"{where} {name}"
            found["state"] = layer_state(module)
        elif where == "in":
            last_ok[0] = name

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: check(n, "before", m)))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: check(n, "in", m)))
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    report: dict = {"mode": mode, "ok": True}
    try:
        with torch.cuda.stream(side):
            call()
            with torch.cuda.graph(graph, stream=side, capture_error_mode=mode):
                call()
    except Exception as exc:  # noqa: BLE001 - the report is the point
        report["ok"] = False
        report.update(_described(exc))
        inner = exc.__context__   # raised inside the captured call, then hidden by the capture's end failing
        if inner is not None:
            report["raised_inside"] = _described(inner)
        wait(f"the work queued before a failed capture ({mode})", stream=side)
    finally:
        for h in handles:
            h.remove()
        torch.cuda.current_stream().wait_stream(side)
    report["first_invalidated"] = found.get("first_invalidated")
    report["last_ok"] = last_ok[0]
    if "state" in found:
        report["state"] = found["state"]
    del graph
    return report


def _described(exc: BaseException) -> dict:
    """An exception's type and first line, and its last frames."""
    return {"error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}",
            "frames": [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                       for f in traceback.extract_tb(exc.__traceback__)[-8:]]}


def capture_modes(model: nn.Module, call: Callable[[], object]) -> list[dict]:
    """:func:`where_capture_broke` in each capture error mode, strictest first."""
    return [where_capture_broke(model, call, mode) for mode in ("global", "thread_local", "relaxed")]


def step_profile(step: Callable[[], object], top: int = 12) -> dict:
    """One call of ``step`` under PyTorch's profiler: the host's time queuing it (perf_counter, no sync)
    against its time to the GPU's end (every wait with the probe's hang limit: :func:`wait`), the CUDA
    runtime and driver calls made (count and host µs; a synchronize or a blocking copy among them makes
    the host wait for the GPU), the kernels run (and the ``top`` with the most GPU time: name, launches,
    µs), and the operators with the most host time of their own."""
    import time

    from torch.profiler import ProfilerActivity, profile

    wait("the work queued before a profiled step")
    t0 = time.perf_counter()
    step()
    queued = time.perf_counter() - t0
    wait("a profiled step (timed)")
    done = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        wait("a profiled step (under the profiler)")
    events = prof.key_averages()
    api = {e.key: {"count": e.count, "host_us": round(e.cpu_time_total, 1)} for e in events
           if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cutlass")}
    on_gpu = [e for e in events if getattr(e, "device_type", None) is not None
              and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    kernels = sum(e.count for e in on_gpu)
    top_kernels = [{"kernel": e.key[:100], "count": e.count, "gpu_us": round(e.self_device_time_total, 1)}
                   for e in sorted(on_gpu, key=lambda e: -e.self_device_time_total)[:top]]
    ops = sorted((e for e in events if not e.key.startswith(("cuda", "cu"))), key=lambda e: -e.self_cpu_time_total)
    return {"host_queue_ms": round(queued * 1e3, 3), "to_gpu_end_ms": round(done * 1e3, 3),
            "runtime_calls": dict(sorted(api.items(), key=lambda kv: -kv[1]["count"])), "kernels": kernels,
            "gpu_ms": round(sum(e.self_device_time_total for e in on_gpu) / 1e3, 3), "top_kernels": top_kernels,
            "top_host_ops": [{"op": e.key[:80], "count": e.count, "self_host_us": round(e.self_cpu_time_total, 1)}
                             for e in ops[:top]]}


# Python's own time grouped by where it runs: this package (its modules' folders, kernels/ and calib/
# included wherever they are installed from), else the first area whose marker is in a function's file (or,
# for a built-in, its name)
AREAS = (("triton", "/triton/"), ("transformers", "/transformers/"), ("torch.nn modules", "/torch/nn/"),
         ("torch (other Python)", "/torch/"), ("torch built-ins", "torch"))
# Triton's dispatch, its compile-or-load on a cache miss and our fast launches: calls per step (a miss in a
# steady decode would be a kernel looked up anew at every step)
WATCHED = {("jit.py", "run"): "triton_dispatches", ("jit.py", "_do_compile"): "triton_cache_misses",
           ("launch.py", "__call__"): "fast_kernel_calls"}   # BoundLaunch.__call__: every call of a fast(kernel)


@functools.cache
def _package_dirs() -> tuple[str, ...]:
    import shuffleprune
    from shuffleprune import calib, kernels

    return tuple(str(Path(m.__file__).resolve().parent) + "/" for m in (shuffleprune, kernels, calib))


def area_of(filename: str, funcname: str) -> str:
    """The area a profiled function belongs to: ``shuffleprune``, one of :data:`AREAS`, or ``other``."""
    if filename != "~" and str(Path(filename).resolve()).startswith(_package_dirs()):
        return "shuffleprune"
    where = funcname if filename == "~" else filename
    return next((name for name, marker in AREAS if marker in where), "other")


def python_profile(step: Callable[[], object], steps: int = 3, top: int = 20) -> dict:
    """``steps`` calls of ``step`` under :mod:`cProfile`: the host time per step, the time Python spent
    inside each area (:func:`area_of`: functions' own time, so nothing counts twice; built-ins such as
    a launch into the CUDA driver count under the area named in their name, else ``other``), the
    calls per step of :data:`WATCHED` (Triton's dispatch, its cache misses, our fast launches) and the
    functions with the most own time. The profiler slows every Python call alike, so the split between
    areas (and between two models' profiles) is what to read, not the absolute times. Runs anywhere
    (the end-to-end benchmark's CPU smoke checks it)."""
    import cProfile
    import pstats
    import time

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats   # (file, line, function) -> (prim calls, calls, own s, cumulative s, callers)
    areas: dict[str, float] = {}
    watched = {name: 0 for name in WATCHED.values()}
    for (filename, _, funcname), (_, calls, own, _, _) in stats.items():
        area = area_of(filename, funcname)
        areas[area] = areas.get(area, 0.0) + own
        name = WATCHED.get((Path(filename).name, funcname))
        if name is not None:
            watched[name] += calls
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    per_step = lambda s: round(s * 1e3 / steps, 3)   # noqa: E731
    return {"steps": steps, "profiled_ms_per_step": per_step(wall),
            "own_ms_per_step_by_area": {a: per_step(t) for a, t in sorted(areas.items(), key=lambda kv: -kv[1])},
            "calls_per_step": {name: round(n / steps, 1) for name, n in watched.items()},
            "top_functions": [{"function": f"{fn.rsplit('/', 2)[-1] if fn != '~' else ''}:{line} {name}"[:120],
                               "area": area_of(fn, name), "calls_per_step": round(calls / steps, 1),
                               "own_ms_per_step": per_step(own), "cumulative_ms_per_step": per_step(cum)}
                              for (fn, line, name), (_, calls, own, cum, _) in ranked]}
