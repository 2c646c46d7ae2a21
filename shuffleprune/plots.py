"""Pictures of a permutation run from its ``prune_report.json`` (matplotlib, PNG):

- ``perm_strength.png``: permutation strength ``1 − ‖P − I‖_F/√(2N)`` vs relative depth, one line
  per projection type (paper Sec. 5.3);
- ``perm_penalty.png``: ``P(M)`` per optimisation step for every learned permutation, coloured by depth;
- ``perm_loss.png``: the block reconstruction loss ``1 − cos`` per step, coloured by depth (with
  ``--recon model``: the one joint loss curve).
"""
from __future__ import annotations

from pathlib import Path

from .errors import UserError


def _kind(unit: list[str]) -> str:
    """``['m.layers.3.self_attn.q_proj', '….k_proj', '….v_proj']`` → ``self_attn.q_proj+k_proj+v_proj``."""
    tails = [n.split(".") for n in unit]
    first = tails[0]
    # drop the leading "<blocks>.<index>" part: everything up to the first all-digit component
    start = next((i + 1 for i, part in enumerate(first) if part.isdigit()), 0)
    label = ".".join(first[start:])
    return label + "".join("+" + t[-1] for t in tails[1:])


def plot_perm_report(report: dict, out_dir: Path) -> list[Path]:
    """Write the PNGs for ``report`` (a prune report with ``perm``) into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    perm = report.get("perm")
    if not perm or not perm.get("blocks"):
        raise UserError("this prune report has no permutations to plot (prune with --perm random|learned)")
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
