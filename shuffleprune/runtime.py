"""Facts about where a run happens: compute device, peak memory, package versions; GPU timing."""
from __future__ import annotations

import os
import platform
import re
import resource
import sys
import statistics
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator, TypeVar
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from shuffleprune.errors import UserError

T = TypeVar("T")


def check_seed(seed: int) -> None:
    """Refuse a seed outside ``0 … 2**32 − 1`` (what every generator a run seeds accepts, offsets added)."""
    if not 0 <= seed < 2**32:
        raise UserError(f"--seed must be in 0 … {2**32 - 1}, got {seed}")


def pick_device(name: str) -> torch.device:
    """``auto`` → the first CUDA GPU if there is one, else CPU; ``cpu``/``cuda``/``cuda:N`` checked
    (a GPU index this machine does not have is refused here, not by a CUDA error mid-run)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    found = re.fullmatch(r"cpu|cuda(?::(\d+))?", name)
    if found is None:
        raise UserError(f"unknown --device '{name}'; use auto, cpu, cuda or cuda:N")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {name} was asked for but no CUDA GPU is available; use --device cpu")
        count = torch.cuda.device_count()
        if found.group(1) is not None and int(found.group(1)) >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA GPU{'s' * (count != 1)} "
                            f"(cuda:0{f' … cuda:{count - 1}' if count > 1 else ''})")
    return torch.device(name)


def indexed_cuda(device: torch.device) -> torch.device:
    """A CUDA ``device`` with its index: a bare ``cuda`` is the current GPU."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the tensors' elements take."""
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters and buffers (what it holds in memory)."""
    return tensor_bytes((*module.parameters(), *module.buffers()))


def fits_on_device(model: torch.nn.Module, device: torch.device, working_bytes: int = 0) -> bool:
    """Whether ``model`` can be moved whole onto ``device`` with ``working_bytes`` (and 1 GiB more) to
    spare for the work on it: always on the CPU; on CUDA, the bytes of its parameters and buffers not
    already there against the device's free memory."""
    if device.type != "cuda":
        return True
    target = indexed_cuda(device)
    tensors = (*model.parameters(), *model.buffers())
    missing = tensor_bytes(t for t in tensors if t.device != target)  # "cuda" is cuda:N there
    free, _ = torch.cuda.mem_get_info(target)
    return missing + working_bytes + 2**30 <= free


def logits_bytes(model: torch.nn.Module, tokens: int) -> int:
    """What scoring ``tokens`` tokens at once holds besides the model, about: the logits in the
    model's dtype, their float32 copy and the log-softmax (``tokens × vocab × 10`` bytes; the
    vocabulary is the LM head's rows, which a multimodal model's top-level config does not give)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = head.weight.shape[0] if head is not None else getattr(getattr(model, "config", None), "vocab_size", 0)
    return tokens * (vocab or 0) * 10


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
    calls may overlap, not only of one eager call. Every wait for the GPU polls (:func:`wait_or_fault`): a
    call that never finishes, in the warm rounds or only as replayed, is a :class:`DeviceFault` naming
    ``what`` and ``fix`` after ``limit_s`` (default :data:`HANG_LIMIT_S`), not a process hung until its step's
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


def candidate_errors() -> tuple[type[Exception], ...]:
    """What a candidate that cannot run on this device raises (Triton's own errors among them: a tile
    sized for an H100's 228 KB of shared memory is out of resources on a GPU with 100 KB): ``auto``
    and the input gathers skip it and time the others."""
    errors: tuple[type[Exception], ...] = (RuntimeError, NotImplementedError, ValueError)
    try:
        from triton.errors import TritonError
    except ImportError:
        return errors
    return errors + (TritonError,)


# CUDA's errors that leave the context unusable (cudaGetErrorString's words, as PyTorch and Triton quote them):
# after one, every later call on the device fails, so no other candidate can be timed
_FATAL_CUDA_ERRORS = ("an illegal memory access was encountered", "misaligned address",
                      "an illegal instruction was encountered", "unspecified launch failure",
                      "device-side assert triggered", "uncorrectable ECC error", "the launch timed out and was terminated",
                      "hardware stack error", "an exception occurred on the device")


class DeviceFault(RuntimeError):
    """A kernel left the GPU in an error no later call recovers from (the process has to end)."""


def device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` reports one of CUDA's errors that end the context (an illegal address, a misaligned
    one, a launch failure …), not one a candidate may be skipped for (a tile too large for this GPU)."""
    text = str(exc)
    return any(words in text for words in _FATAL_CUDA_ERRORS)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message ("" where it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def raise_if_fault(exc: BaseException, what: str, fix: str = "") -> None:
    """Raise :class:`DeviceFault` naming ``what`` (the candidate that ran) and ``fix`` where ``exc``, caught
    as one of :func:`candidate_errors`, is a :func:`device_fault`: skipping it would only have every later
    call fail with the same error. A ``DeviceFault`` raised inside (a gather measured within a candidate's
    call) goes on unchanged: it names the kernel that faulted."""
    if isinstance(exc, DeviceFault):
        raise exc
    if device_fault(exc):
        raise DeviceFault(f"{what} failed on this GPU with an error that ends the process "
                          f"({first_line(exc) or type(exc).__name__})"
                          + (f"; {fix}" if fix else "")) from exc


HANG_LIMIT_S = 30.0   # a layer's one call still running this long after it was issued has hung (a kernel's bug)


def finish_or_fault(y: object, what: str, fix: str = "", limit_s: float | None = None) -> None:
    """Wait for the kernels that produce ``y`` (a CUDA tensor: the stream's work so far), polling, and raise
    :class:`DeviceFault` naming ``what`` and ``fix`` where they are still running after ``limit_s`` seconds: a
    kernel that never returns (a wrong barrier or loop) would otherwise hang the process at its next
    synchronisation. The GPU is left running it, so the process has to end. Nothing to wait for on the CPU.
    ``limit_s`` defaults to :data:`HANG_LIMIT_S`."""
    if getattr(y, "is_cuda", False) is not True:
        return
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(getattr(y, "device", None)))   # on y's device, not the current one
    wait_or_fault(done, what, fix, limit_s)


SPIN_S = 0.05   # wait_or_fault queries without sleeping this long first, so a timed replay's wait ends within
               # microseconds of the GPU (a 1 ms sleep per wait: about 25 s over bench_kernel's ~34 000 waits)


def wait_or_fault(done, what: str, fix: str = "", limit_s: float | None = None, spin_s: float | None = None) -> None:
    """Poll the CUDA event ``done`` until the work recorded before it ends (spinning for ``spin_s``, default
    :data:`SPIN_S`, then a millisecond between queries); :class:`DeviceFault` naming ``what`` and ``fix`` where
    it has not after ``limit_s`` seconds (default :data:`HANG_LIMIT_S`)."""
    import time

    limit_s = HANG_LIMIT_S if limit_s is None else limit_s
    spin_s = SPIN_S if spin_s is None else spin_s
    start = time.perf_counter()
    while not done.query():
        waited = time.perf_counter() - start
        if waited > limit_s:
            raise DeviceFault(f"{what} did not finish in {limit_s:g} s on this GPU (a kernel that never returns); the "
                              "GPU is left running it, so the process has to end" + (f"; {fix}" if fix else ""))
        if waited > spin_s:
            time.sleep(0.001)


def sync_or_fault(what: str, fix: str = "", limit_s: float | None = None, spin_s: float | None = None,
                  stream: torch.cuda.Stream | None = None) -> None:
    """``torch.cuda.synchronize()`` with a hang limit: wait (:func:`wait_or_fault`) for the work so far of
    ``stream`` (default: the current one), then synchronise the device (at once, unless another stream is still
    busy). A timer that must end within microseconds of the GPU passes ``spin_s`` = ``limit_s`` (never sleeps)."""
    done = torch.cuda.Event()
    done.record(stream)
    wait_or_fault(done, what, fix, limit_s, spin_s)
    torch.cuda.synchronize()


def run_to_fault(main: Callable[[], object]) -> None:
    """Run a GPU script's ``main``; where it ends in a :class:`DeviceFault`, print it and end the process at once
    (status 1), without the interpreter's cleanup, which could wait forever on a GPU left running a kernel that
    never returns (its caller, a benchmark step with a time limit, would lose the rest of that limit)."""
    import traceback

    try:
        main()
    except DeviceFault:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


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
    polls (:func:`wait_or_fault`, naming ``what`` and ``fix``)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        wait_or_fault(end, what, fix, limit_s)
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


@contextmanager
def tf32_matmuls(device: torch.device, enabled: bool) -> Iterator[bool]:
    """Allow TF32 for float32 matmuls and convolutions while inside, on a CUDA ``device`` only (yields
    whether it is on); the previous settings come back on exit. On an H100 it cut a 7B block's
    permutation step from 0.269 to 0.194 s (``scripts/results/bench_perm_cost.json``)."""
    on = enabled and device.type == "cuda"
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if on:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield on
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


_NO_DETERMINISTIC = re.compile(r"(\S+) does not have a deterministic implementation")
CUBLAS_WORKSPACE = ":4096:8"   # cuBLAS's fixed workspace that deterministic mode asks for (CUDA >= 10.2)


@contextmanager
def deterministic_algorithms(enabled: bool, hint: Callable[[], str] = lambda: "") -> Iterator[bool]:
    """With ``enabled``, while inside: PyTorch's deterministic algorithms, strict (an op that has none
    raises, here as a one-line :class:`UserError` naming ``--deterministic`` and ``hint()``; in warn-only
    mode the flash and memory-efficient attention backward would keep their atomic, run-to-run varying
    sums), cuBLAS on a fixed workspace (``CUBLAS_WORKSPACE_CONFIG`` unless set, read at the process's
    first cuBLAS call) and ``torch.empty`` left unfilled (nothing reads uninitialized memory). All
    restored on exit; yields whether it is on. CPU runs repeat bit for bit without it; on a GPU it is
    what should make a run's repeat do so (not yet run on one: README, *Same command, same checkpoint*)."""
    if not enabled:
        yield False
        return
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield True
    except RuntimeError as exc:
        found = _NO_DETERMINISTIC.search(str(exc))
        if found is None:
            raise
        raise UserError(f"{found.group(1)} has no deterministic implementation in PyTorch {torch.__version__} "
                        f"on this device; run without --deterministic{hint()}") from exc
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


@contextmanager
def one_cpu_thread(device: torch.device | str) -> Iterator[None]:
    """Run CPU LAPACK factorizations on one thread while inside: MKL's multi-threaded Cholesky sums
    in an order that depends on the thread count, which changes SparseGPT's masks (and so a
    checkpoint) between machines, loads and ``OMP_NUM_THREADS`` settings. No effect on CUDA."""
    if torch.device(device).type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


_PEAK_BEFORE_RESET_MB = 0.0  # the process's high-water mark before the last reset_peak_memory


def _hwm_mb() -> float:
    """``VmHWM`` (reset by exec and by :func:`reset_peak_memory`) where available, else ``ru_maxrss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def available_memory_bytes() -> int | None:
    """The CPU memory a new allocation can get, about: Linux's ``MemAvailable``, capped by a cgroup v2
    limit (a container's); None where neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def peak_rss_mb() -> float:
    """Peak RSS of this process image, over its whole life (resets of the per-stage mark included).
    Reads ``VmHWM`` where available: Linux's ``ru_maxrss`` survives exec and can report a parent's
    high-water mark in a child."""
    return max(_PEAK_BEFORE_RESET_MB, _hwm_mb())


_CUDA_PEAK_BEFORE_RESET: dict[int, int] = {}   # per GPU index: bytes allocated at most before the last reset


def reset_peak_memory(device: torch.device) -> None:
    """Start a new high-water mark for :func:`peak_memory_mb`: the CUDA allocator's on a GPU; the
    process's peak RSS on Linux (``/proc/self/clear_refs``; where that is refused the mark simply
    keeps rising). :func:`peak_rss_mb` still reports the whole process's peak, :func:`gpu_facts` the
    run's since :func:`start_run_peak`."""
    global _PEAK_BEFORE_RESET_MB
    if device.type == "cuda":
        key = indexed_cuda(device).index
        _CUDA_PEAK_BEFORE_RESET[key] = max(_CUDA_PEAK_BEFORE_RESET.get(key, 0), torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return
    _PEAK_BEFORE_RESET_MB = peak_rss_mb()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def start_run_peak(device: torch.device) -> None:
    """On a GPU, start the whole-run high-water mark :func:`gpu_facts` reports (a run's, not an earlier
    run's in the same process); elsewhere nothing (the host's RSS peak is the process's)."""
    if device.type == "cuda":
        _CUDA_PEAK_BEFORE_RESET.pop(indexed_cuda(device).index, None)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak since :func:`reset_peak_memory`: CUDA memory allocated on a GPU, else process RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _hwm_mb()


def package_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def versions(*packages: str) -> dict[str, str | None]:
    """Python, torch and transformers versions plus any extra ``packages``."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": package_version("transformers")}
    out.update({p: package_version(p) for p in packages})
    return out


def machine() -> dict:
    """CPU/GPU description for result files."""
    info = {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cpu_count": _cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def gpu_facts(device: torch.device) -> dict:
    """What a report records of a CUDA compute device, the one named (``cuda:1`` too, not the current
    device): its name and the peak memory allocated on it since :func:`start_run_peak` (else over this
    process's life), in MB, the per-stage marks of :func:`reset_peak_memory` included; for any other
    device, nothing."""
    if device.type != "cuda":
        return {}
    peak = max(_CUDA_PEAK_BEFORE_RESET.get(indexed_cuda(device).index, 0), torch.cuda.max_memory_allocated(device))
    return {"gpu": torch.cuda.get_device_name(device), "peak_cuda_mb": round(peak / 2**20, 1)}


def cpu_facts() -> dict:
    """The CPU's model and the vector ISA torch's kernels use: float results (and so masks) can
    differ between hosts whose ISA differs (AVX-512 vs AVX2), not with the thread count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}
