"""Run the ``lm_eval`` CLI on one model of a ``shuffleprune eval`` results file and compare.

``shuffleprune eval`` records, per model, the ``lm_eval`` command that scores the same checkpoint on
the same (local) task files. This script runs that command in a subprocess and checks that every
metric lm-eval prints equals the value shuffleprune reported, digit for digit.

    python scripts/check_lm_eval_parity.py scripts/results/eval_smollm2.json --model 0 \
        --out scripts/results/lm_eval_parity.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a results JSON written by `shuffleprune eval --out`")
    ap.add_argument("--model", type=int, default=0, help="index of the model in the results file")
    ap.add_argument("--out", type=Path, default=None, help="write the comparison here (JSON)")
    args = ap.parse_args()

    results = json.loads(args.results.read_text())
    row = results["models"][args.model]
    cmd = row.get("lm_eval_cli")
    if not cmd:
        print(f"error: no lm_eval command recorded for model {args.model}", file=sys.stderr)
        return 2
    argv = shlex.split(cmd)
    argv[0] = str(Path(sys.executable).with_name("lm_eval"))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        proc = subprocess.run([*argv, "--output_path", tmp], capture_output=True, text=True)
        seconds = time.time() - t0
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        files = sorted(Path(tmp).rglob("results_*.json"))
        cli = json.loads(files[-1].read_text())

    def every_task(results: dict):   # the rows asked for, and a group's tasks under it
        for name, ours in results.items():
            yield name, ours
            yield from every_task(ours.get("subtasks") or {})

    rows, same = [], True
    for name, ours in every_task(row["results"]):
        theirs = cli["results"][ours["lm_eval_task"]]
        for metric, value in ours["metrics"].items():
            other = theirs.get(metric if "," in metric else f"{metric},none")   # another filter's: as lm-eval names it
            equal = other == value
            same &= equal
            rows.append({"task": name, "metric": metric, "shuffleprune": value, "lm_eval_cli": other, "equal": equal})
        if ours.get("subtasks"):
            continue   # lm-eval counts a group's items per task only (its tasks' rows are compared)
        n_cli = cli.get("n-samples", {}).get(ours["lm_eval_task"], {}).get("effective")
        rows.append({"task": name, "metric": "n_items", "shuffleprune": ours["n_items"], "lm_eval_cli": n_cli,
                     "equal": n_cli == ours["n_items"]})
        same &= n_cli == ours["n_items"]
    for r in rows:
        print(f"{r['task']:<16} {r['metric']:<16} {r['shuffleprune']!s:<24} {r['lm_eval_cli']!s:<24} {'==' if r['equal'] else 'DIFFERENT'}")
    print("identical" if same else "NOT identical")
    if args.out:
        args.out.write_text(json.dumps({
            "results_file": str(args.results), "model": row["model"], "path": row["path"],
            "lm_eval_command": cmd, "lm_eval_cli_seconds": round(seconds, 1),
            "lm_eval_version": cli.get("lm_eval_version") or results["lm_eval"]["version"],
            "identical": same, "rows": rows}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
