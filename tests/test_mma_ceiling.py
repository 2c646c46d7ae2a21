"""``scripts/mma_ceiling.cu`` (the tensor cores' ceiling on a GPU) on the CPU under the sparse-MMA emulator: each
thread's sum is what the host's flops count assumes, for the sparse and the dense MMA, so a ceiling it reports on a GPU
counts only MMAs that were done."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import mma_ceiling as mc  # noqa: E402
from sparse_mma_cpu import HERE, _bytes, _ptr, build_text, emulator  # noqa: E402


def _run(sparse: bool, chains: int, threads: int, iters: int, grid: int, words: torch.Tensor) -> torch.Tensor:
    defines = mc.kernel_defines(sparse, chains, threads, torch.bfloat16, True)
    lib = build_text(mc.ceiling_source(defines, emulator()) + (HERE / "mma_ceiling_launcher.cpp").read_text(),
                     "mma_ceiling")
    lib.spemu_ceiling_launch.restype = ctypes.c_char_p
    out = torch.full((grid * threads,), float("nan"))
    err = lib.spemu_ceiling_launch(ctypes.c_uint(grid), _ptr(words), _bytes(words), _ptr(out), _bytes(out),
                                   ctypes.c_int(iters))
    if err is not None:
        raise RuntimeError(err.decode())
    return out


@pytest.mark.parametrize("sparse", [True, False])
def test_each_thread_sums_what_the_count_of_mmas_gives(sparse):
    """2 CTAs of 2 warps, 3 chains, 5 rounds: every thread's sum is 4 × chains × 16 × rounds, and each MMA adds 16
    to each output (one round sums to 4 × chains × 16)."""
    words = mc.operands(torch.bfloat16)
    out = _run(sparse, chains=3, threads=64, iters=5, grid=2, words=words)
    assert torch.equal(out, torch.full_like(out, mc.expected_sum(5, 3)))
    assert mc.expected_sum(5, 3) == 5 * mc.expected_sum(1, 3) == 5 * 4 * 3 * mc.PER_MMA
    assert torch.equal(_run(sparse, chains=3, threads=64, iters=0, grid=2, words=words), torch.zeros(128))


def test_the_operands_are_ones_and_an_ordered_code():
    """A and B hold bf16 ones; the metadata keeps positions 0 and 1 of every group (so the sparse MMA's 32 columns
    give 16 products); a B of twos doubles every sum (the kernel reads its operands from memory, not constants)."""
    words = mc.operands(torch.bfloat16)
    assert [w & 0xFFFFFFFF for w in words.tolist()] == [0x3F803F80] * 8 + [0x44444444]
    twos = words.clone()
    twos[4:8] = 0x40004000   # bf16 2.0 in both halves
    for sparse in (True, False):
        out = _run(sparse, chains=2, threads=32, iters=2, grid=1, words=twos)
        assert torch.equal(out, torch.full_like(out, 2 * mc.expected_sum(2, 2)))


def test_the_flops_of_each_mma():
    """The dense-equivalent flops the ceiling counts per MMA: m16n8k32 and m16n8k16."""
    assert mc.FLOPS == {True: 2 * 16 * 8 * 32, False: 2 * 16 * 8 * 16}


@pytest.mark.parametrize("sparse", [True, False])
def test_the_wgmma_text_names_each_accumulator_once(sparse):
    """The wgmma kernels (Hopper only: compiled by mma_ceiling.py --compile-only, run by gpu_run.sh mma_ceiling) get one
    instruction with the thread's 64 accumulators as operands 0-63, each tied to d[i], the descriptors after them,
    and the metadata only for the 2:4 one; each thread's expected sum counts 64 outputs of 16 a wgmma."""
    import re

    text = mc.wgmma_function(sparse)
    shape = "mma_async.sp.sync.aligned.m64n128k32" if sparse else "mma_async.sync.aligned.m64n128k16"
    assert text.count("wgmma.") == 1 and shape in text
    assert re.findall(r'"\+f"\(d\[(\d+)\]\)', text) == [str(i) for i in range(64)]
    assert "{" + ", ".join(f"%{i}" for i in range(64)) + "}, %64, %65" in text
    assert ('"r"(e)' in text) == sparse
    assert mc.wgmma_expected_sum(3) == 3 * mc.WG_GROUP * 64 * mc.PER_MMA
    assert mc.WG_FLOPS == {True: 2 * 64 * 128 * 32, False: 2 * 64 * 128 * 16}
    source = mc.ceiling_source(mc.kernel_defines(sparse, 8, 256, torch.bfloat16, True, wgmma=True))
    assert "#define WGMMA 1" in source and "sp_wgmma(float (&d)[64]" in source
