"""Run ``kernels/nm_sparse_mma.cu`` on the CPU: its text with ``sparse_mma_emulator.hpp`` as the prelude
(CUDA's threads, barriers and the sparse MMA as the PTX ISA defines them), built by g++ and called by ctypes."""
from __future__ import annotations

import ctypes
import hashlib
import subprocess
import tempfile
from pathlib import Path

import torch

from shuffleprune.kernels.nm_sparse_mma import kernel_defines, kernel_source
from shuffleprune.kernels.sparse_mma_tiles import SparseMmaPlan

HERE = Path(__file__).parent
_BUILD = Path(tempfile.gettempdir()) / "shuffleprune_sparse_mma"
_LIBS: dict[str, ctypes.CDLL] = {}


def build_text(source: str, stem: str) -> ctypes.CDLL:
    """``source`` (a kernel's text after the emulator, then its launcher) as a shared library, built once per text
    and reused across runs."""
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    if key not in _LIBS:
        _BUILD.mkdir(exist_ok=True)
        lib = _BUILD / f"{stem}_{key}.so"
        if not lib.exists():
            src = _BUILD / f"{stem}_{key}.cpp"
            src.write_text(source)
            tmp = lib.with_suffix(f".{id(source)}.tmp")
            done = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-o", str(tmp),
                                   str(src)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"g++ failed on {src}:\n{done.stderr[-4000:]}")
            tmp.replace(lib)
        _LIBS[key] = ctypes.CDLL(str(lib))
    return _LIBS[key]


def emulator(hardware: tuple[str, ...] = ()) -> str:
    """The emulator's text, reading the MMA's fragments as the PTX ISA says, or with ``hardware``'s knobs (some of
    ``FRAGMENT_KNOBS``) flipped: another GPU's reading, as a probe would find it."""
    return "".join(f"#define SPEMU_HW_{knob} 1\n" for knob in hardware) + (HERE / "sparse_mma_emulator.hpp").read_text()


def build(defines: dict, hardware: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The decode variant of ``defines`` as a shared library (on an emulated GPU reading the fragments as ``hardware``
    says: :func:`emulator`)."""
    lib = build_text(kernel_source(defines, emulator(hardware)) + (HERE / "sparse_mma_launcher.cpp").read_text(),
                     "sparse_mma")
    lib.spemu_launch.restype = ctypes.c_char_p
    return lib


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _bytes(t: torch.Tensor) -> ctypes.c_size_t:
    """The bytes from ``t``'s first element to the end of its storage (what a view may reach)."""
    return ctypes.c_size_t(t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())


def run_cpu(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, bias: torch.Tensor | None, tiled: bool,
            plan: SparseMmaPlan, seed: int = 0, x_stride: int | None = None,
            perm: torch.Tensor | None = None, pdl: bool = False,
            hardware: tuple[str, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output ``[T, R]`` for ``x`` ``[T, C]`` (a view whose rows are ``x_stride`` apart if given;
    read through the int32 index map ``perm`` if given; ``pdl``: the text of a programmatic dependent, whose grid
    wait and release do nothing here), and its split-K counters after the launch (the kernel leaves them at zero)."""
    rows, cols = values.shape[0], 2 * values.shape[1]
    tokens = x.shape[0]
    mapped = perm is not None
    lib = build(kernel_defines(plan, x.dtype, tiled, bias is not None, True, mapped, pdl), hardware)
    y = torch.full((tokens, rows), float("nan"), dtype=x.dtype)
    partial = torch.full((max(plan.splits * tokens * rows, 1),), float("nan"), dtype=torch.float32)
    grid = plan.grid(rows)
    counters = torch.zeros(grid[0], dtype=torch.int32)
    b = bias if bias is not None else values
    p = perm if mapped else words
    err = lib.spemu_launch(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(32 * plan.warps),
                           ctypes.c_uint(seed), _ptr(x), _bytes(x), _ptr(values), _bytes(values), _ptr(words),
                           _bytes(words), _ptr(p), _bytes(p), _ptr(b), _bytes(b), _ptr(y), _bytes(y), _ptr(partial),
                           _bytes(partial),
                           _ptr(counters), _bytes(counters), ctypes.c_int(tokens), ctypes.c_int(rows),
                           ctypes.c_int(cols), ctypes.c_int(x_stride or x.stride(0)), ctypes.c_int(plan.ks),
                           ctypes.c_uint(plan.dynamic_shared(tokens, mapped)))
    if err is not None:
        raise RuntimeError(err.decode())
    return y, counters


def prefetched(plan: SparseMmaPlan, x: torch.Tensor, values: torch.Tensor, tiled: bool, mapped: bool) -> list[int]:
    """The values buffer offsets (in elements) the last :func:`run_cpu` launch of that variant asked into L2."""
    lib = build(kernel_defines(plan, x.dtype, tiled, False, True, mapped, False))
    lib.spemu_prefetches.restype = ctypes.c_size_t
    count = lib.spemu_prefetches(None, ctypes.c_size_t(0))
    out = (ctypes.c_void_p * max(count, 1))()
    lib.spemu_prefetches(out, ctypes.c_size_t(count))
    return sorted((out[i] - values.data_ptr()) // values.element_size() for i in range(count))
