"""The sparse-MMA kernels' K loops, this tree's against an earlier commit's, on a machine without a GPU: NVRTC compiles
the decode (``kernels/nm_sparse_mma.cu``, the plans ``auto`` launches at 1–64 tokens, without a map, staging one and
reading it inline, in both layouts a layer holds) and the prompt GEMM (``kernels/nm_sparse_gemm.cu``, every tile of ``GEMM_TILES``, both layouts) for
sm_90 from both texts, and the table records each loop as one warp issues it (``check_sparse_mma_compile.loop_mix``:
instructions, sparse MMAs, instructions per MMA) beside registers and spills. Instructions a warp issues besides its
loads and MMAs take issue slots a memory-bound decode or an MMA-bound GEMM needs; a table, not a timing.

    python scripts/compare_loop_mix.py --before 6bd43f3 --nvrtc /tmp/nvrtc/nvidia/cu13/lib/libnvrtc.so.13
        → scripts/results/sparse_mma_loop_mix.json
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from check_sparse_mma_compile import loop_mix, nvrtc_path  # noqa: E402
from shuffleprune.kernels import nm_sparse_gemm as sg, nm_sparse_mma as sm  # noqa: E402
from shuffleprune.kernels import sparse_gemm_tiles as gemm_tiles, sparse_mma_tiles as tiles  # noqa: E402
from shuffleprune.kernels.compile_check import ptxas_report  # noqa: E402
from shuffleprune.kernels.cuda_rtc import Nvrtc, load_nvrtc  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096)]
TOKENS = [1, 2, 4, 8, 16, 32, 64]
SMS = 132   # an H100's (the plans' grid; the loop itself does not depend on it)


def compiled(nvrtc: Nvrtc, source: str) -> dict:
    ok, log, cubin = nvrtc.compile(source, "sm_90", report=True)
    if not ok:
        return {"compiled": False, "log": log[-1000:]}
    regs, spill = ptxas_report(log)
    return {"compiled": True, "registers": regs, "spill_bytes": spill, **loop_mix(cubin, 90)}


def table(nvrtc: Nvrtc, kernels: Path) -> list[dict]:
    """Every variant's row, compiled from the ``.cu`` texts in ``kernels`` (this tree's shared header either way)."""
    rows = []
    for tiled in (True, False):   # the layer's buffer in cuSPARSELt's order, or the export's row words
        for shape in SHAPES:
            for tokens in TOKENS:
                for mapped, inline in ((False, False), (True, False), (True, True)):
                    if mapped and tokens > tiles.MAPPED_MAX_TOKENS:
                        continue
                    plan = tiles.sparse_mma_plan(tokens, *shape, SMS, mapped=mapped,
                                              **({"inline_map": True} if inline else {}))
                    defines = sm.kernel_defines(plan, torch.bfloat16, tiled, False, True, mapped, False)
                    rows.append({"kernel": "decode", "shape": list(shape), "tokens": tokens, "tiled": tiled,
                                 "map": "inline" if inline else "staged" if mapped else None,
                                 "plan": tiles.plan_fields(plan),
                                 **compiled(nvrtc, sm.kernel_source(defines, source=kernels / "nm_sparse_mma.cu"))})
    for tile in gemm_tiles.GEMM_TILES:
        for tiled in (True, False):
            plan = gemm_tiles.SparseGemmPlan(*tile, stages=3)
            defines = sg.kernel_defines(plan, torch.bfloat16, tiled, False, True)
            rows.append({"kernel": "gemm", "tile": [plan.bm, plan.bn], "plan": gemm_tiles.plan_fields(plan), "tiled": tiled,
                         **compiled(nvrtc, sm.kernel_source(defines, source=kernels / "nm_sparse_gemm.cu"))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit whose kernel texts to compare against")
    ap.add_argument("--nvrtc", help="path of libnvrtc.so (default: the nvidia-cuda-nvrtc wheel's)")
    ap.add_argument("--out", default=str(ROOT / "scripts/results/sparse_mma_loop_mix.json"))
    args = ap.parse_args()
    nvrtc = load_nvrtc(nvrtc_path(args.nvrtc))
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("nm_sparse_mma.cu", "nm_sparse_gemm.cu"):
            text = subprocess.run(["git", "show", f"{args.before}:kernels/{name}"], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout
            (Path(tmp) / name).write_text(text)
        before = table(nvrtc, Path(tmp))
    after = table(nvrtc, ROOT / "kernels")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out = {"what": "the sparse-MMA kernels' K loops compiled for sm_90 by NVRTC (not run): instructions one warp issues "
                   "a pass, sparse MMAs, per MMA, registers and spills; before = the kernel texts of --before, after = "
                   "this tree's",
           "command": "python scripts/compare_loop_mix.py " + " ".join(sys.argv[1:]), "before": args.before,
           "after": f"{head.strip()} (+ the working tree)",
           "versions": {"python": platform.python_version(), "torch": torch.__version__, "nvrtc": nvrtc.version()},
           "rows": [{"before": b, "after": a} for b, a in zip(before, after)]}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for b, a in zip(before, after):
        layout = "tiled" if b["tiled"] else "rows"
        what = (f"decode {layout} {b['shape'][0]}x{b['shape'][1]} {b['tokens']:>2} tok {b['map'] or '':6}"
                if b["kernel"] == "decode" else f"gemm {b['tile'][0]}x{b['tile'][1]} {layout}")
        print(f"{what:38} loop {b.get('instructions')} -> {a.get('instructions')}  per MMA {b.get('per_mma')} -> "
              f"{a.get('per_mma')}  regs {b.get('registers')} -> {a.get('registers')}  spill {b.get('spill_bytes')} -> "
              f"{a.get('spill_bytes')}")


if __name__ == "__main__":
    main()
