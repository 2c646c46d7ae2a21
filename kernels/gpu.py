"""What the Triton kernels' host code asks of the device they run on (one place, so the compile-only
check of :mod:`.compile_check` can answer for an H100 on a machine without one)."""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - triton is a Linux dependency
    OutOfResources = None


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host's grid and plan arithmetic: ``triton.cdiv`` is a constexpr function,
    about 2 µs a call from the host on a 2-core CPU against a tenth of that for this one."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (0 for 0), as ``triton.next_power_of_2`` gives it, for
    the host (the same constexpr-function cost as :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def precision(x: torch.Tensor) -> str:
    """float32 inputs multiply in full precision (not TF32); 16-bit ones on the tensor cores."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def upcast(x: torch.Tensor) -> bool:
    """Under the interpreter bfloat16 ``tl.dot`` is wrong (numpy has no bfloat16 matmul): there the
    products of bfloat16 tiles are taken in float32. Never on a GPU."""
    return x.dtype == torch.bfloat16 and x.device.type != "cuda"


def native(x: torch.Tensor) -> bool:
    """Whether the kernels run compiled for an NVIDIA GPU and may use inline PTX such as ``prmt``; not
    interpreted on the CPU nor on ROCm (where :func:`.nm_words._prmt` emulates it with shifts)."""
    return x.device.type == "cuda" and torch.version.hip is None


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device may launch as programmatic dependents (``kernels/overlap.py``):
    an NVIDIA GPU of compute capability 9.0 or more (Hopper's grid dependency control); never
    interpreted on the CPU."""
    return x.is_cuda and torch.version.hip is None and _capability(x.get_device())[0] >= 9   # (no device object)


def tma(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device may copy tiles by the Tensor Memory Accelerator (tensor
    descriptors): an NVIDIA GPU of compute capability 9.0 or more, or the CPU's interpreter."""
    return x.device.type == "cpu" or pdl(x)


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    """A CUDA device's compute capability, looked up once (the mapped norm asks on every call)."""
    return torch.cuda.get_device_capability(index)


def properties(device: torch.device):
    """A CUDA device's properties: read once per device index (the host plans every decode launch with
    its SM count and shared memory, and PyTorch's lookup costs microseconds each time); a device named
    without an index (the current one) is asked each time."""
    if device.index is None:
        return torch.cuda.get_device_properties(device)
    return _indexed_properties(device.index)


@functools.lru_cache(maxsize=None)
def _indexed_properties(index: int):
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small number under the interpreter)."""
    if device.type == "cuda":
        return properties(device).multi_processor_count
    return 4  # the interpreter: any small number exercises the split path


L2_BYTES = 50 * 2**20   # H100: L2 cache where the device does not say


def l2_bytes(device: torch.device) -> int:
    """The L2 cache's size: the device's own figure on CUDA, :data:`L2_BYTES` elsewhere."""
    if device.type == "cuda":
        return getattr(properties(device), "L2_cache_size", 0) or L2_BYTES
    return L2_BYTES


SMEM_PER_SM = 228 * 1024  # H100 / H200: shared memory per SM where the device does not say


def smem_per_sm(device: torch.device) -> int:
    """Shared memory per SM (what bounds the tensor-core decode's residency): the device's own
    figure on CUDA (A100 164 KB, H100 228 KB), :data:`SMEM_PER_SM` elsewhere."""
    if device.type == "cuda":
        return getattr(properties(device), "shared_memory_per_multiprocessor", SMEM_PER_SM)
    return SMEM_PER_SM


SMEM_PER_BLOCK_OPTIN = 99 * 1024   # what every CUDA GPU of compute capability 8.0 or more lets one CTA take by opt-in


def smem_per_block_optin(device: torch.device) -> int:
    """The most shared memory one CTA may take by the driver's opt-in: the device's own figure on CUDA (H100 227 KB,
    A100 163 KB, Ada 99 KB), :data:`SMEM_PER_BLOCK_OPTIN` elsewhere."""
    if device.type == "cuda":
        return getattr(properties(device), "shared_memory_per_block_optin", 0) or SMEM_PER_BLOCK_OPTIN
    return SMEM_PER_BLOCK_OPTIN


def short_of_shared_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is Triton refusing a compiled kernel that needs more shared memory than this GPU
    gives one program (its ``OutOfResources``, raised at the first launch before anything runs): the
    tiles and pipelines here were sized on Hopper (227 KB a program); an A100 gives 163 KB, Ada and
    Ampere's smaller chips 99 KB."""
    return OutOfResources is not None and isinstance(exc, OutOfResources) and exc.name == "shared memory"


T = TypeVar("T")


FITTED_STAGES: dict[tuple, int] = {}   # with_fewer_stages' depths that fit, by kind of launch, where shallower than asked


def with_fewer_stages(launch: Callable[[int], T], stages: int, key: tuple | None = None) -> tuple[int, T]:
    """``launch(stages)``, and where its kernel is :func:`short_of_shared_memory` the same with one
    software-pipeline stage fewer, down to one (no tile loaded ahead): the first stage count whose
    kernel fits, and what it returned, as ``(stages, result)``. Any other error, or one stage that still
    does not fit, is raised. ``key`` names the kind of launch: a shallower depth that fitted it before is
    where it starts, and one found now is kept (:data:`FITTED_STAGES`)."""
    fitted = FITTED_STAGES.get(key, stages) if key is not None else stages
    while True:
        try:
            result = launch(fitted)
            break
        except Exception as exc:  # noqa: BLE001 - only Triton's shared-memory refusal is retried
            if fitted <= 1 or not short_of_shared_memory(exc):
                raise
            fitted -= 1
    if key is not None and fitted < stages:
        FITTED_STAGES[key] = fitted
    return fitted, result


MIN_TRITON = (3, 4)   # the oldest Triton that builds every kernel here (PyTorch 2.8's): under 3.2 and 3.3 most of
                      # them fail to compile (chained conditions, no tl.gather; check_kernels_compile, 2026-11-29)


@functools.cache
def kernels_build() -> bool:
    """Whether this machine's Triton builds the N:M kernels: installed, and :data:`MIN_TRITON` or later.
    Where it does not, every sparse layer runs by PyTorch (its weight decompressed for a matmul), with
    one warning naming the upgrade."""
    try:
        import triton
    except ImportError:
        return False
    from packaging.version import Version   # a local build's "+git…" and an "rc" parse too

    if Version(triton.__version__).release[:2] >= MIN_TRITON:
        return True
    import warnings

    warnings.warn(f"Triton {triton.__version__} cannot build shuffleprune's N:M kernels (they need "
                  f"{'.'.join(map(str, MIN_TRITON))} or later, as PyTorch 2.8 installs): sparse layers run by "
                  "PyTorch instead, slower than the dense model; upgrade PyTorch (and with it Triton)",
                  RuntimeWarning, stacklevel=3)
    return False
