"""The sparse-tensor-core kernels the GPU steps after ``sparse_mma`` and ``sparse_gemm`` leave out, read off those
steps' results (``tune_sparse_mma.json``, ``tune_sparse_gemm.json``) and hung markers (``kernel_cases.hung_marker``):

- a kernel whose check launch never finished (the marker names it): its policies; a hang in the decode leaves out
  every sparse-MMA decode, in the prompt GEMM that form (mma.sp, or wgmma with its mapped decode);
- the sparse-MMA decode where the probe found no reading of the fragments right, and every launch it checked was
  refused: the decodes, and the mma.sp GEMM (the same fragments);
- a prompt-GEMM form (mma.sp, wgmma, wgmma reading a map) with checked launches and none right: that form (the
  wgmma one with its mapped decode, unless that was checked right itself: the same text reads both);
- the same, read off the outputs the timed CUDA graphs left (``replayed_rel_err``): a decode, or a GEMM form, right
  in its one checked call but wrong in every timed graph (calls reusing the split-K counters, or overlapping).

``auto`` checks each candidate's output before timing it, so a wrong kernel never serves, but it costs each layer a
compile and a launch, and the kernel table times it anyway; a hung one would take the step's whole limit.

    python scripts/leave_out.py --since T    # prints the names, comma-separated (empty: none); the reasons on stderr;
                                             # files older than T (seconds since the epoch: the call's start) unread
    python scripts/leave_out.py --smoke      # the CPU smoke runs' files (…_smoke.json)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from kernel_cases import REFUSED_REL_ERR, hung_marker  # noqa: E402

from shuffleprune.deploy.impls import (SPARSE_GEMM, SPARSE_MMA_DECODES, SPARSE_WGMMA,  # noqa: E402
                                       SPARSE_WGMMA_MAPPED)


def gemm_policy(plan: dict) -> str:
    """The policy that runs a prompt-GEMM plan's form: mma.sp, wgmma, or the wgmma decode reading a map."""
    if plan.get("wgmma"):
        return SPARSE_WGMMA_MAPPED if plan.get("mapped") else SPARSE_WGMMA
    return SPARSE_GEMM


def gemm_policies(plan: dict) -> tuple[str, ...]:
    """The policies a hang of a prompt-GEMM plan's form leaves out (a wgmma plan's mapped decode shares its text)."""
    name = gemm_policy(plan)
    return (SPARSE_WGMMA, SPARSE_WGMMA_MAPPED) if name == SPARSE_WGMMA else (name,)


def _read(path: Path, since: float) -> dict | None:
    try:
        if path.stat().st_mtime < since:   # an earlier call's
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def left_out(results: Path, since: float = 0.0, tag: str = "") -> dict[str, str]:
    """``{policy: why}`` from the two steps' files under ``results`` (``tag``: ``"_smoke"`` for the CPU smoke
    runs'), written at ``since`` or later."""
    out: dict[str, str] = {}
    decode, gemm = results / f"tune_sparse_mma{tag}.json", results / f"tune_sparse_gemm{tag}.json"
    for path in (decode, gemm):
        hung = _read(hung_marker(path), since)
        if hung is None:
            continue
        names = SPARSE_MMA_DECODES if hung.get("kernel") == "sparse_mma" else gemm_policies(hung.get("plan", {}))
        for name in names:
            out.setdefault(name, f"a launch hung in {path.stem} ({json.dumps(hung)[:160]})")
    found = _read(decode, since)
    if found:
        rows = [r for r in found.get("rows", []) if r.get("impl", "").startswith("sparse_mma")]
        checked = [r for r in rows if "rel_err" in r]
        probed_wrong = found.get("probe") and found.get("reading") is None
        if probed_wrong and not any(r["rel_err"] < REFUSED_REL_ERR for r in checked):
            for name in (*SPARSE_MMA_DECODES, SPARSE_GEMM):
                out.setdefault(name, "no reading of the sparse MMA's fragments was right (tune_sparse_mma probe)")
        replayed = [r["replayed_rel_err"] for r in rows if r.get("replayed_rel_err") is not None]
        if replayed and min(replayed) >= REFUSED_REL_ERR:
            for name in SPARSE_MMA_DECODES:
                out.setdefault(name, f"wrong as replayed in all {len(replayed)} timed CUDA graphs (least error "
                                     f"{min(replayed):.2g}, tune_sparse_mma)")
    found = _read(gemm, since)
    if found:
        gemm_rows = [r for r in found.get("rows", []) if r.get("impl") == "sparse_gemm"]
        for key, what in (("rel_err", "checked launches wrong"),
                          ("replayed_rel_err", "timed CUDA graphs wrong as replayed")):
            errors: dict[str, list[float]] = {}   # each form's errors of this kind
            for r in gemm_rows:
                if r.get(key) is not None:
                    errors.setdefault(gemm_policy(r["plan"]), []).append(r[key])
            right = {name for name, errs in errors.items() if min(errs) < REFUSED_REL_ERR}
            for name, errs in errors.items():
                if name not in right:
                    why = f"all {len(errs)} {what} (least error {min(errs):.2g}, tune_sparse_gemm)"
                    out.setdefault(name, why)
                    if name == SPARSE_WGMMA and SPARSE_WGMMA_MAPPED not in right:   # its text, its operands' reading
                        out.setdefault(SPARSE_WGMMA_MAPPED, f"{SPARSE_WGMMA}'s form: {why}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "scripts" / "results"))
    ap.add_argument("--since", type=float, default=0.0, help="read only files written at this time or later")
    ap.add_argument("--smoke", action="store_true", help="the CPU smoke runs' files")
    args = ap.parse_args()
    found = left_out(Path(args.results), args.since, "_smoke" if args.smoke else "")
    for name, why in found.items():
        print(f"leave out {name}: {why}", file=sys.stderr)
    print(",".join(found))


if __name__ == "__main__":
    main()
