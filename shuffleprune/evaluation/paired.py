"""Paired differences: models scored on the same items compared item by item against one baseline.

Two models' accuracies on the same items are correlated, so the standard error of their difference is far
below what the two per-model standard errors suggest. Per task, each item's score (1 right, 0 wrong) is kept
in doc-id order as a string of ``0``/``1`` (``item_scores``); ``paired_difference`` gives the mean difference
and its standard error, ``sd(d) / sqrt(n)``, of ``d_i = model_i − baseline_i``; the average over tasks is
the mean of the tasks' differences, its error ``sqrt(Σ se²) / T`` (tasks' items are independent).
``repeated_difference`` does the same for one comparison repeated on the same items (over calibration seeds).
"""
from __future__ import annotations

import math


def item_scores(samples: list[dict], metric: str) -> str | None:
    """One task's per-item ``metric`` (``acc``, or ``exact_match,strict-match`` of a filter other than
    lm-eval's ``none``) from lm-eval's logged samples, as ``"0110…"`` in doc-id order; None when an item's
    score is not 0 or 1 (a perplexity, an F1), which a paired accuracy cannot use."""
    metric, _, keep = metric.partition(",")
    keep = keep or "none"
    scores = {}
    for sample in samples:
        if sample.get("filter") != keep:
            continue
        try:
            value = float(sample.get(metric))   # a bool, an int, a float, numpy's too
        except (TypeError, ValueError):          # absent, or a tuple (a perplexity's parts)
            return None
        if value not in (0, 1):
            return None
        scores[sample["doc_id"]] = "1" if value == 1 else "0"
    return "".join(scores[k] for k in sorted(scores)) if scores else None


def paired_difference(items: str, baseline: str) -> dict | None:
    """Mean of ``items − baseline`` over the same items, its standard error, and the items each gets right
    alone; None when the two did not score the same number of items."""
    if len(items) != len(baseline) or not items:
        return None
    d = [int(a) - int(b) for a, b in zip(items, baseline)]
    return {**_mean_and_error(d), "only_model": d.count(1), "only_baseline": d.count(-1)}


def repeated_difference(pairs: list[tuple[str, str]]) -> dict | None:
    """The paired difference of a comparison repeated on the same items (each repeat its own calibration
    seed, say): ``pairs`` holds each repeat's ``(items, baseline)``; each item's difference is averaged
    over the repeats before its mean and standard error are taken, so the error covers both which items
    were drawn and how the repeats differ on them. None when the repeats did not all score the same items."""
    if not pairs or len({len(x) for pair in pairs for x in pair}) != 1 or not pairs[0][0]:
        return None
    r = len(pairs)
    d = [sum(int(a) - int(b) for a, b in column) / r
         for column in zip(*(zip(items, baseline) for items, baseline in pairs))]
    return {**_mean_and_error(d), "repeats": r}


def _mean_and_error(d: list[float]) -> dict:
    """Mean of per-item differences, its standard error ``sd(d) / sqrt(n)`` (None for one item), and n."""
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else None
    return {"diff": mean, "stderr": se, "n": n}


def average_difference(tasks: dict[str, dict | None]) -> dict | None:
    """The tasks' mean difference and its standard error; None unless every task has a paired difference
    with an error."""
    diffs = list(tasks.values())
    if not diffs or any(t is None or t["stderr"] is None for t in diffs):
        return None
    return {"diff": sum(t["diff"] for t in diffs) / len(diffs),
            "stderr": math.sqrt(sum(t["stderr"] ** 2 for t in diffs)) / len(diffs)}


def task_difference(result: dict, base: dict) -> dict | None:
    """One task's (or group's) paired difference from the baseline's: from the items both scored, or for a
    group that weighs its tasks alike, the mean of its tasks' differences; None when neither can be had."""
    if result["metric"] != base["metric"]:
        return None
    if result.get("items") and base.get("items"):
        return paired_difference(result["items"], base["items"])
    subs, base_subs = result.get("subtasks") or {}, base.get("subtasks") or {}
    if subs and result.get("aggregate") == base.get("aggregate") == "mean of subtasks" and subs.keys() == base_subs.keys():
        return average_difference({name: task_difference(sub, base_subs[name]) for name, sub in subs.items()})
    return None


def add_paired(rows: list[dict], baseline: int) -> None:
    """Give every row but ``rows[baseline]`` its paired differences from it (``row["vs_baseline"]``) over
    the tasks both scored; the average covers the tasks the rows' averages cover."""
    base = rows[baseline]
    for i, row in enumerate(rows):
        if i == baseline or not row["results"]:
            continue
        tasks = {name: task_difference(result, base["results"][name]) if name in base["results"] else None
                 for name, result in row["results"].items()}
        averaged = {name: tasks[name] for name, r in row["results"].items() if r["value"] is not None}
        row["vs_baseline"] = {"baseline": base["model"], "tasks": tasks, "average": average_difference(averaged)}
