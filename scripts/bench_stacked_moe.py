"""One experts layer kept in a model's own layout (Llama 4's), dense against 2:4 as ``shuffleprune.load`` serves it.

    python3 scripts/bench_stacked_moe.py            # CUDA, Llama-4-Scout's layer → scripts/results/bench_stacked_moe.json
    python3 scripts/bench_stacked_moe.py --smoke    # CPU, a tiny layer: checks the code path only (no results file)

A transformers ``Llama4TextExperts`` layer (``--experts`` × hidden ``--hidden`` × intermediate ``--inter``,
bf16 on CUDA; its forward runs every token through every expert with one ``torch.bmm`` per
projection, the router weight folded into the input, zero for the experts a token did not pick),
every expert's matrices pruned 2:4 by magnitude. Dense: the pruned weights in its own parameters, its
own forward. Sparse: the experts found by tracing the layer (``stacked_experts.MatmulTrace``),
compressed per expert and attached as an export's are (``attach_sparse_experts`` with a ``stacked``
entry: a meta stand-in, ``StackedProducts`` around the layer's forward), run ``nm_loop`` (each
expert's ``SparseLinear``, ``auto`` kernel choice), ``nm_grouped`` (one grouped launch per
projection over every (expert, row) pair) and ``nm_auto`` (grouped on CUDA up to 16 rows per
expert, else the loop); ``nm_grouped_mapped`` adds a random block index map per expert (each
expert then pruned 2:4 in its map's order). Routing: each token picks ``top_k`` experts uniformly
at random with sigmoid weights (seed ``--seed``). Timing: ``--calls`` calls captured into one CUDA
graph where they can be (``timing``: ``cuda_graph``, else ``events``), median of ``--runs``, after a
warm-up that makes the layers' kernel choices. Each row records the maximum relative error against
the dense output of the same weights; ``bytes`` holds each layer's parameters and buffers.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import moe_args, moe_row, save_moe_results  # noqa: E402  (the experts benchmarks' command line and files)


def main() -> None:
    args = moe_args(__doc__, experts=16, top_k=1, hidden=5120, inter=8192, out="bench_stacked_moe.json")

    import torch
    from torch import nn
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from shuffleprune.blocks import experts_by_tensor
    from shuffleprune.deploy.experts_export import compress_experts
    from shuffleprune.deploy.experts_load import attach_sparse_experts
    from shuffleprune.deploy.sparse_experts import set_experts_mode
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.perm.core import random_block_perm
    from shuffleprune.runtime.memory import module_bytes
    from shuffleprune.runtime.timing import cuda_graph_ms
    from shuffleprune.stacked_experts import MatmulTrace, stacked_experts

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(args.seed)
    config = Llama4TextConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts)
    dense = Llama4TextExperts(config)

    def experts_of(layer: nn.Module) -> dict:
        """The layer's experts as a trace of its own forward finds them."""
        trace = MatmulTrace()
        with trace.watch(layer), torch.no_grad():
            layer(torch.randn(args.experts * 2, args.hidden, device=next(layer.parameters()).device,
                              dtype=next(layer.parameters()).dtype))
        return stacked_experts(layer, "", trace)

    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        unpruned = {name: p.detach().clone() for name, p in dense.named_parameters()}
        for expert in experts_of(dense).values():   # every expert 2:4 by magnitude
            expert.weight.mul_(nm_keep_mask(expert.weight.abs(), 2, 4))
    dense.to(device, dtype)

    def sparse_copy(mapped: bool) -> tuple[nn.Module, nn.Module]:
        """The layer as an export's stacked experts load (each expert 2:4 in its random map's order
        when ``mapped``), and the dense layer with the same weights (its reference)."""
        model = copy.deepcopy(dense)
        tensors, entries = {}, {}
        with torch.no_grad():
            for name, experts in experts_by_tensor(experts_of(model)).items():
                maps = {}
                if mapped:
                    for e, expert in experts.items():
                        maps[e] = perm = random_block_perm(expert.in_features, 64, gen).to(device)
                        w = unpruned[name][e]
                        w = (w if not expert.transposed else w.t()).to(device, dtype)[:, perm]
                        expert.weight[:, perm] = w * nm_keep_mask(w.abs().float(), 2, 4).to(dtype)
                compressed, entries[name] = compress_experts(name, experts, 2, 4, maps)
                tensors.update(compressed)
        reference = copy.deepcopy(model)
        attach_sparse_experts(model, tensors, {"n": 2, "m": 4, "experts": entries})
        return model, reference

    nm, _ = sparse_copy(False)
    nm_mapped, nm_mapped_reference = sparse_copy(True)
    layers = {"dense": (dense, None, dense), "nm_loop": (nm, "loop", dense), "nm_grouped": (nm, "grouped", dense),
              "nm_auto": (nm, "auto", dense), "nm_grouped_mapped": (nm_mapped, "grouped", nm_mapped_reference)}
    nbytes = {name: module_bytes(m) for name, (m, _, _) in layers.items()}

    def timed_ms(fn) -> tuple[float, str]:
        if device.type != "cuda":
            fn()
            return float("nan"), "none"
        return cuda_graph_ms([fn] * args.calls, args.runs, warm=3)   # eagerly ("events") where capture fails

    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            scores = torch.zeros(tokens, args.experts)
            top = torch.rand(tokens, args.experts, generator=gen).topk(args.top_k, dim=-1).indices
            scores.scatter_(1, top, torch.sigmoid(torch.randn(tokens, args.top_k, generator=gen)))
            x = torch.randn(tokens, args.hidden, generator=gen)
            routed = (x.repeat(args.experts, 1) * scores.t().reshape(-1, 1)).to(device, dtype)
            for name, (layer, mode, reference) in layers.items():
                if mode is not None:
                    set_experts_mode(layer, mode)
                want = reference(routed)
                call = lambda layer=layer: layer(routed)  # noqa: E731
                for _ in range(3):   # warm-up: compiles kernels and makes the layers' choices
                    got = call()
                ms, how = timed_ms(call)
                rows.append(moe_row(args, tokens, name, ms, how, got, want))
                print(rows[-1], flush=True)
            save_moe_results(args, __doc__, dtype, nbytes, rows, complete=False)   # kept if the step is cut off
    save_moe_results(args, __doc__, dtype, nbytes, rows)


if __name__ == "__main__":
    main()
