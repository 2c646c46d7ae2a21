"""Run one decode case repeatedly for Nsight Compute (``scripts/gpu_run.sh profile``): a random 2:4
bf16 weight of ``--shape`` on the gathered input of ``--tokens`` tokens, ``--kernel`` ``select``,
``dot``, ``swap`` (``nm_decode`` forced onto that kernel, unsplit; swap: the tensor-core kernel with
the weight as the MMA's A operand), ``swap_tma`` (swap with its weight tiles copied by the Tensor Memory
Accelerator, ``tma=True``), ``swap_spread`` (swap with its tile expanded by broadcasts, ``spread=True``),
``sparse_mma`` (the sparse-tensor-core decode, ``kernels/nm_sparse_mma.cu``, as planned), ``sparse_mma_tall`` (the
same with ``tall_plan``'s CTAs: the input staged in a shared-memory ring), ``sparse_gemm`` (the prompt GEMM on the
sparse tensor cores, ``kernels/nm_sparse_gemm.cu``, as planned) or ``dense`` (``F.linear``
on the dense weight). Setup runs first; only the timed calls lie inside the CUDA profiler range that
``ncu --profile-from-start off`` captures.

    ncu --profile-from-start off --launch-skip 3 --launch-count 1 python scripts/profile_decode.py --kernel dot --tokens 16
"""
from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="11008x4096", help="OUTxIN")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--kernel", choices=["select", "dot", "swap", "swap_tma", "swap_spread", "sparse_mma",
                                         "sparse_mma_tall", "sparse_gemm", "dense"],
                    default="select")
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from shuffleprune.deploy.format import compress, meta_bits
    from shuffleprune.deploy.auto_choice import relative_error
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_words import position_words
    from shuffleprune.masks import nm_keep_mask

    rows, cols = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=gen).cuda()
    w = (w * nm_keep_mask(w.abs(), 2, 4)).to(torch.bfloat16)
    values, meta = compress(w, 2, 4)
    words = position_words(meta)
    x = torch.randn(args.tokens, cols, generator=gen).cuda().to(torch.bfloat16)

    def call() -> torch.Tensor:
        if args.kernel == "dense":
            return F.linear(x, w)
        if args.kernel == "sparse_gemm":
            from shuffleprune.kernels.nm_sparse_gemm import nm_sparse_gemm

            return nm_sparse_gemm(x, values, words)
        if args.kernel.startswith("sparse_mma"):
            from shuffleprune.kernels.nm_sparse_mma import nm_sparse_mma

            return nm_sparse_mma(x, values, words, tall=args.kernel == "sparse_mma_tall")
        tma = {"tma": True} if args.kernel == "swap_tma" else {"spread": True} if args.kernel == "swap_spread" else {}
        return nm_decode(x, values, words, 2, 4, meta_bits(4), None, None, use_dot=args.kernel != "select", split=1,
                         weight_a=args.kernel.startswith("swap"), **tma)

    ref = F.linear(x.float(), w.float())
    y = call()  # compiles
    torch.cuda.synchronize()
    err = relative_error(y, ref)
    print(f"{args.kernel} {args.shape} t={args.tokens}: max rel err {err:.2e}", flush=True)
    torch.cuda.profiler.start()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
