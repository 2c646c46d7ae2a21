"""CUDA C++ compiled at run time and launched by the driver: what the one kernel Triton cannot express
(``nm_sparse_mma.cu``, Hopper's and Ampere's sparse MMA) needs from the host, with nothing but PyTorch.

:func:`compile_cuda` compiles a source by NVRTC called here (:class:`Nvrtc`, the ``nvidia-cuda-nvrtc`` wheel
PyTorch's CUDA builds install), keeping each cubin on disk (:func:`cubin_path`: a later process loads it
instead of compiling again, about a second a variant), else by PyTorch's ``torch.cuda._compile_kernel`` (2.8 and
later); :class:`KernelLaunch` launches one kernel from an argument block built once per kind of call
(``cuLaunchKernel``; ``cuLaunchKernelEx`` as a programmatic dependent); :func:`resident_ctas` asks the driver
how many CTAs of it an SM holds.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from shuffleprune.kernels.gpu import _capability


class Nvrtc:
    """Just enough of NVRTC's C API to compile one source to a cubin (and ptxas's report of it)."""

    def __init__(self, lib):
        self.lib = lib

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"{major.value}.{minor.value}"

    def compile(self, source: str, arch: str, report: bool = False) -> tuple[bool, str, bytes]:
        """``(compiled, log, cubin)`` of ``source`` for ``arch`` (``sm_90``), ptxas's report in the log if asked."""
        prog = ctypes.c_void_p()
        if self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", *([b"--ptxas-options=-v"] if report else [])]
        ok = self.lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, log)
        cubin = b""
        if ok:
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetCUBIN(prog, buf)
            cubin = buf.raw
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return ok, log.value.decode(errors="replace"), cubin


def find_nvrtc() -> str | None:
    """The NVRTC library of an installed ``nvidia-cuda-nvrtc`` wheel (PyTorch's CUDA wheels depend on one)."""
    for base in sys.path:
        for found in sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")) +
                            glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*"))):
            if "builtins" not in found:
                return found
    return None


class CompiledKernel:
    """A kernel this module compiled and loaded itself: its ``CUfunction`` (``func``, what :class:`KernelLaunch`
    launches) and the module that holds it."""

    def __init__(self, func: ctypes.c_void_p, module: ctypes.c_void_p):
        self.func, self.module = func, module

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a kernel compiled here launches only through the CUDA driver (KernelLaunch)")


def load_nvrtc(path: str) -> Nvrtc:
    """NVRTC from the library at ``path``, its builtins library (``libnvrtc-builtins.so.*`` in the same folder)
    loaded first: NVRTC opens that one by name at its first compile, and some wheels' libnvrtc (13.0.88, the one
    CUDA 13.0 builds of PyTorch install) carry no run path to find it beside themselves, so without this every
    compile fails with "failed to open libnvrtc-builtins" unless ``LD_LIBRARY_PATH`` names the folder. Once
    loaded, the dynamic loader finds it by its name."""
    folder = os.path.dirname(path)
    if folder:
        for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
            if ".alt." not in os.path.basename(builtins):   # the .alt twin is for static builds
                try:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                except OSError:   # the compile then says what is missing
                    pass
    return Nvrtc(ctypes.CDLL(path))


def own_nvrtc_path() -> str:
    """The NVRTC library this module calls: the ``nvidia-cuda-nvrtc`` wheel's, else the system's by name."""
    return find_nvrtc() or "libnvrtc.so"


def own_nvrtc() -> Nvrtc:
    """NVRTC as this module calls it (:func:`own_nvrtc_path`)."""
    return load_nvrtc(own_nvrtc_path())


def nvrtc_status() -> str:
    """One line on the NVRTC :func:`own_nvrtc` loads: its version and path, and whether it compiles an empty kernel
    (NVRTC missing its builtins library fails there, not at load), or why it cannot be loaded. For a GPU run's log."""
    path = own_nvrtc_path()
    try:
        nvrtc = load_nvrtc(path)
        ok, log, _ = nvrtc.compile('extern "C" __global__ void k() {}', "sm_80")
    except (OSError, AttributeError, RuntimeError) as exc:
        return f"nvrtc: none loadable ({path}: {str(exc).strip()[:160]}); the sparse-MMA kernels are left to PyTorch's"
    return f"nvrtc {nvrtc.version()} {path}: " + ("compiles" if ok else "FAILS: " + log.strip()[-200:].replace("\n", " "))


@dataclass(frozen=True)
class CudaSource:
    """One kernel variant as NVRTC compiles it: its full text, the kernel's name in it, and whether it needs the
    GPU's architecture-specific target (``sm_90a``)."""
    text: str
    name: str
    arch_specific: bool = False


CUBIN_DIR = "cuda_kernels"   # under shuffleprune's cache folder (shuffleprune.cache.cache_dir)


def cubin_path(source: str, name: str, arch: str, nvrtc_version: str) -> Path:
    """Where the cubin of ``name`` in ``source`` that NVRTC ``nvrtc_version`` made for ``arch`` is kept: named by a
    hash of all four, so a changed kernel text, GPU or compiler never finds another's."""
    from shuffleprune.cache import cache_dir

    digest = hashlib.sha256("\0".join((source, name, arch, nvrtc_version)).encode()).hexdigest()[:32]
    return cache_dir() / CUBIN_DIR / f"{name}-{arch}-{digest}.cubin"


def _read_cubin(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if data.startswith(b"\x7fELF") else None   # a cubin is an ELF file; anything else is compiled again


def _keep_cubin(path: Path, cubin: bytes) -> None:
    """Write ``cubin`` whole or not at all; a folder that cannot be written only costs the next process a compile."""
    from shuffleprune.outdir import atomic_write

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: tmp.write_bytes(cubin))
    except OSError:
        pass


def gpu_arch(capability: tuple[int, int], arch_specific: bool = False) -> str:
    """NVRTC's target for a GPU of ``capability``: ``sm_90``, or with ``arch_specific`` its architecture-specific
    ``sm_90a`` (which Hopper's ``wgmma`` needs)."""
    return f"sm_{capability[0]}{capability[1]}" + ("a" if arch_specific else "")


def cached_cubin(source: str, name: str, arch: str, nvrtc: Nvrtc | None = None) -> tuple[bytes, bool]:
    """``(cubin, compiled)``: the cubin of kernel ``name`` in ``source`` for ``arch``, the one kept on disk
    (:func:`cubin_path`; ``compiled`` False), else compiled by ``nvrtc`` (default :func:`own_nvrtc`) and kept. Loads
    nothing, needs no GPU: what ``scripts/compile_ahead.py`` runs in parallel before a GPU run's first kernel asks. A
    RuntimeError where NVRTC refuses the source."""
    nvrtc = nvrtc or own_nvrtc()
    try:
        path = cubin_path(source, name, arch, nvrtc.version())
    except OSError:   # no cache folder can be made (a read-only home): compiled each process, as before
        path = None
    cubin = _read_cubin(path) if path is not None else None
    if cubin is not None:
        return cubin, False
    ok, log, cubin = nvrtc.compile(source, arch)
    if not ok:
        raise RuntimeError(f"NVRTC did not compile {name}: {log.strip()[-500:]}")
    if path is not None:
        _keep_cubin(path, cubin)
    return cubin, True


def compile_own(source: str, name: str, device_index: int, arch_specific: bool = False) -> CompiledKernel:
    """NVRTC (the wheel's library, or the system's) to a cubin for this GPU (``arch_specific``: for its
    architecture-specific target, ``sm_90a``, which Hopper's ``wgmma`` needs), kept on disk (:func:`cubin_path`)
    and loaded by the driver; a cubin kept by an earlier process is loaded without compiling."""
    arch = gpu_arch(_capability(device_index), arch_specific)
    return load_cubin(cached_cubin(source, name, arch)[0], name, device_index)


CUDA_ERROR_INVALID_CONTEXT = 201   # cuda.h: a driver call made on a thread with no current context


def bind_context(cuda, device_index: int) -> None:
    """Make GPU ``device_index``'s primary context (the one PyTorch's runtime calls use) current on this thread
    where no context, or another GPU's, is: the driver loads modules into and launches from the current context,
    and a thread whose CUDA work went only through PyTorch may have none bound (Triton's launcher binds it the
    same way). Nothing where the driver cannot say or refuses: the load or launch then reports its own error."""
    device, current, ctx = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
    if cuda.cuDeviceGet(ctypes.byref(device), device_index):
        return
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value and \
            cuda.cuCtxGetDevice(ctypes.byref(current)) == 0 and current.value == device.value:
        return
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0:
        cuda.cuCtxSetCurrent(ctx)


def load_cubin(cubin: bytes, name: str, device_index: int) -> CompiledKernel:
    """Kernel ``name`` of a cubin, loaded by the driver into the device's primary context."""
    cuda = driver()
    with torch.cuda.device(device_index):
        bind_context(cuda, device_index)
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        status = cuda.cuModuleLoadData(ctypes.byref(module), cubin)
        if status == 0:
            status = cuda.cuModuleGetFunction(ctypes.byref(func), module, name.encode())
    if status:
        raise RuntimeError(f"the CUDA driver did not load {name} (status {status})")
    return CompiledKernel(func, module)


_FAILED: dict[object, str] = {}   # sources that compiled nowhere: refused at once the next time


def compile_cuda(source: str, name: str, device_index: int, key: object = None, arch_specific: bool = False):
    """``source``'s kernel ``name`` compiled for one GPU: by :func:`compile_own` (its cubin kept on disk), else
    through PyTorch's ``torch.cuda._compile_kernel`` (not for an ``arch_specific`` source: PyTorch compiles for the
    plain target). Any failure is a RuntimeError (``auto`` leaves the candidate out), given at once the next time
    for the same ``key`` (default: the source)."""
    key = (source if key is None else key, name, device_index)
    if key in _FAILED:
        raise RuntimeError(_FAILED[key])
    errors = []
    try:
        return compile_own(source, name, device_index, arch_specific)
    except Exception as exc:   # noqa: BLE001 - no NVRTC, no driver, a compile error: PyTorch's own NVRTC call next
        errors.append(f"own NVRTC: {type(exc).__name__}: {str(exc).strip()[:300]}")
    if hasattr(torch.cuda, "_compile_kernel") and not arch_specific:
        try:
            with torch.cuda.device(device_index):
                return torch.cuda._compile_kernel(source, name)   # NVRTC's default dialect: C++17
        except Exception as exc:   # noqa: BLE001 - a private API: any failure leaves the candidate out
            errors.append(f"torch.cuda._compile_kernel: {type(exc).__name__}: {str(exc).strip()[:300]}")
    _FAILED[key] = f"{name} did not compile: " + "; ".join(errors)
    raise RuntimeError(_FAILED[key])


def driver():
    """The CUDA driver library as PyTorch loads it (its helper's name changed across releases)."""
    from torch.cuda import _utils

    for name in ("_get_gpu_runtime_library", "_get_cuda_library"):
        if hasattr(_utils, name):
            return getattr(_utils, name)()
    return ctypes.CDLL("libcuda.so.1")


def resident_ctas(kernel, threads: int, dynamic_shared: int = 0) -> int | None:
    """How many CTAs of ``threads`` threads of a compiled kernel one SM holds (the driver's occupancy), or
    None where the driver cannot be asked."""
    count = ctypes.c_int()
    try:
        status = driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(count), kernel.func, ctypes.c_int(threads), ctypes.c_size_t(dynamic_shared))
    except (AttributeError, OSError):
        return None
    return count.value if status == 0 and count.value > 0 else None


MAX_DYNAMIC_SHARED_SIZE_BYTES = 8   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def allow_dynamic_shared(kernel, nbytes: int) -> None:
    """Let a compiled kernel take ``nbytes`` of dynamic shared memory, over the 48 KB a launch gets without
    asking (``cuFuncSetAttribute``); a RuntimeError where the driver refuses or cannot be asked."""
    try:
        status = driver().cuFuncSetAttribute(kernel.func, MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes))
    except (AttributeError, OSError) as exc:
        raise RuntimeError(f"the CUDA driver was not reachable to allow {nbytes} bytes of shared memory: {exc}") from exc
    if status:
        raise RuntimeError(f"the CUDA driver refused {nbytes} bytes of dynamic shared memory (status {status})")


class _AttributeValue(ctypes.Union):   # CUlaunchAttributeValue (cuda.h): 64 bytes
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization_allowed", ctypes.c_int)]


class _Attribute(ctypes.Structure):    # CUlaunchAttribute: the id, padded to 8 bytes, then the value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _LaunchConfig(ctypes.Structure):   # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)),
                ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class KernelLaunch:
    """``cuLaunchKernel`` of one compiled kernel with its argument block built once: a call writes the
    tensors' addresses and the integers into it and launches on the current stream. PyTorch's own
    ``_CudaKernel`` call builds every ctypes argument anew (the host's cost, not the GPU's, on an eager
    decode step). ``pdl``: ``cuLaunchKernelEx`` with programmatic stream serialization allowed, so the kernel
    may start while the one before it ends (its ``griddepcontrol.wait`` keeps its inputs safe)."""

    def __init__(self, kernel, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, driver,
                 pointers: int, ints: int, pdl: bool = False):
        """``kernel``'s parameters are ``pointers`` tensors' addresses, then ``ints`` 32-bit integers."""
        self.kernel, self.grid, self.block, self.shared = kernel, grid, block, shared
        self.driver, self.pdl = driver, pdl
        self.pointers = [ctypes.c_void_p() for _ in range(pointers)]
        self.ints = [ctypes.c_int() for _ in range(ints)]
        values = self.pointers + self.ints
        self.params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        if pdl:
            self.attribute = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
            self.attribute.value.programmatic_stream_serialization_allowed = 1
            self.config = _LaunchConfig(*grid, *block, shared, None, ctypes.pointer(self.attribute), 1)

    def __call__(self, tensors: list[torch.Tensor], ints: list[int], stream: int) -> None:
        for slot, t in zip(self.pointers, tensors):
            slot.value = t.data_ptr()
        for slot, v in zip(self.ints, ints):
            slot.value = v
        status = self._launch(stream)
        if status == CUDA_ERROR_INVALID_CONTEXT:   # a thread with no context bound yet: bind PyTorch's, once
            bind_context(self.driver, torch.cuda.current_device())
            status = self._launch(stream)
        if status:
            text = ctypes.c_char_p()
            self.driver.cuGetErrorString(status, ctypes.byref(text))
            raise RuntimeError(f"CUDA error: {(text.value or b'unknown').decode()} (cuLaunchKernel, status {status})")

    def _launch(self, stream: int) -> int:
        if self.pdl:
            self.config.stream = stream
            return self.driver.cuLaunchKernelEx(ctypes.byref(self.config), self.kernel.func, self.params, None)
        return self.driver.cuLaunchKernel(self.kernel.func, *self.grid, *self.block, self.shared,
                                          ctypes.c_void_p(stream), self.params, None)
