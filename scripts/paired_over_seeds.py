"""One comparison repeated over calibration seeds, read from several ``shuffleprune eval`` results files.

Each ``--run FILE:MODEL`` names one repeat: the row MODEL of the eval results FILE, compared with that file's
baseline (``eval --baseline``) on the same items. The script prints and writes, per repeat, the paired
difference the file holds, and over all repeats the seed-averaged paired difference
(``shuffleprune.evaluation.paired.repeated_difference``: each item's difference averaged over the repeats,
then its mean and standard error per task; the tasks' mean as ``eval`` averages them).

    python scripts/paired_over_seeds.py --run out/eval_s0.json:accurate_s0 --run out/eval_s1.json:accurate_s1 \\
        --label accurate --out scripts/results/eval_paired_seeds.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from shuffleprune.evaluation.paired import average_difference, repeated_difference


def load_run(spec: str) -> dict:
    """The row named in ``FILE:MODEL`` and its file's baseline row, with what the file says of its run."""
    file, sep, model = spec.rpartition(":")
    if not sep or not file:
        raise SystemExit(f"--run {spec!r}: give FILE:MODEL, a results file of `shuffleprune eval` and a model row in it")
    results = json.loads(Path(file).read_text())
    rows = {row["model"]: row for row in results["models"]}
    if model not in rows:
        raise SystemExit(f"--run {spec!r}: no model {model!r} in {file}; it has {', '.join(rows)}")
    base = results.get("baseline")
    if base not in rows or base == model:
        raise SystemExit(f"--run {spec!r}: {file} has no baseline other than {model!r}; run eval with --baseline")
    return {"file": file, "model": rows[model], "baseline": rows[base], "date": results.get("date"),
            "limit": results["config"].get("limit")}


def combine(runs: list[dict]) -> dict:
    """Per-repeat differences and the seed-averaged difference over the tasks every repeat scored with items."""
    tasks = [t for t, r in runs[0]["model"]["results"].items()
             if all(r2["model"]["results"].get(t, {}).get("items") and r2["baseline"]["results"].get(t, {}).get("items")
                    for r2 in runs)]
    if not tasks:
        raise SystemExit("no task has per-item scores in every run; re-run eval (0.4 keeps them) on the same tasks")
    pooled = {t: repeated_difference([(r["model"]["results"][t]["items"], r["baseline"]["results"][t]["items"])
                                      for r in runs]) for t in tasks}
    if any(v is None for v in pooled.values()):
        bad = [t for t, v in pooled.items() if v is None]
        raise SystemExit(f"the runs did not score the same items of {', '.join(bad)}; use one --limit and one task version")
    per_run = []
    for r in runs:
        model, base = r["model"], r["baseline"]
        per_run.append({
            "file": r["file"], "model": model["model"], "baseline": base["model"], "fitted_on": model.get("fitted_on"),
            "baseline_fitted_on": base.get("fitted_on"), "ppl": model.get("ppl"), "baseline_ppl": base.get("ppl"),
            "average": model.get("average"), "baseline_average": base.get("average"),
            "vs_baseline": model.get("vs_baseline")})
    diffs = [p["vs_baseline"]["average"]["diff"] for p in per_run if (p["vs_baseline"] or {}).get("average")]
    return {"tasks": tasks, "runs": per_run, "pooled": {"tasks": pooled, "average": average_difference(pooled)},
            "seed_sd_of_average_diff": statistics.stdev(diffs) if len(diffs) > 1 else None}


def markdown(label: str, result: dict) -> str:
    """A table: one column per repeat and one for the seed-averaged difference, in points."""
    def pm(d: dict | None) -> str:
        return "—" if not d else f"{100 * d['diff']:+.2f} ± {100 * d['stderr']:.2f}"
    runs = result["runs"]
    seeds = [((r.get("fitted_on") or {}).get("calibration") or {}).get("seed", i) for i, r in enumerate(runs)]
    head = [f"seed {s}" for s in seeds] + [f"mean of {len(runs)}"]
    lines = [f"{label} − {runs[0]['baseline']} (paired, points ± SE)", "",
             "| | " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(head)]
    ppl = [f"{r['ppl']:.2f} vs {r['baseline_ppl']:.2f}" if r["ppl"] and r["baseline_ppl"] else "—" for r in runs]
    both = [(r["ppl"], r["baseline_ppl"]) for r in runs if r["ppl"] and r["baseline_ppl"]]
    mean_ppl = (f"{statistics.mean(p for p, _ in both):.2f} vs {statistics.mean(b for _, b in both):.2f}"
                if len(both) == len(runs) else "—")
    lines.append("| ppl | " + " | ".join(ppl + [mean_ppl]) + " |")
    for t in result["tasks"]:
        cells = [pm((r["vs_baseline"] or {}).get("tasks", {}).get(t)) for r in runs] + [pm(result["pooled"]["tasks"][t])]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    cells = [pm((r["vs_baseline"] or {}).get("average")) for r in runs] + [pm(result["pooled"]["average"])]
    lines.append("| average | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, help="FILE:MODEL, one per repeat")
    ap.add_argument("--label", default=None, help="name of the compared model in the table (default: the first run's)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here and the table beside it (.md)")
    args = ap.parse_args(argv)
    runs = [load_run(spec) for spec in args.run]
    result = combine(runs)
    label = args.label or runs[0]["model"]["model"]
    table = markdown(label, result)
    print(table)
    if args.out:
        record = {"what": f"{label} vs {runs[0]['baseline']['model']}, paired on the same items, repeated",
                  "command": "python " + " ".join(sys.argv), "label": label, **result}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
