"""What tensors and modules hold, whether they fit, and the peak memory of a run (CUDA allocator or process RSS)."""
from __future__ import annotations

import resource
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from shuffleprune.errors import UserError, reason
from shuffleprune.runtime.devices import indexed_cuda


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the tensors' elements take."""
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters and buffers (what it holds in memory)."""
    return tensor_bytes((*module.parameters(), *module.buffers()))


def free_memory_bytes(device: torch.device) -> int | None:
    """The memory a new allocation on ``device`` can get: CUDA's free memory there, else the CPU's
    (:func:`available_memory_bytes`; None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(indexed_cuda(device))[0]
    return available_memory_bytes()


def fits_on_device(model: torch.nn.Module, device: torch.device, working_bytes: int = 0) -> bool:
    """Whether ``model`` can be moved whole onto ``device`` with ``working_bytes`` (and 1 GiB more) to
    spare for the work on it: always on the CPU; on CUDA, the bytes of its parameters and buffers not
    already there against the device's free memory."""
    if device.type != "cuda":
        return True
    target = indexed_cuda(device)
    tensors = (*model.parameters(), *model.buffers())
    missing = tensor_bytes(t for t in tensors if t.device != target)  # "cuda" is cuda:N there
    return missing + working_bytes + 2**30 <= free_memory_bytes(target)


def logits_bytes(model: torch.nn.Module, tokens: int) -> int:
    """What scoring ``tokens`` tokens at once holds besides the model, about: the logits in the
    model's dtype, their float32 copy and the log-softmax (``tokens × vocab × 10`` bytes; the
    vocabulary is the LM head's rows, which a multimodal model's top-level config does not give)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = head.weight.shape[0] if head is not None else getattr(getattr(model, "config", None), "vocab_size", 0)
    return tokens * (vocab or 0) * 10


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
    keeps rising). :func:`peak_rss_mb` still reports the whole process's peak, :func:`.facts.gpu_facts` the
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
    """On a GPU, start the whole-run high-water mark :func:`.facts.gpu_facts` reports (a run's, not an earlier
    run's in the same process); elsewhere nothing (the host's RSS peak is the process's)."""
    if device.type == "cuda":
        _CUDA_PEAK_BEFORE_RESET.pop(indexed_cuda(device).index, None)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak since :func:`reset_peak_memory`: CUDA memory allocated on a GPU, else process RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _hwm_mb()


def run_peak_cuda_bytes(device: torch.device) -> int:
    """The bytes the CUDA allocator held at most on ``device`` since :func:`start_run_peak` (else over this
    process's life), the per-stage resets of :func:`reset_peak_memory` included."""
    return max(_CUDA_PEAK_BEFORE_RESET.get(indexed_cuda(device).index, 0), torch.cuda.max_memory_allocated(device))


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: CUDA's out-of-memory error, the CPU allocator's, or C++'s
    ``std::bad_alloc`` from torch's own code (a large index or list tensor built under a memory limit)."""
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and ("DefaultCPUAllocator: can't allocate memory" in str(exc)
                                           or str(exc).strip() == "std::bad_alloc"))


@contextmanager
def memory_errors(fix: Callable[[], str]) -> Iterator[None]:
    """Within the block, an allocation that fails is a one-line error saying so and what to do (``fix()``,
    asked at once), not a traceback."""
    try:
        yield
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        raise UserError(f"ran out of memory ({reason(exc, 140)}): {fix()}") from exc
