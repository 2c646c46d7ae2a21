"""Time the sparse-tensor-core decode (``kernels/nm_sparse_mma.cu``) on a GPU against cuBLAS: for each
shape and token count, the plan's launch and each variation of its tile in the grid given (the tall plan's CTAs,
``--tall 1``: each input read shared by more rows; warps splitting K in a CTA, row groups of warps, CTAs
splitting K, m-tiles per warp, the input loaded a step ahead, steps held in registers), with no
map or (``--maps random``, 1–16 tokens) reading a random one itself, in both position layouts
(row words; cuSPARSELt's order, as a layer holds it after ``use_cslt_layout``). Every launch is first checked
against a dense bf16 matmul of the decompressed weight (its maximum relative error is recorded; a launch off
by more than 2 % is not timed) and then timed as ``bench_kernel.py`` times: calls over rotating weight copies
(together more than 2.5× the L2) captured in one CUDA graph, the median replay.

    python scripts/tune_sparse_mma.py                                # → scripts/results/tune_sparse_mma.json
    python scripts/tune_sparse_mma.py --smoke                        # CPU: tiny shapes on the tests' emulator (g++)
    python scripts/tune_sparse_mma.py --probe ...                    # the fragments' reading checked first (and, if
                                                                     # wrong, the others tried: "probe", "reading")
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from kernel_cases import add_timing_args  # noqa: E402  (scripts/, this script's folder, is on the path)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1024, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=[f"{o}x{i}" for o, i in SHAPES], help="weights as OUTxIN")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--tall", type=int, nargs="+", default=[0],
                    help="1: tall_plan's CTAs (where auto weighs them: tall_worth_weighing); 0: the default plan")
    ap.add_argument("--kw", type=int, nargs="+", default=[0], help="warps splitting K in a CTA (0: the plan's)")
    ap.add_argument("--rw", type=int, nargs="+", default=[0], help="row groups of warps in a CTA (0: the plan's)")
    ap.add_argument("--splits", type=int, nargs="+", default=[0], help="CTAs splitting K (0: the plan's)")
    ap.add_argument("--mt", type=int, nargs="+", default=[0], help="m-tiles of 16 rows per warp (0: the plan's)")
    ap.add_argument("--bpre", type=int, nargs="+", default=[-1],
                    help="1/0: the input loaded a step ahead or not (-1: the plan's)")
    ap.add_argument("--stages", type=int, nargs="+", default=[0],
                    help="steps a warp holds in registers (0: the plan's)")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[-1],
                    help="1/0: the CTA's further weight asked into L2 before it stages its input or not (-1: the "
                         "plan's: on where it reads a map)")
    ap.add_argument("--inline", type=int, nargs="+", default=[0],
                    help="1: through a map, each B load reads the map itself, nothing staged (inline_map); 0: staged")
    ap.add_argument("--min-ctas", type=int, nargs="+", default=[-1],
                    help="CTAs an SM must hold, capping the registers (__launch_bounds__; 0: no bound; -1: the plan's)")
    ap.add_argument("--layouts", nargs="+", default=["rows", "tiled"], choices=["rows", "tiled"])
    ap.add_argument("--maps", nargs="+", default=["none"], choices=["none", "random"],
                    help="random: a random index map over all columns, read by the kernel itself (1-16 tokens)")
    ap.add_argument("--probe", action="store_true",
                    help="first check the kernel's reading of the PTX fragments on a small case in both layouts; "
                         "if it is wrong, try the others (FRAGMENT_KNOBS) and time with the first that is right")
    add_timing_args(ap, ROOT / "scripts" / "results" / "tune_sparse_mma.json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from kernel_cases import (REFUSED_REL_ERR, checked_launch, checked_timing, dense_ms, hung_marker, random_24_layer,
                              rotated_copies, run_facts, timing_setup)
    from shuffleprune.deploy.cslt_layout import cslt_words
    from shuffleprune.kernels.nm_sparse_mma import FRAGMENT_KNOBS, launch_plan, nm_sparse_mma, set_fragment_reading
    from shuffleprune.kernels.sparse_mma_tiles import (DEFAULT_CTAS_PER_SM, plan_fields, sparse_mma_plan, tall_plan,
                                                       tall_worth_weighing)
    from shuffleprune.deploy.auto_choice import relative_error

    dev, cuda, shapes, l2, sms = timing_setup(args, [(64, 256), (128, 384)])
    if args.smoke:   # the kernel's text on the CPU, under the tests' emulator
        from sparse_mma_cpu import run_cpu
        args.tokens = [1, 9]
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    rows, best = [], []
    out = Path(args.out) if cuda else Path(args.out).with_name("tune_sparse_mma_smoke.json")
    hung_marker(out).unlink(missing_ok=True)   # an earlier run's

    def save() -> None:
        out.write_text(json.dumps({
            "what": "the sparse-tensor-core decode's launches against cuBLAS (bf16, gathered input, rotating weight "
                    "copies, CUDA graphs; rel_err: max |y - dense| / max |dense| of a dense bf16 matmul)",
            **run_facts(args.smoke, cuda), "probe": probe, "reading": reading, "best": best, "rows": rows},
            indent=1) + "\n")

    probe, reading = [], None
    if args.probe:   # the first reading, then (only if it is wrong) the others, default first
        pw, pvalues, pwords, px = random_24_layer(128, 512, 3, gen, dtype)
        pwant = (px.double() @ pw.double().t()).float()
        combos = [sorted(c) for k in range(len(FRAGMENT_KNOBS) + 1) for c in itertools.combinations(FRAGMENT_KNOBS, k)]
        for knobs in combos:
            set_fragment_reading(knobs)
            result = {"knobs": knobs}
            for layout in ("rows", "tiled"):
                lw = (cslt_words(pwords) if layout == "tiled" else pwords).contiguous()
                try:
                    if cuda:   # the decode's first launches: one that never finishes ends the process, named
                        y = checked_launch(lambda: nm_sparse_mma(px.to(dev), pvalues.to(dev), lw.to(dev), None,
                                                                 tiled=layout == "tiled"),
                                           {"kernel": "sparse_mma", "probe": knobs, "layout": layout}, out)
                    else:
                        y = run_cpu(px, pvalues, lw, None, layout == "tiled",
                                    sparse_mma_plan(3, 128, 512, 4, DEFAULT_CTAS_PER_SM))[0]
                    result[layout] = relative_error(y.cpu(), pwant)
                except Exception as exc:  # noqa: BLE001 - a reading the emulator refuses, or a fault: recorded
                    result[layout] = str(exc).splitlines()[0][:200]
            result["right"] = all(isinstance(result[k], float) and result[k] < REFUSED_REL_ERR
                                  for k in ("rows", "tiled"))
            probe.append(result)
            print("probe", knobs, {k: result[k] for k in ("rows", "tiled")}, "right" if result["right"] else "wrong",
                  flush=True)
            if result["right"]:
                reading = knobs
                break
        set_fragment_reading(reading or [])
        save()
    for (out_f, in_f), tokens in itertools.product(shapes, args.tokens):
        w, values, words, x = random_24_layer(out_f, in_f, tokens, gen, dtype)
        w_dev, x_dev = w.to(dev), x.to(dev)
        want = F.linear(x_dev, w_dev).float()
        n_copies = rotated_copies(values, l2, cuda)
        dense = dense_ms(x_dev, w_dev, n_copies, args.reps) if cuda else None
        rows.append({"shape": [out_f, in_f], "tokens": tokens, "impl": "dense", "ms": dense})
        case = []
        perm = torch.randperm(in_f, generator=gen).to(torch.int32)
        # with a map the kernel multiplies x[:, perm] (the same weight, the input read through the map)
        want_mapped = F.linear(x_dev[:, perm.long().to(dev)], w_dev).float() if "random" in args.maps else None
        for layout, kind in itertools.product(args.layouts, args.maps):
            if kind == "random" and tokens > 16:
                continue
            tiled = layout == "tiled"
            if tiled and out_f % 64:
                continue
            lw = (cslt_words(words) if tiled else words).contiguous()
            copies = [(values.to(dev), lw.to(dev))]
            copies += [(copies[0][0].clone(), copies[0][1].clone()) for _ in range(n_copies - 1)]
            grid = itertools.product(args.tall, args.kw, args.rw, args.splits, args.mt, args.bpre, args.stages,
                                     args.prefetch, args.inline, args.min_ctas)
            seen = set()
            for tall, kw, rw, splits, mt, bpre, stages, prefetch, inline, min_ctas in grid:
                mapped = kind == "random"
                if inline and (tall or not mapped):
                    continue   # the inline map: through a map, on the default plan's CTAs
                override = {k: v for k, v, skip in (("kw", kw, 0), ("rw", rw, 0), ("splits", splits, 0), ("mt", mt, 0),
                                                    ("bpre", bpre, -1), ("stages", stages, 0),
                                                    ("prefetch", prefetch, -1), ("inline_map", inline, 0),
                                                    ("min_ctas", min_ctas, -1)) if v != skip}
                for flag in ("bpre", "prefetch", "inline_map"):
                    if flag in override:
                        override[flag] = bool(override[flag])
                if tall and not tall_worth_weighing(tokens, out_f, in_f, sms, mapped):
                    continue   # where auto does not weigh it
                try:   # a variation that is the launch of one timed already (as planned on the device's SM count)
                    planned = (tall_plan if tall else sparse_mma_plan)(tokens, out_f, in_f, sms, mapped=mapped,
                                                                       **override)
                except ValueError:
                    planned = None
                if planned is not None and planned in seen:
                    continue
                seen.add(planned)
                row = {"shape": [out_f, in_f], "tokens": tokens, "impl": "sparse_mma_tall" if tall else "sparse_mma",
                       "layout": layout, "map": kind, "override": override}
                p_dev = perm.to(dev) if mapped else None
                want_here = want if p_dev is None else want_mapped
                label = {"kernel": "sparse_mma", "shape": [out_f, in_f], "tokens": tokens, "layout": layout,
                         "map": kind, "tall": bool(tall), "override": override}   # what a hung marker names
                try:
                    if cuda:   # a launch that never finishes ends the process, named in the hung marker
                        y = checked_launch(lambda: nm_sparse_mma(x_dev, *copies[0], None, tiled=tiled, perm=p_dev,
                                                                 tall=bool(tall), **override), label, out)
                        plan = launch_plan(x_dev, copies[0][0], tiled, False, mapped, bool(tall), **override)
                    else:
                        plan = (tall_plan if tall else sparse_mma_plan)(tokens, out_f, in_f, sms, DEFAULT_CTAS_PER_SM,
                                                                         mapped, **override)
                        y = run_cpu(x, values, lw, None, tiled, plan, perm=p_dev)[0]
                except Exception as exc:  # noqa: BLE001 - a variation that does not compile or fit: recorded
                    rows.append({**row, "ms": None, "error": str(exc).splitlines()[0][:200]})
                    continue
                err = relative_error(y, want_here)
                row.update(plan=plan_fields(plan), rel_err=err)
                if cuda and err < REFUSED_REL_ERR:
                    replayed: list = []   # the last two calls as the graph left them (split-K's counters reused)
                    row["ms"] = checked_timing([lambda c=c: nm_sparse_mma(x_dev, *c, None, tiled=tiled, perm=p_dev,
                                                                          tall=bool(tall), **override) for c in copies],
                                               args.reps, label, out, replayed)   # one hung only as replayed: named
                    row["replayed_rel_err"] = max(relative_error(o, want_here) for o in replayed)
                    row["speedup_vs_dense"] = dense / row["ms"]
                    row["tb_s"] = (values.numel() * 2 * 9 / 8 + x.numel() * 2 + out_f * tokens * 2) / row["ms"] / 1e9
                    case.append(row)
                rows.append(row)
                print(out_f, in_f, tokens, layout, kind, "tall" if tall else "", override, f"err {err:.1e}", f"{row.get('ms') or 0:.4f} ms",
                      f"x{row.get('speedup_vs_dense') or 0:.2f}", flush=True)
        if case:
            for kind in args.maps:
                mine = [r for r in case if r["map"] == kind]
                if mine:
                    top = min(mine, key=lambda r: r["ms"])
                    best.append({k: top[k] for k in ("shape", "tokens", "impl", "layout", "map", "override", "plan",
                                                     "ms", "speedup_vs_dense")})
        save()
    save()


if __name__ == "__main__":
    main()
