"""Measure the Triton 2:4 kernels' tile sizes on a GPU: for each LLaMA-2-7B linear shape and token
count, every (``block_r``, ``block_k``, ``num_warps``) in the grid — and for the decode variants
(``kernels/nm_decode.py``: ``decode`` as planned, ``select`` and ``dot`` forcing the select or the
tensor-core kernel, ``swap`` the tensor-core kernel with the weight as the MMA's A operand,
``swap_tma`` the same with its weight tiles copied by the Tensor Memory Accelerator (2:4, 16-bit, at least 64
kept values per step), ``swap_spread`` the same with its 2:4 tile expanded by broadcasts (``spread``: read
straight into the MMA's operand layout),
``mapped`` the planned kernel reading the index map itself, ``mapped_sync`` the same with the map's gather
one step ahead in registers instead of the pipeline's word copies; each also as ``…_launch``, split-K's
partial sums added by a second kernel instead of the last split; ``decode_pdl``, ``swap_pdl`` and
``mapped_pdl`` launched as programmatic dependents, each ``--prefetch-mb`` budget of weight prefetched
before the input is ready) every pipeline depth in ``--stages``;
for the prefill ``gemm`` / ``gemm_swap`` / ``gemm_swap_tall`` every tile of ``nm_gemm.GEMM_TILES[(2, 4)]`` /
``GEMM_TILES_SWAP[(2, 4)]`` / ``GEMM_TILES_SWAP_TALL[(2, 4)]`` (and ``--gemm-tiles``), unsplit, with the tile ``gemm_plan``'s cost model picks marked —
is checked against the dense result and timed: calls over rotating weight copies (together more
than 2.5× the L2, so no call finds its weight there) captured in one CUDA graph, the median replay
over the calls, as ``bench_kernel.py`` times (``triton.testing.do_bench`` timed each call after an
L2 flush, so the host's launch cost — tens of microseconds for these small kernels — set the
numbers). The decode variants but ``mapped*`` read the gathered input (no map: how ``SparseLinear`` runs them) and
also sweep ``--splits`` (``0`` = the plan's). The table of medians and the best tile per case go to
``scripts/results/tune_kernel.json``.

    python scripts/tune_kernel.py            # on a CUDA machine
    python scripts/tune_kernel.py --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes: checks the code path only
    python scripts/tune_kernel.py --variants select --tokens 1 2 --block-r 16 32 --block-k 128 256 \
        --num-warps 4 8 --out scripts/results/tune_select.json               # decode_plan's choices
    python scripts/tune_kernel.py --variants dot --tokens 2 16 32 64 --block-r 32 64 128 --block-k 64 128 \
        --num-warps 4 8 --max-tile 524288 --out scripts/results/tune_dot.json
    python scripts/tune_kernel.py --variants gemm --tokens 64 128 256 512 2048 --out scripts/results/tune_gemm.json

A ``0`` in ``--block-r``, ``--block-k`` or ``--num-warps`` takes ``decode_plan``'s value.

Tiles whose ``block_r × block_k × tokens-tile`` product exceeds ``--max-tile`` values are skipped (they
spill registers and take long to compile).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # [out, in]
# nm_decode variants: the plan's kernel, one forced, the tensor-core one with the weight as the MMA's A
# operand (swap), and the plan's kernel reading the index map itself (mapped: the map's in-kernel cost;
# mapped_sync: its gather one step ahead in registers, not as the pipeline's asynchronous word copies)
DECODE = {"decode": {}, "select": {"use_dot": False}, "dot": {"use_dot": True}, "swap": {"use_dot": True, "weight_a": True},
          "swap_tma": {"use_dot": True, "weight_a": True, "tma": True},
          "swap_spread": {"use_dot": True, "weight_a": True, "spread": True},
          "mapped": {}, "mapped_sync": {"async_gather": False}}
# ..._launch: the same with split-K's partial sums added by a second kernel, not by the last split in the kernel
DECODE.update({f"{name}_launch": {**kw, "sum_in_kernel": False} for name, kw in list(DECODE.items())})
# ..._pdl: launched as programmatic dependents (kernels/overlap.py), each --prefetch-mb budget in turn: every call
# starts while the previous copy's call ends and prefetches that many MiB of its weight into L2 first
DECODE.update({f"{name}_pdl": {**DECODE[name], "pdl": True} for name in ("decode", "swap", "mapped")})
NM_DECODE_ONLY = ("async_gather", "sum_in_kernel", "pdl")   # nm_decode's own arguments, not decode_plan's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--shapes", nargs="+", default=[f"{o}x{i}" for o, i in SHAPES], help="weights as OUTxIN")
    ap.add_argument("--variants", nargs="+", default=["group", "gather"])
    ap.add_argument("--block-r", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[4], help="decode variant: software-pipeline depths")
    ap.add_argument("--splits", type=int, nargs="+", default=[0], help="decode variants: split-K (0 = the plan's)")
    ap.add_argument("--prefetch-mb", type=float, nargs="+", default=[8],
                    help="…_pdl variants: MiB of weight a launch prefetches before its input is ready (0: none)")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per case (median taken)")
    ap.add_argument("--max-tile", type=int, default=2**15)
    ap.add_argument("--gemm-tiles", nargs="*", default=[], help="gemm variant: more tiles, as block_t,block_r,block_c,warps,stages")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "tune_kernel.json"))
    args = ap.parse_args()
    if args.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.tokens, args.block_r, args.block_k, args.num_warps = [1, 3, 16], [8, 16], [64], [4]
        args.stages = args.stages[:1]

    import torch
    import torch.nn.functional as F

    from shuffleprune.kernels import overlap
    from shuffleprune.kernels.gpu import l2_bytes, next_pow2
    from shuffleprune.kernels.decode_tiles import decode_plan
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.deploy.impls import GEMM_KERNELS as GEMMS   # nm_gemm's options per GEMM variant
    from shuffleprune.kernels.nm_gemm import gemm_plan, gemm_tiles, nm_decompress_into, nm_gemm
    from shuffleprune.kernels.nm_words import position_words
    from shuffleprune.kernels.nm_matmul import nm_gather_matmul
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.runtime.facts import machine, versions
    from shuffleprune.runtime.timing import cuda_graph_ms
    from shuffleprune.deploy.format import compress, meta_bits

    from kernel_cases import rotated_copies, timing_device

    dev = timing_device(args.smoke)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16   # as served (the smoke too: the TMA decode takes 16-bit weights only)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if cuda else [(96, 64), (64, 160), (80, 256)]

    l2 = l2_bytes(dev)

    def median_ms(fn, copies: list) -> float:
        """GPU time of one call: ``fn(values, words)`` over every copy, captured in one CUDA graph
        (no launch cost), the median of ``--reps`` replays per call."""
        if not cuda:
            fn(*copies[0])
            return 0.0
        return cuda_graph_ms([lambda c=c: fn(*c) for c in copies], args.reps)[0]

    gen = torch.Generator().manual_seed(0)
    rows, best = [], []
    out = Path(args.out) if cuda else Path(args.out).with_name("tune_kernel_smoke.json")

    def save() -> None:
        result = {"what": "Triton 2:4 kernel tile sweep (bf16; decode on the gathered input, the others through "
                          "a random index map; rotating weight copies, CUDA graphs)", "seed": 0,
                  "device": torch.cuda.get_device_name() if cuda else "cpu (smoke: TRITON_INTERPRET=1)",
                  "command": " ".join([Path(sys.executable).name, *sys.argv]),
                  "machine": machine(), "versions": versions("triton"), "best": best, "rows": rows}
        out.write_text(json.dumps(result, indent=1))
    for (out_f, in_f), tokens in itertools.product(shapes, args.tokens):
        w = torch.randn(out_f, in_f, generator=gen)
        w = (w * nm_keep_mask(w.abs(), 2, 4)).to(dtype)
        values, meta = compress(w, 2, 4)
        values, meta, perm = values.to(dev), meta.to(dev), torch.randperm(in_f, generator=gen).to(dev, torch.int32)
        words = position_words(meta)
        n_copies = rotated_copies(values, l2, cuda)
        copies = [(values, words)] + [(values.clone(), words.clone()) for _ in range(n_copies - 1)]
        x, w_dev = torch.randn(tokens, in_f, generator=gen).to(dev, dtype), w.to(dev)
        want = F.linear(x[:, perm.long()].float(), w_dev.float())
        dense_copies = [(w_dev, None)] + [(w_dev.clone(), None) for _ in range(max(4, n_copies // 2) - 1)] if cuda \
            else [(w_dev, None)]
        dense_ms = median_ms(lambda wd, _: F.linear(x, wd), dense_copies)
        del dense_copies
        case = []
        xp = x[:, perm.long()].contiguous()
        scratch = torch.empty(out_f * in_f, dtype=dtype, device=dev) if "decompress" in args.variants else None
        configs = []   # (variant, block_r, block_k, num_warps, stages, split, gemm tile)
        for variant in args.variants:
            if variant in GEMMS:
                tiles = [t[0] for t in gemm_tiles(**GEMMS[variant])[(2, 4)]] + [tuple(int(v) for v in t.split(",")) for t in args.gemm_tiles]
                configs += [(variant, None, None, None, None, 0, tile, None) for tile in tiles]
            elif variant in DECODE:
                budgets = args.prefetch_mb if DECODE[variant].get("pdl") else [None]
                configs += [(variant, *c, None, mb) for *c, mb in
                            itertools.product(args.block_r, args.block_k, args.num_warps, args.stages, args.splits,
                                              budgets)]
            else:
                configs += [(variant, *c, 0, None, None) for c in
                            itertools.product(args.block_r, args.block_k, args.num_warps, args.stages)]
        modelled = {v: gemm_plan(tokens, out_f, in_f, 2, 4, meta_bits(4), dev, x.element_size(), **options)[0]
                    for v, options in GEMMS.items()}
        for variant, br, bk, nw, st, sp, gtile, mb in configs:
            decode = variant in DECODE
            if gtile is not None:
                def run(values=values, words=words, gtile=gtile, swap=GEMMS[variant].get("weight_a", False)):
                    return nm_gemm(xp, values, words, 2, 4, meta_bits(4), None, tile=gtile, weight_a=swap)
                tile = {"tile": list(gtile), "modelled": gtile == modelled[variant]}
            else:
                plan_args = {k: v for k, v in DECODE.get(variant, {}).items() if k not in NM_DECODE_ONLY}
                block_t = (decode_plan(out_f, values.shape[1], tokens, 2, 4, meta_bits(4), dev, **plan_args)["block_t"]
                           if decode else min(16, next_pow2(tokens)))   # the kernel's token tile
                if br * bk * block_t > args.max_tile or (not decode and st != args.stages[0]):
                    continue

                def run(values=values, words=words, br=br, bk=bk, nw=nw, st=st, sp=sp, variant=variant, mb=mb):
                    if mb is not None:   # read by nm_decode at each call (also while a CUDA graph is captured)
                        overlap.decode_prefetch_bytes = lambda tokens, budget=int(mb * 2**20): budget
                    if variant == "decompress":   # the scratch's fill, then the dense product of the scratch
                        dense = nm_decompress_into(values, words, 2, 4, meta_bits(4), in_f, scratch, br, bk, nw)
                        return F.linear(xp, dense)
                    if variant in DECODE:
                        inp, imap = (x, perm) if variant.startswith("mapped") else (xp, None)
                        return nm_decode(inp, values, words, 2, 4, meta_bits(4), imap, None, num_warps=nw, block_r=br,
                                         block_k=bk, stages=st, split=sp or None, **DECODE[variant])
                    return nm_gather_matmul(x, values, meta, 2, 4, meta_bits(4), perm, None, br, bk, nw, variant)
                tile = {"block_r": br, "block_k": bk, "num_warps": nw,
                        **({"stages": st, "split": sp} if decode else {}),
                        **({"prefetch_mb": mb} if mb is not None else {})}
            try:
                y = run()
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile (e.g. out of shared memory)
                rows.append({"shape": [out_f, in_f], "tokens": tokens, "variant": variant, **tile, "ms": None,
                             "error": str(exc).splitlines()[0][:160]})
                continue
            err = float((y.float() - want).norm() / want.norm())
            ms = median_ms(run, copies) if err < 1e-2 else None
            row = {"shape": [out_f, in_f], "tokens": tokens, "variant": variant, **tile, "ms": ms, "rel_err": err}
            rows.append(row)
            if ms is not None:
                case.append(row)
        for variant in args.variants:
            mine = [r for r in case if r["variant"] == variant]
            top = min(mine, key=lambda r: r["ms"]) if mine else None
            best.append({"shape": [out_f, in_f], "tokens": tokens, "variant": variant, "dense_ms": dense_ms, "best": top,
                         "speedup_vs_dense": round(dense_ms / top["ms"], 3) if top and top["ms"] else None})
            what = top and (top.get("tile") or (top['block_r'], top['block_k'], top['num_warps'], top.get('stages'),
                                                top.get('split')))
            print(f"{out_f}x{in_f} t={tokens} {variant}: dense {dense_ms:.4f} ms, "
                  + (f"best {top['ms']:.4f} ms {what}" if top else "no tile ran"), flush=True)
        save()   # after every case: a sweep cut off by its time limit keeps what it measured
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
