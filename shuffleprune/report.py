"""Human-readable summaries of run reports (rich tables)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def prune_table(report: dict) -> Table:
    """Dense vs pruned: perplexity, sparsity, N:M check, time."""
    ev = report["eval"]
    title = (f"{report['model']} · {report['method']} {report['pattern']} · calib {report['calib']['source']} "
             f"{report['calib']['nsamples']}×{report['calib']['seqlen']} seed {report['calib']['seed']}")
    table = Table(title=title)
    table.add_column("model")
    table.add_column(f"ppl ({ev['text']} test, ctx {ev['ctx']}, {ev['tokens']} tokens)" if ev["text"]
                     else "ppl (not measured)", justify="right")
    table.add_column("sparsity (pruned layers)", justify="right")
    table.add_column("N:M holds", justify="center")
    table.add_column("time [s]", justify="right")
    nm = report["nm_ok"]
    secs = report["seconds"]
    table.add_row("dense", _fmt(report["ppl"]["dense"]), "0.00", "—", "—")
    table.add_row(f"{report['method']} {report['pattern']}", _fmt(report["ppl"]["pruned"]),
                  f"{report['sparsity']:.4f}", "—" if nm is None else ("yes" if nm else "NO"),
                  f"{secs['calibration'] + secs['prune']:.1f} prune, {secs['eval']:.1f} eval")
    return table


def print_prune_report(report: dict, console: Console | None = None) -> None:
    (console or Console()).print(prune_table(report))
