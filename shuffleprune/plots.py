"""Pictures of a permutation run from its ``prune_report.json`` (matplotlib, PNG):

- ``perm_strength.png``: permutation strength ``1 − ‖P − I‖_F/√(2N)`` vs relative depth, one line
  per projection type (paper Sec. 5.3);
- ``perm_penalty.png``: ``P(M)`` per optimisation step for every learned permutation, coloured by depth;
- ``perm_loss.png``: the block reconstruction loss ``1 − cos`` per step, coloured by depth (with
  ``--recon model``: the one joint loss curve).
"""
from __future__ import annotations

from pathlib import Path

from shuffleprune.errors import UserError, given_path
from shuffleprune.outdir import check_writable


def _kind(unit: list[str]) -> str:
    """``['m.layers.3.self_attn.q_proj', '….k_proj', '….v_proj']`` → ``self_attn.q_proj+k_proj+v_proj``."""
    tails = [n.split(".") for n in unit]
    first = tails[0]
    # drop the leading "<blocks>.<index>" part: everything up to the first all-digit component
    start = next((i + 1 for i, part in enumerate(first) if part.isdigit()), 0)
    label = ".".join(first[start:])
    return label + "".join("+" + t[-1] for t in tails[1:])


def check_plot_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a Path; a plot directory that is empty, a file or cannot be written refused (``prune --plots``
    asks before pruning, not after)."""
    out_dir = given_path(out_dir, "--plots")
    check_writable(out_dir, "--plots")
    return out_dir


def plot_perm_report(report: dict, out_dir: str | Path) -> list[Path]:
    """Write the PNGs for ``report`` (a prune report with ``perm``) into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    perm = report.get("perm")
    if not perm or not perm.get("blocks"):
        raise UserError("this prune report has no permutations to plot (prune with --perm search|random|learned)")
    out_dir = check_plot_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    blocks = perm["blocks"]
    depth_max = max(b["block"] for b in blocks) or 1
    written = []

    by_kind: dict[str, list[tuple[float, float]]] = {}
    for b in blocks:
        for info in b["perms"].values():
            by_kind.setdefault(_kind(info["linears"]), []).append((b["block"] / depth_max, info["strength"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, pts in sorted(by_kind.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=kind)
    ax.set_xlabel("relative depth")
    ax.set_ylabel("permutation strength 1 − ‖P−I‖F/√(2N)")
    ax.set_title(f"{report['model']} · {report['method']} {report['pattern']} · perm {perm['perm']}")
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "perm_strength.png"))

    learned = [b for b in blocks if any(info.get("penalty_curve") for info in b["perms"].values())]
    if learned:
        cmap = plt.get_cmap("viridis")
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in learned:
            for info in b["perms"].values():
                ax.plot(info["penalty_curve"], color=cmap(b["block"] / depth_max), lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("P(M)")
        ax.set_title("l1−l2 penalty per permutation (colour: depth)")
        written.append(_save(fig, out_dir / "perm_penalty.png"))
        fig, ax = plt.subplots(figsize=(6, 4))
        if (perm.get("model") or {}).get("loss_curve"):  # --recon model: one joint curve
            ax.plot(perm["model"]["loss_curve"], lw=1.0)
            ax.set_ylabel("1 − cos(dense, sparse) final hidden state")
            ax.set_title("joint reconstruction loss (--recon model)")
        else:
            for b in learned:
                ax.plot(b["loss_curve"], color=cmap(b["block"] / depth_max), lw=0.8)
            ax.set_ylabel("1 − cos(dense, sparse) block output")
            ax.set_title("reconstruction loss per block (colour: depth)")
        ax.set_xlabel("step")
        written.append(_save(fig, out_dir / "perm_loss.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_dst_report(report: dict, out_dir: str | Path) -> list[Path]:
    """PNGs of a ``dst`` run: loss and held-out ppl vs step; with permutations, the penalty ``P(M)``
    per layer with its hardening step (paper Fig. 5–6) and permutation strength vs depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = check_plot_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in report["loss_curve"]], [r["loss"] for r in report["loss_curve"]], lw=0.8, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if report.get("evals"):
        ax2 = ax.twinx()
        ax2.plot([e["step"] for e in report["evals"]], [e["ppl"] for e in report["evals"]], "o-", color="C1", label="held-out ppl")
        ax2.set_ylabel("perplexity")
    ax.set_title(f"dst {report['dst']['method']} · perm {report['dst']['perm']} · sparsity {report['dst']['sparsity']}")
    written.append(_save(fig, out_dir / "dst_loss.png"))
    perms = report.get("permutations") or {}
    learned = {n: p for n, p in perms.items() if p["penalty_curve"]}
    if learned:
        cmap = plt.get_cmap("viridis")
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, (name, p) in enumerate(learned.items()):
            colour = cmap(i / max(len(learned) - 1, 1))
            ax.plot(range(1, len(p["penalty_curve"]) + 1), p["penalty_curve"], color=colour, lw=0.8)
            if p["hardened_at"]:
                ax.axvline(p["hardened_at"], color=colour, lw=0.4, ls=":")
        ax.axhline(report["dst"]["delta"], color="red", lw=0.8, ls="--", label="δ")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("P(M)")
        ax.set_title("penalty per layer (colour: depth; dotted: hardening step)")
        ax.legend()
        written.append(_save(fig, out_dir / "dst_penalty.png"))
    strengths = [(i, p["strength"]) for i, p in enumerate(perms.values()) if p["strength"] is not None]
    if strengths:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([s[0] for s in strengths], [s[1] for s in strengths], "o-", ms=3)
        ax.set_xlabel("layer (in model order)")
        ax.set_ylabel("permutation strength 1 − ‖P−I‖F/√(2N)")
        written.append(_save(fig, out_dir / "dst_strength.png"))
    return written
