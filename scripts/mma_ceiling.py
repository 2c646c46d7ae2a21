"""The tensor cores' ceiling through ``mma.sp`` (the 2:4 MMA of ``kernels/nm_sparse_mma.cu`` and
``nm_sparse_gemm.cu``) and the dense ``mma``: ``scripts/mma_ceiling.cu`` issues nothing but MMAs on operands held in
registers, on every SM, and this times it (CUDA events) and checks each thread's sum, so the flops it reports were all
done. Against cuBLAS's own rate at 512–2048 tokens (``tune_sparse_gemm.py`` records both) it says what the prompt
GEMM on ``mma.sp`` can reach at best on this GPU: on Hopper cuBLAS runs ``wgmma``, which the older ``mma`` does not
match, so a 2:4 GEMM on ``mma.sp`` beats cuBLAS only if ``mma.sp``'s dense-equivalent rate stands above cuBLAS's.

    python scripts/mma_ceiling.py            # prints the JSON (tune_sparse_gemm.py stores it as "ceiling")
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("mma_ceiling.cu")
KERNEL_NAME = "mma_ceiling"
FLOPS = {True: 2 * 16 * 8 * 32, False: 2 * 16 * 8 * 16}   # dense-equivalent flops of one mma.sp m16n8k32 / mma m16n8k16
ONE = {torch.bfloat16: 0x3F80, torch.float16: 0x3C00}     # 1.0 in each 16-bit type
META_01 = 0x44444444   # every group of 4 keeps positions 0 and 1 (code 0b0100), in both halves of the word
PER_MMA = 16           # each output of an MMA on all-ones operands: 16 products of 1 × 1 (both kinds of MMA)

# the dense MMA for the GPU (the emulator defines its own)
DENSE_MMA = r"""
SP_DEV void sp_mma_dense(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[4]) {   // b[0], b[1]: m16n8k16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." SP_TYPE "." SP_TYPE ".f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"""


def kernel_defines(sparse: bool, chains: int, threads: int, dtype: torch.dtype, ordered: bool) -> dict:
    return {"SPARSE": int(sparse), "CHAINS": chains, "THREADS": threads, "IS_BF16": int(dtype == torch.bfloat16),
            "ORDERED": int(ordered)}


def ceiling_source(defines: dict, prelude: str | None = None) -> str:
    """One variant's full text: its defines, the prelude (the GPU's with :data:`DENSE_MMA` by default; the tests pass
    the emulator's), then ``mma_ceiling.cu``."""
    from shuffleprune.kernels.nm_sparse_mma import DEVICE_PRELUDE

    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + (DEVICE_PRELUDE + DENSE_MMA if prelude is None else prelude) + SOURCE.read_text()


def operands(dtype: torch.dtype) -> torch.Tensor:
    """The nine 32-bit words every lane loads: A's four and B's four registers of 16-bit ones, then the metadata."""
    one = ONE[dtype] * 0x10001
    return torch.tensor([one] * 8 + [META_01], dtype=torch.int64).to(torch.int32)


def expected_sum(iters: int, chains: int) -> float:
    """Each thread's output: its ``4 × chains`` accumulators after ``iters`` rounds of MMAs on all-ones operands."""
    return float(4 * chains * PER_MMA * iters)


def measure(device: torch.device, chains: int = 8, threads: int = 256, iters: int = 4096, reps: int = 5) -> dict:
    """Both MMAs' dense-equivalent TFLOPS on ``device`` (a CUDA GPU), each on as many CTAs as the SMs hold at once,
    the median of ``reps`` timed launches after one untimed, every thread's sum checked."""
    from shuffleprune.kernels.cuda_rtc import KernelLaunch, compile_cuda, driver, resident_ctas
    from shuffleprune.kernels.nm_sparse_mma import device_index, ordered_metadata, stream_handle

    index = device_index(device)
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    dtype = torch.bfloat16
    inp = operands(dtype).to(device)
    out = {"chains": chains, "threads": threads, "iters": iters, "dtype": "bfloat16", "sms": sms}
    for sparse in (True, False):
        kind = "mma_sp_m16n8k32" if sparse else "mma_m16n8k16"
        try:
            kernel = compile_cuda(ceiling_source(kernel_defines(sparse, chains, threads, dtype, ordered_metadata())),
                                  KERNEL_NAME, index)
            per_sm = resident_ctas(kernel, threads) or 1
            grid = sms * per_sm
            y = torch.empty(grid * threads, device=device, dtype=torch.float32)
            launch = KernelLaunch(kernel, (grid, 1, 1), (threads, 1, 1), 0, driver(), 2, 1)
            times = []
            for rep in range(reps + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch([inp, y], [iters], stream_handle(device))
                end.record()
                torch.cuda.synchronize(device)
                if rep:
                    times.append(start.elapsed_time(end))
            ms = sorted(times)[len(times) // 2]
            wrong = int((y != expected_sum(iters, chains)).sum())
            mmas = grid * threads // 32 * iters * chains
            out[kind] = {"ms": ms, "ctas_per_sm": per_sm, "mmas": mmas, "wrong_sums": wrong,
                         "tflops_dense_equiv": None if wrong else mmas * FLOPS[sparse] / ms / 1e9}
        except Exception as exc:  # noqa: BLE001 - recorded: a ceiling that did not compile or run says so
            out[kind] = {"error": str(exc).splitlines()[0][:200]}
    sp, dn = (out[k].get("tflops_dense_equiv") for k in ("mma_sp_m16n8k32", "mma_m16n8k16"))
    out["sparse_over_dense_mma"] = sp / dn if sp and dn else None
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the ceiling is a GPU measurement (tests/test_mma_ceiling.py checks the "
                         "kernel on the CPU)")
    print(json.dumps(measure(torch.device("cuda")), indent=1))


if __name__ == "__main__":
    main()
