"""GPU errors a candidate kernel may be skipped for, and the ones that end the process (a fault, a hang)."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch


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
