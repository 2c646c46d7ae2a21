"""The tensor cores' ceiling through ``mma.sp`` (the 2:4 MMA of ``kernels/nm_sparse_mma.cu`` and
``nm_sparse_gemm.cu``) and the dense ``mma``, and on Hopper through its own ``wgmma`` (2:4 and dense):
``scripts/mma_ceiling.cu`` issues nothing but MMAs, on every SM, and this times it (CUDA events) and checks each
thread's sum, so the flops it reports were all done. Against cuBLAS's own rate at 512–2048 tokens
(``tune_sparse_gemm.py`` records both) it says what a 2:4 GEMM can reach at best on this GPU: on Hopper cuBLAS runs
``wgmma``, which the older ``mma`` does not match, so a GEMM on ``mma.sp`` beats cuBLAS only if ``mma.sp``'s
dense-equivalent rate stands above cuBLAS's; ``wgmma.sp``'s says what a GEMM written on it could.

    python scripts/mma_ceiling.py            # → scripts/results/mma_ceiling.json (a GPU; gpu_run.sh mma_ceiling)
    python scripts/mma_ceiling.py --compile-only --nvrtc PATH   # no GPU: registers and machine code of each kernel
                                                                # → scripts/results/mma_ceiling_compile.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("mma_ceiling.cu")
KERNEL_NAME = "mma_ceiling"
FLOPS = {True: 2 * 16 * 8 * 32, False: 2 * 16 * 8 * 16}   # dense-equivalent flops of one mma.sp m16n8k32 / mma m16n8k16
ONE = {torch.bfloat16: 0x3F80, torch.float16: 0x3C00}     # 1.0 in each 16-bit type
META_01 = 0x44444444   # every group of 4 keeps positions 0 and 1 (code 0b0100), in both halves of the word
PER_MMA = 16           # each output of an MMA on all-ones operands: 16 products of 1 × 1 (every kind here)
WG_N, WG_GROUP, WG_THREADS, WG_SMEM_BYTES = 128, 4, 256, 32768   # wgmma m64n128, 4 a commit group, 2 warpgroups a CTA
WG_FLOPS = {True: 2 * 64 * WG_N * 32, False: 2 * 64 * WG_N * 16}  # dense-equivalent flops of one wgmma (.sp k32 / k16)
WG_ACCUMULATORS = 64 * WG_N // 128                               # f32 outputs a thread holds

# the dense MMA for the GPU (the emulator defines its own)
DENSE_MMA = r"""
SP_DEV void sp_mma_dense(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[4]) {   // b[0], b[1]: m16n8k16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." SP_TYPE "." SP_TYPE ".f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"""


def kernel_defines(sparse: bool, chains: int, threads: int, dtype: torch.dtype, ordered: bool,
                   wgmma: bool = False) -> dict:
    return {"SPARSE": int(sparse), "CHAINS": chains, "THREADS": WG_THREADS if wgmma else threads,
            "IS_BF16": int(dtype == torch.bfloat16), "ORDERED": int(ordered), "WGMMA": int(wgmma),
            "GROUP": WG_GROUP, "WG_SMEM_BYTES": WG_SMEM_BYTES}


def wgmma_function(sparse: bool) -> str:
    """``sp_wgmma(d, a_desc, b_desc, e)``: one ``wgmma.mma_async`` (``.sp`` m64n128k32, or dense m64n128k16) of bf16
    into a thread's 64 fp32 accumulators, A and B through shared-memory descriptors, as inline PTX (the kernel's own
    instruction text, ``nm_sparse_gemm.wgmma_asm``)."""
    from shuffleprune.kernels.nm_sparse_gemm import wgmma_asm

    return (f"__device__ __forceinline__ void sp_wgmma(float (&d)[{WG_ACCUMULATORS}], unsigned long long a, "
            f"unsigned long long b, unsigned e) {{\n  (void)e;\n"
            + wgmma_asm(WG_N, [f"d[{i}]" for i in range(WG_ACCUMULATORS)], sparse, "bf16") + "}\n")


def ceiling_source(defines: dict, prelude: str | None = None) -> str:
    """One variant's full text: its defines, the prelude (the GPU's with :data:`DENSE_MMA`, and the wgmma function
    where ``WGMMA``, by default; the tests pass the emulator's), then ``mma_ceiling.cu``."""
    from shuffleprune.kernels.nm_sparse_mma import DEVICE_PRELUDE

    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    if prelude is None:
        prelude = DEVICE_PRELUDE + DENSE_MMA + (wgmma_function(bool(defines["SPARSE"])) if defines["WGMMA"] else "")
    return head + prelude + SOURCE.read_text()


def operands(dtype: torch.dtype) -> torch.Tensor:
    """The nine 32-bit words every lane loads: A's four and B's four registers of 16-bit ones, then the metadata."""
    one = ONE[dtype] * 0x10001
    return torch.tensor([one] * 8 + [META_01], dtype=torch.int64).to(torch.int32)


def expected_sum(iters: int, chains: int) -> float:
    """Each thread's output: its ``4 × chains`` accumulators after ``iters`` rounds of MMAs on all-ones operands."""
    return float(4 * chains * PER_MMA * iters)


def wgmma_expected_sum(iters: int) -> float:
    """Each thread's output of the wgmma kernel: its 64 accumulators after ``iters`` groups of ``WG_GROUP``."""
    return float(WG_ACCUMULATORS * PER_MMA * WG_GROUP * iters)


KINDS = {   # name: (sparse, wgmma)
    "mma_sp_m16n8k32": (True, False), "mma_m16n8k16": (False, False),
    "wgmma_sp_m64n128k32": (True, True), "wgmma_m64n128k16": (False, True)}


def measure(device: torch.device, chains: int = 8, threads: int = 256, iters: int = 4096, reps: int = 5,
            wgmma: bool | None = None) -> dict:
    """Each MMA's dense-equivalent TFLOPS on ``device`` (a CUDA GPU; ``wgmma``: also Hopper's, by default where the
    GPU is compute capability 9.0), each on as many CTAs as the SMs hold at once, the median of ``reps`` timed launches
    after one untimed, every thread's sum checked."""
    from shuffleprune.kernels.cuda_rtc import KernelLaunch, compile_cuda, driver, resident_ctas
    from shuffleprune.kernels.gpu import _capability
    from shuffleprune.kernels.nm_sparse_mma import device_index, ordered_metadata, stream_handle

    index = device_index(device)
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    if wgmma is None:
        wgmma = _capability(index) == (9, 0)
    dtype = torch.bfloat16
    inp = operands(dtype).to(device)
    out = {"chains": chains, "threads": threads, "iters": iters, "dtype": "bfloat16", "sms": sms,
           "wgmma": {"n": WG_N, "group": WG_GROUP, "threads": WG_THREADS, "iters": iters // 8} if wgmma else None}
    for kind, (sparse, wg) in KINDS.items():
        if wg and not wgmma:
            continue
        try:
            defines = kernel_defines(sparse, chains, threads, dtype, ordered_metadata(), wgmma=wg)
            name = "wgmma_ceiling" if wg else KERNEL_NAME
            kernel = compile_cuda(ceiling_source(defines), name, index, arch_specific=wg)   # wgmma: sm_90a
            block, shared = defines["THREADS"], WG_SMEM_BYTES if wg else 0
            per_sm = resident_ctas(kernel, block, shared) or 1
            grid = sms * per_sm
            n_iters = iters // 8 if wg else iters   # a wgmma is 64 mma's worth of work: about as long a launch
            y = torch.empty(grid * block, device=device, dtype=torch.float32)
            launch = KernelLaunch(kernel, (grid, 1, 1), (block, 1, 1), shared, driver(), 2, 1)
            times = []
            for rep in range(reps + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch([inp, y], [n_iters], stream_handle(device))
                end.record()
                torch.cuda.synchronize(device)
                if rep:
                    times.append(start.elapsed_time(end))
            ms = sorted(times)[len(times) // 2]
            want = wgmma_expected_sum(n_iters) if wg else expected_sum(n_iters, chains)
            wrong = int((y != want).sum())
            mmas = grid * (block // 128 * n_iters * WG_GROUP if wg else block // 32 * n_iters * chains)
            flops = WG_FLOPS[sparse] if wg else FLOPS[sparse]
            out[kind] = {"ms": ms, "ctas_per_sm": per_sm, "mmas": mmas, "wrong_sums": wrong,
                         "tflops_dense_equiv": None if wrong else mmas * flops / ms / 1e9}
        except Exception as exc:  # noqa: BLE001 - recorded: a ceiling that did not compile or run says so
            out[kind] = {"error": str(exc).splitlines()[0][:200]}
    rate = {k: (out.get(k) or {}).get("tflops_dense_equiv") for k in KINDS}
    out["sparse_over_dense_mma"] = (rate["mma_sp_m16n8k32"] / rate["mma_m16n8k16"]
                                    if rate["mma_sp_m16n8k32"] and rate["mma_m16n8k16"] else None)
    out["mma_sp_over_wgmma"] = (rate["mma_sp_m16n8k32"] / rate["wgmma_m64n128k16"]
                                if rate["mma_sp_m16n8k32"] and rate["wgmma_m64n128k16"] else None)
    out["wgmma_sp_over_wgmma"] = (rate["wgmma_sp_m64n128k32"] / rate["wgmma_m64n128k16"]
                                  if rate["wgmma_sp_m64n128k32"] and rate["wgmma_m64n128k16"] else None)
    return out


def compile_table(nvrtc_path: str) -> dict:
    """Each kernel compiled by NVRTC as a GPU would take it (the mma ones for sm_90 and sm_80, the wgmma ones for
    sm_90a): registers, spills, and its MMA instructions in the machine code (``nvdisasm``), with no GPU."""
    from shuffleprune.kernels.compile_check import disassemble, main_loop, ptxas_report
    from shuffleprune.kernels.cuda_rtc import load_nvrtc

    nvrtc = load_nvrtc(nvrtc_path)
    rows = []
    for kind, (sparse, wg) in KINDS.items():
        for arch in (["sm_90a"] if wg else ["sm_90", "sm_80"]):
            ok, log, cubin = nvrtc.compile(ceiling_source(kernel_defines(sparse, 8, 256, torch.bfloat16, True, wg)),
                                           arch, report=True)
            row = {"kind": kind, "arch": arch, "compiled": ok}
            if ok:
                loop = main_loop(disassemble(cubin, int(arch[3:5])), holding="MMA")
                regs, spill = ptxas_report(log)
                row.update(registers=regs, spill_bytes=spill, loop_instructions=len(loop),
                           mma_instructions=sorted({re.sub(r"\s.*", "", i) for i in loop if "MMA" in i}),
                           mmas_in_loop=sum("MMA" in i for i in loop))
            else:
                row["log"] = log[-1000:]
            rows.append(row)
    return {"nvrtc": nvrtc.version(), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true", help="no GPU: compile each kernel and read its machine code")
    ap.add_argument("--nvrtc", help="--compile-only: path of libnvrtc.so (default: the nvidia-cuda-nvrtc wheel's)")
    ap.add_argument("--out", help="the results file (default scripts/results/mma_ceiling.json, or _compile.json)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_cases import run_facts

    results = Path(__file__).resolve().parent / "results"
    if args.compile_only:
        from check_sparse_mma_compile import nvrtc_path

        table = compile_table(nvrtc_path(args.nvrtc))
        out = Path(args.out or results / "mma_ceiling_compile.json")
        from shuffleprune.runtime.facts import machine, versions

        out.write_text(json.dumps({"what": "the MMA-ceiling kernels compiled by NVRTC, not run", "device": None,
                                   "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
                                   "versions": versions("triton"), **table}, indent=1) + "\n")
        for row in table["rows"]:
            print(row["kind"], row["arch"], row.get("registers"), row.get("mmas_in_loop"), row.get("mma_instructions"),
                  row.get("log", "")[-300:])
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the ceiling is a GPU measurement (--compile-only checks the kernels here, "
                         "tests/test_mma_ceiling.py runs the mma ones on the CPU)")
    result = measure(torch.device("cuda"))
    out = Path(args.out or results / "mma_ceiling.json")
    out.write_text(json.dumps({"what": "the tensor cores' rate through each MMA alone (bf16 ones, fp32 sums, every "
                                       "thread's sum checked; dense-equivalent TFLOPS)", **run_facts(False, True),
                               **result}, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
