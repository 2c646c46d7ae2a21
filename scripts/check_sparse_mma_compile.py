"""Compile the sparse-tensor-core decode (``kernels/nm_sparse_mma.cu``) and prompt GEMM
(``kernels/nm_sparse_gemm.cu``) for Hopper and Ampere on a machine without a GPU: NVRTC (the ``nvidia-cuda-nvrtc``
wheel's library, or ``--nvrtc PATH``) builds each variant the runtime would launch for issue 24's shapes and token counts, and the table records what ptxas reports
(registers, spills, shared memory), the CTAs per SM those allow (``kernels/compile_check.py``'s figures of an
H100 and an A100), and from the machine code (``nvdisasm``, Triton's) the sparse MMAs and loads the kernel holds.

    pip install --target /tmp/nvrtc nvidia-cuda-nvrtc
    python scripts/check_sparse_mma_compile.py --nvrtc /tmp/nvrtc/nvidia/cu13/lib/libnvrtc.so.13
        → scripts/results/sparse_mma_compile.json (sm_90 and sm_80)

No timing and no run: ``scripts/gpu_run.sh sparse_mma`` times it on a GPU.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shuffleprune.kernels import nm_sparse_gemm as sg, nm_sparse_mma as sm  # noqa: E402
from shuffleprune.kernels import sparse_gemm_tiles as gemm_tiles, sparse_mma_tiles as tiles  # noqa: E402
from shuffleprune.kernels.compile_check import (A100, H100, disassemble, main_loop, ptxas_report,  # noqa: E402
                                                 resident_programs)
from shuffleprune.kernels.cuda_rtc import find_nvrtc, load_nvrtc  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from kernel_cases import sparse_mma_variants, wgmma_gemm_forms  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1024, 4096)]
TOKENS = [1, 2, 4, 8, 16, 32, 64]
GPUS = {"sm_90": H100, "sm_80": A100}   # kernels/compile_check.py's figures of each GPU


def nvrtc_path(given: str | None) -> str:
    """The NVRTC library to load: ``given``, else an installed ``nvidia-cuda-nvrtc`` wheel's."""
    found = given or find_nvrtc()
    if not found:
        raise SystemExit("no NVRTC library found: pip install nvidia-cuda-nvrtc, or pass --nvrtc PATH")
    return found


def sass_counts(cubin: bytes, arch: int) -> dict:
    """Instructions of the kernel's machine code: all, sparse MMAs, 16/8/4-byte global loads, moves, L2 prefetches,
    asynchronous copies, shared-memory loads, and for a programmatic dependent the loads before its grid wait."""
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]+);", disassemble(cubin, arch))
    ops = [re.sub(r"^@!?P\d\s+", "", i).split()[0] for i in ins]
    wait = ops.index("ACQBULK") if "ACQBULK" in ops else None   # griddepcontrol.wait (a programmatic dependent)
    return {"instructions": len(ins),
            "loads_before_wait": None if wait is None else [o for o in ops[:wait] if o.startswith("LDG")],
            "release_after_wait": None if wait is None else "PREEXIT" in ops[wait:],
            "mma_sp": sum("HMMA.SP" in i for i in ins),
            "ldg_128": sum(bool(re.search(r"LDG\.[\w.]*128", i)) for i in ins),
            "ldg_64": sum(bool(re.search(r"LDG\.[\w.]*64", i)) for i in ins),
            "ldg_32": sum(o.startswith("LDG") and not o.startswith(("LDGSTS", "LDGDEPBAR")) and
                          not re.search(r"LDG\.[\w.]*(128|64)", i) for o, i in zip(ops, ins)),
            "moves": sum(bool(re.match(r"(@!?P\d\s+)?(IMAD\.)?MOV", i)) for i in ins),
            "l2_prefetches": ops.count("CCTL.E.PF2"),            # prefetch.global.L2 (``prefetch`` plans)
            "async_copies": sum(o.startswith("LDGSTS") for o in ops),   # cp.async (the ring of ``stage`` plans)
            "shared_loads": sum(o.startswith("LDS") for o in ops),
            "ldmatrix": sum(o.startswith("LDSM") for o in ops)}   # the prompt GEMM's fragment loads


def loop_mix(cubin: bytes, arch: int, mma: str = "HMMA.SP") -> dict:
    """A kernel's K loop as one warp issues it (the prompt GEMM's: a stage of 64 columns, under ``wgmma`` two; the
    decode's: its unrolled steps of 128): its instructions, sparse MMAs (``mma``: their machine instruction, Hopper's
    ``HGMMA`` for wgmma), ``ldmatrix`` and asynchronous copies, and the instructions issued per MMA (the MMA itself
    included). In the GEMM, where that stands far above 1, the warp schedulers and not the tensor cores set the pace
    (a wgmma is 16 times an mma.sp's work); in the decode, every instruction besides its loads takes issue slots from
    them."""
    loop = main_loop(disassemble(cubin, arch), holding=mma)
    mmas = sum(mma in i for i in loop)
    return {"instructions": len(loop), "mma_sp": mmas, "ldmatrix": sum(i.startswith("LDSM") for i in loop),
            "async_copies": sum(i.lstrip("@!P0123456 ").startswith("LDGSTS") for i in loop),
            "per_mma": round(len(loop) / mmas, 2) if mmas else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvrtc", help="path of libnvrtc.so (default: the nvidia-cuda-nvrtc wheel's)")
    ap.add_argument("--arch", nargs="+", default=["sm_90", "sm_80"])
    ap.add_argument("--out", default=str(ROOT / "scripts/results/sparse_mma_compile.json"))
    args = ap.parse_args()
    nvrtc = load_nvrtc(nvrtc_path(args.nvrtc))
    rows, seen = [], {}
    t0 = time.time()
    cases = [(arch, v) for arch in args.arch   # programmatic dependents at 1 and 16 tokens, on Hopper only
             for v in sparse_mma_variants(SHAPES, TOKENS, GPUS[arch].sms, (1, 16) if arch == "sm_90" else ())]
    for arch, v in cases:
        gpu, plan = GPUS[arch], v["plan"]
        shape, tokens, mapped, pdl, tall, inline = (v[k] for k in ("shape", "tokens", "mapped", "pdl", "tall", "inline"))
        for tiled in (False, True):
            defines = sm.kernel_defines(plan, torch.bfloat16, tiled, False, True, mapped, pdl)
            key = (arch, tuple(defines.items()))
            if key not in seen:
                ok, log, cubin = nvrtc.compile(sm.kernel_source(defines), arch, report=True)
                regs, spill = ptxas_report(log)
                smem = re.search(r"(\d+) bytes smem", log)
                seen[key] = {"compiled": ok, "registers": regs, "spill_bytes": spill if ok else None,
                             "shared_bytes": int(smem.group(1)) if smem else None,
                             "sass": sass_counts(cubin, gpu.arch) if ok else None,
                             "main_loop": loop_mix(cubin, gpu.arch) if ok else None,
                             "log": None if ok else log[-2000:]}
            info = dict(seen[key])
            ctas = 0   # a variant NVRTC refused: none (its log kept)
            if info["compiled"]:
                ctas = resident_programs(gpu, info["registers"], plan.warps,
                                         info["shared_bytes"] + plan.dynamic_shared(tokens, mapped))
            grid = plan.grid(shape[0])
            rows.append({"arch": arch, "shape": list(shape), "tokens": tokens, "tiled": tiled, "mapped": mapped,
                         "pdl": pdl, "tall": tall, "inline": inline, "plan": tiles.plan_fields(plan), "grid": list(grid[:2]), "threads": 32 * plan.warps,
                         **info, "ctas_per_sm": ctas, "warps_per_sm": ctas * plan.warps,
                         "waves": round(grid[0] * grid[1] / max(1, ctas * gpu.sms), 2)})
    gemm_rows = []   # the prompt GEMM (kernels/nm_sparse_gemm.cu): every tile with 3 and 4 stages, both layouts
    for arch, tile, stages, tiled in itertools.product(args.arch, gemm_tiles.GEMM_TILES, (3, 4), (False, True)):
        gpu, plan = GPUS[arch], gemm_tiles.SparseGemmPlan(*tile, stages=stages)
        defines = sg.kernel_defines(plan, torch.bfloat16, tiled, False, True)
        ok, log, cubin = nvrtc.compile(sg.kernel_source(defines), arch, report=True)
        regs, spill = ptxas_report(log)
        seen[(arch, "gemm", tuple(defines.items()))] = info = {
            "compiled": ok, "registers": regs, "spill_bytes": spill if ok else None,
            "sass": sass_counts(cubin, gpu.arch) if ok else None, "log": None if ok else log[-2000:],
            "main_loop": loop_mix(cubin, gpu.arch) if ok else None}
        fits = plan.dynamic_shared() <= gpu.smem_per_block
        ctas = resident_programs(gpu, info["registers"], plan.warps, plan.dynamic_shared()) if ok and fits else 0
        gemm_rows.append({"arch": arch, "tiled": tiled, "plan": gemm_tiles.plan_fields(plan), "bm": plan.bm, "bn": plan.bn,
                          "threads": 32 * plan.warps, "dynamic_shared": plan.dynamic_shared(), **info,
                          "ctas_per_sm": ctas, "warps_per_sm": ctas * plan.warps,
                          # shared-memory bytes a warp reads per MMA: its A and B fragments of one k32 step
                          "shared_bytes_per_mma": round(512 * (plan.mt + plan.nt) / (plan.mt * plan.nt))})
    # the wgmma form (Hopper only, sm_90a): every wgmma tile (its decode's too) with 4 and 5 stages, both layouts.
    # ptxas says where it had to wait on a wgmma it could not prove safe to run on ("serialized"): the advisories
    # the mapped decode's tiles (8 and 16 tokens) too, their staged input that of 4096 columns in 8 splits
    for (tile, mapped), stages, tiled in itertools.product(wgmma_gemm_forms(), (4, 5), (False, True)):
        if "sm_90" not in args.arch:
            break
        gpu, plan = H100, gemm_tiles.SparseGemmPlan(*tile, stages=stages, splits=8, wgmma=True, mapped=mapped)
        defines = sg.kernel_defines(plan, torch.bfloat16, tiled, False, True)
        ok, log, cubin = nvrtc.compile(sg.kernel_source(defines), "sm_90a", report=True)
        regs, spill = ptxas_report(log)
        seen[("sm_90a", "gemm", tuple(defines.items()))] = info = {
            "compiled": ok, "registers": regs, "spill_bytes": spill if ok else None,
            "sass": sass_counts(cubin, gpu.arch) if ok else None, "log": None if ok else log[-2000:],
            "main_loop": loop_mix(cubin, gpu.arch, "HGMMA") if ok else None,
            "hgmma": len(re.findall(r"HGMMA", disassemble(cubin, gpu.arch))) if ok else None,
            "wgmma_advisories": [line.strip() for line in log.splitlines() if "wgmma" in line.lower()]}
        shared = plan.dynamic_shared(4096)
        fits = shared <= gpu.smem_per_block
        ctas = resident_programs(gpu, info["registers"], plan.warps, shared) if ok and fits else 0
        gemm_rows.append({"arch": "sm_90a", "tiled": tiled, "plan": gemm_tiles.plan_fields(plan), "bm": plan.bm,
                          "bn": plan.bn, "threads": 32 * plan.warps, "dynamic_shared": shared, **info,
                          "ctas_per_sm": ctas, "warps_per_sm": ctas * plan.warps, "shared_bytes_per_mma": None})
    versions = {"python": platform.python_version(), "torch": torch.__version__, "nvrtc": nvrtc.version()}
    out = {"what": "the sparse-tensor-core decode (kernels/nm_sparse_mma.cu; rows) and prompt GEMM "
                   "(kernels/nm_sparse_gemm.cu; gemm_rows) compiled by NVRTC, not run",
           "command": "python scripts/check_sparse_mma_compile.py " + " ".join(sys.argv[1:]),
           "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "gpu": None},
           "versions": versions, "seconds": round(time.time() - t0, 1),
           "variants": len(seen), "failed": sum(not v["compiled"] for v in seen.values()),
           "spilling": sum(bool(v["spill_bytes"]) for v in seen.values()), "rows": rows, "gemm_rows": gemm_rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(seen)} variants, {out['failed']} failed, {out['spilling']} spilling → {args.out}")
    for r in rows:
        if r["arch"] == "sm_90" and r["shape"] == [4096, 4096] and r["tiled"]:
            print(r["tokens"], "mapped" if r["mapped"] else "", "pdl" if r["pdl"] else "", r["plan"],
                  "regs", r["registers"], "spill", r["spill_bytes"], "ctas/SM", r["ctas_per_sm"],
                  "warps/SM", r["warps_per_sm"], "waves", r["waves"], r["sass"], r["main_loop"])
    for r in gemm_rows:
        if r["arch"] in ("sm_90", "sm_90a") and r["tiled"]:
            print("gemm", r["bm"], "x", r["bn"], r["plan"], "regs", r["registers"], "spill", r["spill_bytes"],
                  "ctas/SM", r["ctas_per_sm"], "warps/SM", r["warps_per_sm"], r["sass"], r["main_loop"])


if __name__ == "__main__":
    main()
