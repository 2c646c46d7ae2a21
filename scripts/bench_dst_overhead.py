"""Training-time overhead of permutations in DST, per step, measured interleaved.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_dst_overhead.py          # the bench_dst model
    python scripts/bench_dst_overhead.py --config-kw n_layer=12,n_embd=768,n_head=12 --seq-len 1024 --device cuda

Whole training runs (``scripts/bench_dst.py``) are too short and too exposed to other load on a
shared machine to resolve a 15 % difference. Here every structured method runs a few steps with
``--perm none``, ``random``, ``learned`` (soft phase) and ``learned`` after hardening, in rounds, so
slow drifts of the machine hit all variants alike. Reported per method: median seconds per step
(forward + backward + optimizer + ``sparsifier.step``), and the overhead of a whole run in which the
soft phase lasts ``--soft-fraction`` of the steps (the trainer's default ``t_perm`` = half).
Results: ``scripts/results/bench_dst_overhead.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--config-kw", default="n_layer=2,n_embd=128,n_head=4")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--methods", nargs="+", default=["srigl", "dsb", "pixelfly", "diag"])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--soft-fraction", type=float, default=0.5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_dst_overhead.json"))
    args = ap.parse_args()

    import torch

    from shuffleprune.cli import _config_kw
    from shuffleprune.dst import DSTConfig, DynamicSparsifier
    from shuffleprune.dst.config import TrainConfig
    from shuffleprune.dst.fresh_model import build_model
    from shuffleprune.runtime.facts import machine, versions

    train_cfg = TrainConfig(arch=args.arch, config_kw=_config_kw([args.config_kw]), seq_len=args.seq_len, seed=0)
    device = torch.device(args.device)

    def make(method: str, perm: str, hardened: bool):
        model = build_model(train_cfg, args.vocab).to(device)  # the trainer's model, same seed for every variant
        cfg = DSTConfig(method=method, sparsity=args.sparsity, perm=perm, t_perm=10**9, t_end=10**9,
                        delta_t=10**9, block=16)
        sp = DynamicSparsifier(cfg)
        sp.prepare(model)
        if hardened:
            for p in sp.perms.values():
                p.harden(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sp.optimizer = opt
        ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), device=device)
        return model, sp, opt, ids

    def timed(state, steps: int) -> list[float]:
        model, sp, opt, ids = state
        out = []
        for _ in range(steps + 1):  # the first step warms up
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sp.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out[1:]

    variants = {"none": ("none", False), "random": ("random", False), "learned_soft": ("learned", False),
                "learned_hard": ("learned", True)}
    rows = []
    for method in args.methods:
        states = {v: make(method, p, h) for v, (p, h) in variants.items()}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                times[v] += timed(states[v], args.steps)
        med = {v: statistics.median(t) for v, t in times.items()}
        f = args.soft_fraction
        run = f * med["learned_soft"] + (1 - f) * med["learned_hard"]
        rows.append({"method": method, "seconds_per_step": {v: round(s, 5) for v, s in med.items()},
                     "random_vs_none": round(med["random"] / med["none"], 3),
                     "learned_soft_vs_none": round(med["learned_soft"] / med["none"], 3),
                     "learned_hard_vs_none": round(med["learned_hard"] / med["none"], 3),
                     "learned_run_vs_none": round(run / med["none"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    result = {"what": "DST per-step time with permutations (interleaved rounds, median)", "machine": machine(),
              "versions": versions(), "setup": vars(args), "command": "python " + " ".join(sys.argv), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
