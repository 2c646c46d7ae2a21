"""Time the prompt GEMM on the sparse tensor cores (``kernels/nm_sparse_gemm.cu``) on a GPU against cuBLAS: for each
shape and token count, the plan's tile and every other tile of ``GEMM_TILES`` with each number of stages given, in
cuSPARSELt's layout (as a layer holds it after ``use_cslt_layout``) or the export's row words. Every launch is first
checked against a dense bf16 matmul of the decompressed weight (its maximum relative error is recorded; one off by more
than 2 % is not timed, and ``layout_probe.py`` records which weight elements and input columns that tile paired
instead), then timed as ``bench_kernel.py`` times: calls over rotating weight copies (together more than
2.5× the L2) captured in one CUDA graph, the median replay. The fragments are read as the decode's probe found
(``SHUFFLEPRUNE_SPARSE_MMA_READING``, which ``gpu_run.sh sparse_mma`` exports): the same MMA. First, the tensor cores'
ceiling through ``mma.sp`` and the dense ``mma`` (``mma_ceiling.py``: MMAs alone, on every SM), recorded as
``ceiling`` beside each row's dense-equivalent TFLOPS and cuBLAS's: how far the GEMM stands from what its MMA allows,
and whether that MMA can beat cuBLAS's ``wgmma`` at all. On Hopper also the ``wgmma`` form (``WGMMA_TILES`` with each
number of ``--wgmma-stages``; up to 64 tokens also its decode tiles, ``WGMMA_DECODE_TILES``, and up to 16 those
reading a random map themselves, ``"mapped": true``, checked against ``x[:, perm] @ Wᵀ``), its rows marked
``"wgmma": true`` in their plan.

    python scripts/tune_sparse_gemm.py                 # → scripts/results/tune_sparse_gemm.json
    python scripts/tune_sparse_gemm.py --smoke         # CPU: tiny shapes on the tests' emulator (g++)
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from kernel_cases import add_timing_args  # noqa: E402  (scripts/, this script's folder, is on the path)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=[f"{o}x{i}" for o, i in SHAPES], help="weights as OUTxIN")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4], help="stages of 64 columns in flight")
    ap.add_argument("--wgmma-stages", type=int, nargs="+", default=[4, 5],
                    help="stages of the wgmma form (Hopper; 2 fewer copies in flight)")
    ap.add_argument("--splits", type=int, nargs="+", default=[0],
                    help="CTAs along K (0: what the plan splits that tile into to fill the GPU)")
    ap.add_argument("--layouts", nargs="+", default=["tiled"], choices=["rows", "tiled"])
    ap.add_argument("--probe", action="store_true",
                    help="run the layout probe on every tile, not only on those whose output is refused")
    add_timing_args(ap, ROOT / "scripts" / "results" / "tune_sparse_gemm.json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from kernel_cases import (REFUSED_REL_ERR, checked_launch, checked_timing, dense_ms, hung_marker, random_24_layer,
                              rotated_copies, run_facts, timing_setup)
    from shuffleprune.deploy.cslt_layout import cslt_words
    from shuffleprune.kernels.gpu import smem_per_block_optin
    from shuffleprune.kernels.nm_sparse_gemm import nm_sparse_gemm, sparse_wgmma_available
    from shuffleprune.kernels.sparse_gemm_tiles import (GEMM_TILES, WGMMA_DECODE_MAX_TOKENS, WGMMA_DECODE_TILES,
                                                        WGMMA_MAPPED_MAX_TOKENS, WGMMA_TILES, SparseGemmPlan,
                                                        check_gemm_plan, filling_splits, gemm_traffic, plan_fields,
                                                        sparse_gemm_plan, staged_within_limit, whole_splits)
    from shuffleprune.kernels.nm_sparse_mma import fragment_reading
    from shuffleprune.deploy.auto_choice import relative_error

    dev, cuda, shapes, l2, sms = timing_setup(args, [(128, 256)])
    if args.smoke:   # the kernel's text on the CPU, under the tests' emulator
        from sparse_gemm_cpu import run_gemm_cpu
        args.tokens, args.stages, args.splits, args.wgmma_stages = [5, 40], [2, 3], [0, 2], [3]
    dtype = torch.bfloat16
    shared_limit = smem_per_block_optin(dev)
    gen = torch.Generator().manual_seed(0)
    rows, best = [], []
    ceiling = None
    if cuda:
        from mma_ceiling import measure

        ceiling = measure(dev, wgmma=False)   # the mma kinds only (the GEMM's own MMA); wgmma: mma_ceiling.py
        print("ceiling", json.dumps(ceiling), flush=True)
    out = Path(args.out) if cuda else Path(args.out).with_name("tune_sparse_gemm_smoke.json")
    hung_marker(out).unlink(missing_ok=True)   # an earlier run's

    def save() -> None:
        out.write_text(json.dumps({
            "what": "the prompt GEMM on the sparse tensor cores against cuBLAS (bf16, gathered input, rotating weight "
                    "copies, CUDA graphs; rel_err: max |y - dense| / max |dense| of a dense bf16 matmul)",
            **run_facts(args.smoke, cuda), "reading": sorted(fragment_reading()), "ceiling": ceiling, "best": best,
            "rows": rows},
            indent=1) + "\n")

    probed = set()

    def probe(plan: SparseGemmPlan, tiled: bool) -> dict | None:
        """The layout probe (``layout_probe.py``) on this plan's tile, once per tile and form: which weight element and
        input column the kernel paired for each output, where its output was refused."""
        from dataclasses import asdict

        from layout_probe import layout_probe
        from shuffleprune.deploy.format import compress
        from shuffleprune.kernels.nm_words import position_words

        key = (plan.mt, plan.nt, plan.wm, plan.wn, plan.wgmma, plan.mapped, tiled)
        if key in probed:
            return None
        probed.add(key)
        cols = 256
        small = whole_splits(SparseGemmPlan(**{**asdict(plan), "splits": min(plan.splits, 2)}), cols)
        pm = torch.randperm(cols, generator=torch.Generator().manual_seed(1)).to(torch.int32) if plan.mapped else None

        def run(w, xp):
            values, meta = compress(w, 2, 4)
            words = position_words(meta)
            words = (cslt_words(words) if tiled else words).contiguous()
            if not cuda:
                return run_gemm_cpu(xp, values, words, None, tiled, small, perm=pm)
            return nm_sparse_gemm(xp.to(dev), values.to(dev), words.to(dev), None, tiled=tiled, plan=small,
                                  **({"perm": pm.to(dev)} if pm is not None else {}))

        try:
            return {"plan": plan_fields(small), **layout_probe(run, small.bm, cols, min(small.bn, cols), dtype, pm)}
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run: said so in the row
            return {"error": str(exc).splitlines()[0][:200]}

    wgmma_here = not cuda or sparse_wgmma_available(dev)   # Hopper; the CPU's emulator runs it too
    for (out_f, in_f), tokens in itertools.product(shapes, args.tokens):
        w, values, words, x = random_24_layer(out_f, in_f, tokens, gen, dtype)
        w_dev, x_dev = w.to(dev), x.to(dev)
        want = F.linear(x_dev, w_dev).float()
        # (tile, stages, wgmma, mapped) of every form timed: mma.sp's tiles; the wgmma ones (up to 64 tokens its
        # decode's too); up to 16 the decode reading a random map itself, checked against x[:, perm] @ W^T
        forms = [(tile, stages, False, False) for tile in GEMM_TILES for stages in args.stages]
        mapped_forms = []
        if wgmma_here:
            decode_tiles = [*WGMMA_DECODE_TILES.values()] if tokens <= WGMMA_DECODE_MAX_TOKENS else []
            wg_tiles = [*WGMMA_TILES, *decode_tiles]
            forms += [(tile, stages, True, False) for tile in wg_tiles for stages in args.wgmma_stages]
            mapped_forms = [(tile, stages, True, True) for bn, tile in WGMMA_DECODE_TILES.items()
                            if tokens <= bn <= WGMMA_MAPPED_MAX_TOKENS for stages in args.wgmma_stages]
        if mapped_forms:
            forms += mapped_forms
            perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(in_f)).to(torch.int32)
            perm_dev = perm.to(dev)
            want_mapped = F.linear(x_dev[:, perm_dev.long()], w_dev).float()
        n_copies = rotated_copies(values, l2, cuda)
        dense = dense_ms(x_dev, w_dev, n_copies, args.reps) if cuda else None
        rows.append({"shape": [out_f, in_f], "tokens": tokens, "impl": "dense", "ms": dense,
                     "tflops": 2 * tokens * out_f * in_f / dense / 1e9 if dense else None})
        planned = {sparse_gemm_plan(tokens, out_f, in_f, sms, shared_limit)}
        if wgmma_here:
            planned.add(sparse_gemm_plan(tokens, out_f, in_f, sms, shared_limit, wgmma=True))
        for layout in args.layouts:
            tiled = layout == "tiled"
            lw = (cslt_words(words) if tiled else words).contiguous()
            copies = [(values.to(dev), lw.to(dev))]
            copies += [(copies[0][0].clone(), copies[0][1].clone()) for _ in range(n_copies - 1)]
            case = []
            seen = set()
            for (tile, stages, wgmma, mapped), splits in itertools.product(forms, args.splits):
                plan = SparseGemmPlan(*tile, stages=stages, wgmma=wgmma, mapped=mapped)
                plan = filling_splits(plan, tokens, out_f, in_f, sms) if splits == 0 else \
                    whole_splits(SparseGemmPlan(*tile, stages=stages, splits=splits, wgmma=wgmma, mapped=mapped),
                                 in_f)
                plan = staged_within_limit(plan, in_f)   # a mapped plan's input fits, as the planner splits it
                run_map = {"perm": perm_dev} if mapped else {}
                if plan in seen:
                    continue
                seen.add(plan)
                row = {"shape": [out_f, in_f], "tokens": tokens, "impl": "sparse_gemm", "layout": layout,
                       "plan": plan_fields(plan), "planned": plan in planned, "grid": list(plan.grid(tokens, out_f)),
                       "traffic_mb": round(gemm_traffic(plan, tokens, out_f, in_f) / 1e6, 1)}
                label = {"kernel": "sparse_gemm", "shape": [out_f, in_f], "tokens": tokens, "layout": layout,
                         "plan": plan_fields(plan)}   # what a hung marker names
                try:
                    check_gemm_plan(plan, out_f, in_f, shared_limit)
                    if cuda:   # a launch that never finishes ends the process, named in the hung marker
                        y = checked_launch(lambda: nm_sparse_gemm(x_dev, *copies[0], None, tiled=tiled, plan=plan,
                                                                  **run_map), label, out)
                    else:
                        y = run_gemm_cpu(x, values, lw, None, tiled, plan, perm=perm if mapped else None)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit, compile or run: recorded
                    rows.append({**row, "ms": None, "error": str(exc).splitlines()[0][:200]})
                    continue
                ref = want_mapped if mapped else want
                err = relative_error(y, ref)
                row["rel_err"] = err
                if err >= REFUSED_REL_ERR or args.probe:   # refused (or asked): the elements the kernel paired
                    found = probe(plan, tiled)
                    if found is not None:
                        row["probe"] = found
                if cuda and err < REFUSED_REL_ERR:
                    replayed: list = []   # the last two calls as the graph left them (split-K's counters reused)
                    row["ms"] = checked_timing([lambda c=c: nm_sparse_gemm(x_dev, *c, None, tiled=tiled, plan=plan,
                                                                           **run_map)
                                                for c in copies], args.reps, label, out, replayed)   # hung: named
                    row["replayed_rel_err"] = max(relative_error(o, ref) for o in replayed)
                    row["speedup_vs_dense"] = dense / row["ms"]
                    row["tflops_dense_equiv"] = 2 * tokens * out_f * in_f / row["ms"] / 1e9
                    case.append(row)
                rows.append(row)
                print(out_f, in_f, tokens, layout, tile, stages, plan.splits, "planned" if row["planned"] else "",
                      f"err {err:.1e}", f"{row.get('ms') or 0:.4f} ms", f"x{row.get('speedup_vs_dense') or 0:.2f}",
                      flush=True)
            if case:
                top = min(case, key=lambda r: r["ms"])
                best.append({k: top[k] for k in ("shape", "tokens", "layout", "plan", "planned", "ms",
                                                 "speedup_vs_dense", "tflops_dense_equiv")})
        save()
    save()


if __name__ == "__main__":
    main()
