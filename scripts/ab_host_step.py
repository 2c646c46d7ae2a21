"""The eager decode step's host cost of the sparse runtime, this checkout against another commit's.

    python scripts/ab_host_step.py 0c4969a            # → scripts/results/host_step_ab.json
    python scripts/ab_host_step.py 0c4969a --runs 5

Each run is one process running ``check_fast_launch.check_step`` (this checkout's) on the 4-layer LLaMA
of ``decode_step_model``, launches recorded instead of run, compile-only for sm_90a: the sparse runtime's
host µs and Python function calls per decoder layer (the step's less the same step with the sparse
layers and fused norms stubbed). The two packages run in alternating processes, ``--runs`` each: on a
shared or 2-core machine the time moves by a third from process to process, so compare medians; the
call count does not move. The other commit's package is a ``git worktree`` in a temporary folder, put
first on ``PYTHONPATH`` (its ``kernels/`` and ``calib/`` linked in as this layout installs them); it
must have ``check_step``'s names (``decode_step_model``, the fast launches).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = """
import json, sys
sys.path.insert(0, {scripts!r})
import torch
torch.set_num_threads(1)
from check_fast_launch import check_step
from shuffleprune.kernels import launch
from shuffleprune.kernels.compile_check import recorded_launches
import shuffleprune
with recorded_launches() as calls, launch.enabled():
    row = check_step(calls, {steps})
print(json.dumps(dict(row, package=shuffleprune.__file__)))
"""


def package_of(commit: str, where: Path) -> Path:
    """A folder whose ``shuffleprune`` is ``commit``'s, laid out as the install maps it."""
    tree = where / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), commit], check=True)
    for sub in ("kernels", "calib"):
        (tree / "shuffleprune" / sub).symlink_to(tree / sub)
    (where / "pkg").mkdir()
    (where / "pkg" / "shuffleprune").symlink_to(tree / "shuffleprune")
    return where / "pkg"


def one_run(pythonpath: str | None, cwd: Path, steps: int) -> dict:
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", RUN.format(scripts=str(ROOT / "scripts"), steps=steps)], env=env,
                         cwd=cwd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("commit", help="the commit to compare against (its package, this checkout's check)")
    ap.add_argument("--runs", type=int, default=3, help="processes per side")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per round (check_step's)")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "host_step_ab.json"))
    args = ap.parse_args()
    from shuffleprune.outdir import atomic_write
    from shuffleprune.runtime.facts import machine, versions

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        try:
            other = package_of(args.commit, where)
            for i in range(args.runs):
                for side, path in ((args.commit, str(other)), (f"{head} (this checkout)", None)):
                    row = one_run(path, where if path else ROOT, args.steps)
                    rows.append({"side": side, "run": i, **row})
                    print(f"{side:28s} {row['sparse_runtime_host_us_per_layer']:7.1f} µs, "
                          f"{row['sparse_runtime_python_calls_per_layer']:6.1f} calls per layer", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where / "tree")], check=False)
    summary = {}
    for side in dict.fromkeys(r["side"] for r in rows):
        mine = [r for r in rows if r["side"] == side]
        summary[side] = {"median_host_us_per_layer": statistics.median(r["sparse_runtime_host_us_per_layer"] for r in mine),
                         "python_calls_per_layer": sorted({r["sparse_runtime_python_calls_per_layer"] for r in mine})}
    result = {"what": "the eager decode step's sparse-runtime host cost per decoder layer, two packages in alternating "
                      "processes (launches recorded, compile-only for sm_90a; check_fast_launch.check_step)",
              "summary": summary, "rows": rows, "runs": args.runs, "steps": args.steps, "seed": 0,
              "data": "a random 4-layer LLaMA (512 wide, 8 heads), bf16, an 8-token prompt in a static cache, one "
                      "token per step",
              "command": "python " + " ".join(sys.argv), "machine": machine(), "versions": versions("triton")}
    atomic_write(Path(args.out), lambda path: path.write_text(json.dumps(result, indent=1) + "\n"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
