"""Human-readable summaries of run reports (rich tables)."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shuffleprune.blocks import OUTSIDE_LINEARS_WARN_SHARE
from shuffleprune.calib import held_out_part
from shuffleprune.console import plain_console
from shuffleprune.errors import UserError, reason

# what the commands read of a run's report (a prune run's, a dst run's)
PRUNE_REPORT_KEYS = ("model", "method", "pattern", "calib", "eval", "ppl", "sparsity", "nm_ok", "seconds", "layers")
DST_REPORT_KEYS = ("dst", "final_ppl", "density", "train_seconds")


def read_report(path: Path) -> dict:
    """A run's ``prune_report.json`` or ``dst_report.json``, refused in one line when it is not JSON or
    lacks what the commands read (edited by hand, cut short)."""
    keys = DST_REPORT_KEYS if path.name == "dst_report.json" else PRUNE_REPORT_KEYS
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"'{path}' is not a readable run report ({reason(exc, 80)}); run the command that "
                        "wrote it again") from None
    missing = [key for key in keys if not isinstance(report, dict) or key not in report]
    if missing:
        raise UserError(f"'{path}' has no {', '.join(missing)}: not a report shuffleprune wrote, or cut short; "
                        "run the command that wrote it again")
    return report


def method_label(report: dict) -> str:
    """How a prune report's run pruned, in a few words: ``method pattern``, then its permutation and weight-update
    stages (``sparsegpt 2:4, search perm, lsq update``), and its statistics stage where it is not the usual
    ``sequential``: the presets that share a prune method (``balanced``, ``accurate``, ``best``) read apart."""
    label = f"{report['method']} {report['pattern']}"
    for entry in report.get("stages") or []:
        kind, _, name = str(entry).partition(":")
        if kind in ("permutation", "update") or (kind == "statistics" and name != "sequential"):
            label += f", {name} {'perm' if kind == 'permutation' else kind}"
    return label


def ppl_change(report: dict) -> str:
    """A training run's held-out perplexity as ``before → after`` (a fine-tune's, scored before its first step),
    or ``after`` alone for a run with no step-0 score (``dst``)."""
    final = f"{report['final_ppl']:.2f}"
    start = next((e["ppl"] for e in report["evals"] if e["step"] == 0), None)
    return f"{start:.2f} → {final}" if start is not None else final


def training_summary(report: dict) -> str:
    """One line for a ``dst`` or ``finetune`` run's ``dst_report.json``: what ran, its held-out perplexity (a
    fine-tune's before its first step and after its last), the density, the training time."""
    seconds = f"{report['train_seconds']:.0f} s"
    init = report["train"].get("init")
    if init is not None:
        return f"finetune of {init}: ppl {ppl_change(report)}, density {report['density']:.4f} held, {seconds}"
    dst = report["dst"]
    return (f"dst {dst['method']} perm {dst['perm']}: final ppl {report['final_ppl']:.2f}, "
            f"density {report['density']:.4f}, {seconds}")


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def tokens_scored(ev: dict) -> int:
    """The tokens a perplexity record's windows predicted, which its perplexity averages over (records
    written before ``tokens_scored`` was kept give their ``tokens``)."""
    return ev.get("tokens_scored", ev["tokens"])


def prune_table(report: dict) -> Table:
    """Dense vs pruned: perplexity, sparsity, N:M check, time."""
    ev = report["eval"]
    title = (f"{report['model']} · {method_label(report)} · calib {report['calib']['source']} "
             f"{report['calib']['nsamples']}×{report['calib']['seqlen']} seed {report['calib']['seed']}")
    table = Table(title=title)
    table.add_column("model")
    part = held_out_part(str(ev["text"]), report["calib"]["split_from_shared_file"]) if ev["text"] else ""
    table.add_column(f"ppl ({ev['text']}, {part}, ctx {ev['ctx']}, {tokens_scored(ev)} tokens scored)" if ev["text"]
                     else "ppl (not measured)", justify="right")
    table.add_column("sparsity (pruned layers)", justify="right")
    table.add_column("N:M holds", justify="center")
    table.add_column("time [s]", justify="right")
    nm = report["nm_ok"]
    secs = report["seconds"]
    table.add_row("dense", _fmt(report["ppl"]["dense"]), "0.00", "—", "—")
    table.add_row(method_label(report), _fmt(report["ppl"]["pruned"]),
                  f"{report['sparsity']:.4f}", "—" if nm is None else ("yes" if nm else "NO"),
                  f"{secs['calibration'] + secs['prune']:.1f} prune, {secs['eval']:.1f} eval")
    unseen = report.get("outside_linears") or {}
    if unseen.get("share", 0) > OUTSIDE_LINEARS_WARN_SHARE:
        table.caption = (f"{unseen['share']:.0%} of the blocks' weights are outside nn.Linear and fused experts and stay dense "
                         f"(e.g. {unseen['names'][0]})")
    return table


def print_prune_report(report: dict, console: Console | None = None) -> None:
    (console or plain_console()).print(prune_table(report))


def _eval_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side eval table (one column per model)."""
    models = results["models"]
    header = ["", *[m["model"] for m in models]]
    rows = [["pruned", *[m.get("pruned") or "—" for m in models]],
            ["sparsity (decoder linears, experts)", *[_fmt(m["sparsity"], 4) for m in models]]]
    if "ppl" in results["tasks"]:
        ev = results.get("ppl_eval") or next((m.get("ppl_eval") for m in models if m.get("ppl_eval")), None)
        label = f"ppl ↓ ({ev['text']}, {held_out_part(str(ev['text']))}, ctx {ev['ctx']}, {tokens_scored(ev)} tok scored)" if ev else "ppl ↓"
        rows.append([label, *[_fmt(m["ppl"]) for m in models]])
    for name in dict.fromkeys(k for m in models for k in m["results"]):
        first = next(m["results"][name] for m in models if name in m["results"])
        n = first.get("n_items")
        rows.append([f"{name} {first['metric']}" + (f" (n={n})" if n else ""),
                     *[_pct(m["results"].get(name, {}).get("value")) for m in models]])
    if any(m["results"] for m in models):
        rows.append(["average (zero-shot)", *[_pct(m.get("average")) for m in models]])
    if any(m.get("vs_baseline") for m in models):
        rows.append([f"Δ average vs {results['baseline']} (± paired SE)",
                     *[_delta((m.get("vs_baseline") or {}).get("average")) for m in models]])
    return header, rows


def _delta(d: dict | None) -> str:
    """A paired difference in percentage points with its standard error: ``+1.20 ± 0.52``."""
    return "—" if d is None or d.get("stderr") is None else f"{100 * d['diff']:+.2f} ± {100 * d['stderr']:.2f}"


def _paired_markdown(results: dict) -> list[str]:
    """The per-task paired differences from the baseline as a Markdown table (none with one model)."""
    others = [m for m in results["models"] if m.get("vs_baseline")]
    if not others:
        return []
    lines = ["", f"Paired differences from {results['baseline']} on the same items, in percentage points ± the "
             "standard error of the paired difference (items right only in the model / only in the baseline):", "",
             "| task | " + " | ".join(m["model"] for m in others) + " |", "| --- |" + " ---: |" * len(others)]
    for name in dict.fromkeys(k for m in others for k in m["vs_baseline"]["tasks"]):
        cells = []
        for m in others:
            d = m["vs_baseline"]["tasks"].get(name)
            counts = f" ({d['only_model']}/{d['only_baseline']})" if d and "only_model" in d and d["stderr"] is not None else ""
            cells.append(_delta(d) + counts)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| average | " + " | ".join(_delta(m["vs_baseline"]["average"]) for m in others) + " |")
    return lines


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}"


def eval_table(results: dict) -> Table:
    header, rows = _eval_rows(results)
    lim = results["lm_eval"]["limit"]
    title = (f"shuffleprune eval · lm-eval {results['lm_eval']['version']} · "
             f"{'offline data' if results['offline'] else 'hub data'} · "
             f"limit {lim if lim is not None else 'none'} · accuracy in %"
             if set(results["tasks"]) - {"ppl"} else "shuffleprune eval · perplexity")   # no lm-eval task: no task data
    table = Table(title=title)
    table.add_column(header[0])
    for h in header[1:]:
        table.add_column(h, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def eval_markdown(results: dict) -> str:
    header, rows = _eval_rows(results)
    lim = results["lm_eval"]["limit"]
    tasks = set(results["tasks"]) - {"ppl"}
    about = (f"lm-eval {results['lm_eval']['version']}, {'offline' if results['offline'] else 'hub'} task data, "
             f"limit {lim if lim is not None else 'none'}, n-shot {results['lm_eval']['num_fewshot'] or 0}, "
             f"batch size {results['lm_eval']['batch_size']}, device {results['device']}; accuracy in %."
             if tasks else f"Perplexity, device {results['device']}.")
    lines = [about, "", "| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += _paired_markdown(results)
    if tasks:
        lines += ["", "Task data:"] + [f"- {t}: {o}" for t, o in results["lm_eval"]["task_data"].items()]
    return "\n".join(lines) + "\n"


def print_eval_report(results: dict, console: Console | None = None) -> None:
    (console or plain_console()).print(eval_table(results))
