"""One MoE experts layer, dense against 2:4 as ``shuffleprune.load`` runs an export's experts.

    python3 scripts/bench_moe.py            # CUDA, Mixtral-8x7B's layer → scripts/results/bench_moe.json
    python3 scripts/bench_moe.py --smoke    # CPU, a tiny layer: checks the code path only (no results file)

A transformers ``MixtralExperts`` layer (``--experts`` × hidden ``--hidden`` × intermediate ``--inter``,
bf16 on CUDA), every expert's matrices pruned 2:4 by magnitude. Dense: the pruned weights in the fused
tensors, run by transformers' ``grouped_mm`` and ``eager`` experts forwards. Sparse: the same weights
compressed per expert and attached as an export's are (``attach_sparse_experts``: one stacked
``SparseExperts`` per projection, the ``shuffleprune_nm`` experts forward), run two ways: ``nm_loop``,
the per-expert loop (each expert's ``SparseLinear``, ``auto`` kernel choice), and ``nm_grouped``, one
launch of the grouped kernel per projection (``kernels/nm_experts.py``), and ``nm_auto``, what
``auto`` measured faster at that token count (``choice``); each again with a random
block index map per expert (``…_mapped``; each expert then pruned 2:4 in its map's order), and
``nm_grouped_mapped_in_kernel``: the grouped kernel reading those maps itself instead of after one
gather of every pair's input (``SparseExperts.gather_first``; before 2026-11-28 the only way). Routing:
each token picks ``top_k`` distinct experts uniformly at random, softmax weights (seed ``--seed``).
Timing: forwards that wait on the host (the loops group tokens with a host synchronisation) are timed
eagerly, CUDA events around ``--calls`` calls, median of ``--runs``, after a warm-up that also makes
``auto``'s choices; ``nm_grouped*`` and ``dense_grouped_mm`` are captured into one CUDA graph of
``--calls`` calls where they can be (``timing`` says which: ``cuda_graph`` or ``events``), as a decode
step served with CUDA graphs runs them. The fused weights are far larger than L2 (2.8 GB dense for
Mixtral's layer), so no copies rotate. Each row records the maximum relative error against the dense
eager output of the same weights; ``bytes`` holds each layer's parameters and buffers. Last, the
routing alone at the token counts a decode step has (``route_kernel``, one launch, against
``route_torch``, PyTorch's ops), captured likewise.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def moe_args(doc: str, experts: int, top_k: int, hidden: int, inter: int, out: str) -> argparse.Namespace:
    """The command line of an experts-layer benchmark (defaults: the layer's real shape); ``--smoke``
    shrinks it to a tiny layer on the CPU, the grouped kernel interpreted."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--experts", type=int, default=experts)
    ap.add_argument("--top-k", type=int, default=top_k)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--inter", type=int, default=inter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / out))
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.inter, args.experts, args.tokens, args.calls, args.runs = 64, 128, 4, [1, 5, 40], 1, 1
        os.environ.setdefault("TRITON_INTERPRET", "1")   # the grouped kernel on the CPU: interpreted
    return args


def moe_row(args: argparse.Namespace, tokens: int, impl: str, ms: float, how: str, got, want) -> dict:
    """One timed row of an experts-layer benchmark."""
    from shuffleprune.deploy.auto_choice import relative_error
    from shuffleprune.runtime.facts import machine

    return {"shape": f"{args.experts}x({2 * args.inter}x{args.hidden}+{args.hidden}x{args.inter})",
            "tokens": tokens, "impl": impl, "ms": round(ms, 4), "timing": how,
            "rel_err": float(relative_error(got, want)), "device": machine().get("gpu", "cpu")}


def save_moe_results(args: argparse.Namespace, doc: str, dtype, nbytes: dict, rows: list[dict],
                     complete: bool = True) -> None:
    """Write the benchmark's results file (machine, versions, command, config, ``complete``: whether every
    token count ran; the benchmarks write it after each, so a step cut off by its time limit keeps what
    it measured); a smoke run writes none."""
    from shuffleprune.runtime.facts import machine, versions

    if args.smoke:
        if complete:
            print("smoke: every implementation ran; no results written")
        return
    result = {"what": doc.splitlines()[0], "complete": complete, "command": " ".join(["python3", *sys.argv]),
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "smoke")}, "dtype": str(dtype),
              "bytes": nbytes, "machine": machine(), "versions": versions("triton"), "rows": rows}
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)   # never a half-written file
    print(f"wrote {args.out}" + ("" if complete else " (so far)"), flush=True)


def main() -> None:
    args = moe_args(__doc__, experts=8, top_k=2, hidden=4096, inter=14336, out="bench_moe.json")

    import torch
    from torch import nn
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from shuffleprune.blocks import block_experts, experts_by_tensor
    from shuffleprune.deploy.experts_export import compress_experts
    from shuffleprune.deploy.experts_load import attach_sparse_experts
    from shuffleprune.deploy.sparse_experts import experts_mode, set_experts_mode
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.perm.core import random_block_perm
    from shuffleprune.runtime.memory import module_bytes
    from shuffleprune.runtime.timing import cuda_graph_ms, eager_ms

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(args.seed)
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts,
                           num_experts_per_tok=args.top_k)
    config._experts_implementation = "eager"
    dense = nn.Module()
    dense.experts = MixtralExperts(config)
    with torch.no_grad():
        for p in dense.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        fused_unpruned = {name: p.detach().clone() for name, p in dense.experts.named_parameters()}
        for expert in block_experts(dense, "").values():   # every expert 2:4 by magnitude
            expert.weight.mul_(nm_keep_mask(expert.weight.abs(), 2, 4))
    dense.to(device, dtype)

    def own_copy(implementation: str = "eager") -> nn.Module:
        model = copy.deepcopy(dense)
        model.experts.config = copy.deepcopy(config)
        model.experts.config._experts_implementation = implementation
        return model

    def sparse_copy(mapped: bool) -> tuple[nn.Module, nn.Module]:
        """The layer as an export's experts load (each expert 2:4 in its random map's order when
        ``mapped``), and the dense layer with the same weights (its reference)."""
        model = own_copy()
        tensors, entries = {}, {}
        with torch.no_grad():
            for name, experts in experts_by_tensor(block_experts(model, "")).items():
                maps = {}
                if mapped:   # each expert pruned 2:4 in its own random map's order instead
                    unpruned = fused_unpruned[name.rpartition(".")[2]]
                    for e, expert in experts.items():
                        maps[e] = perm = random_block_perm(expert.in_features, 64, gen).to(device)
                        wp = unpruned[e].to(device)[:, perm].to(dtype)   # (the map is on the device)
                        expert.weight[:, perm] = wp * nm_keep_mask(wp.abs().float(), 2, 4).to(dtype)
                compressed, entries[name] = compress_experts(name, experts, 2, 4, maps)
                tensors.update(compressed)
        reference = copy.deepcopy(model)
        attach_sparse_experts(model, tensors, {"n": 2, "m": 4, "experts": entries})
        return model, reference

    nm, nm_reference = sparse_copy(False)
    nm_mapped, nm_mapped_reference = sparse_copy(True)
    layers = {"dense_eager": (dense, None), "dense_grouped_mm": (own_copy("eager" if args.smoke else "grouped_mm"), None),
              "nm_loop": (nm, "loop"), "nm_grouped": (nm, "grouped"), "nm_auto": (nm, "auto"),
              "nm_loop_mapped": (nm_mapped, "loop"), "nm_grouped_mapped": (nm_mapped, "grouped"),
              "nm_auto_mapped": (nm_mapped, "auto"), "nm_grouped_mapped_in_kernel": (nm_mapped, "grouped")}
    references = {"dense_eager": dense, "dense_grouped_mm": dense, **{k: nm_reference for k in layers if k.startswith("nm_")},
                  **{k: nm_mapped_reference for k in layers if "_mapped" in k}}
    nbytes = {name: module_bytes(m) for name, (m, _) in layers.items()}

    def timed_ms(fn, graph: bool) -> tuple[float, str]:
        if device.type != "cuda":
            fn()
            return float("nan"), "none"
        if graph:   # captured where it can be (no host synchronisation), else timed eagerly
            return cuda_graph_ms([fn] * args.calls, args.runs, warm=3)
        return eager_ms([fn] * args.calls, args.runs, warm=0), "events"   # warmed up by the caller

    rows = route_rows(args, device, gen, timed_ms)   # first: quick, and never timed on a GPU before
    save_moe_results(args, __doc__, dtype, nbytes, rows, complete=False)
    with torch.no_grad():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, generator=gen).to(device, dtype)
            top = torch.rand(tokens, args.experts, generator=gen).topk(args.top_k, dim=-1).indices.to(device)
            weights = torch.softmax(torch.randn(tokens, args.top_k, generator=gen), -1).to(device, dtype)
            for name, (layer, mode) in layers.items():
                if mode is not None:
                    set_experts_mode(layer, mode)
                    for held in layer.modules():   # _in_kernel: the kernel reads the maps, no gather first
                        if hasattr(held, "gather_first"):
                            held.gather_first = not name.endswith("_in_kernel")
                want = references[name].experts(x, top, weights)
                call = lambda layer=layer: layer.experts(x, top, weights)  # noqa: E731
                for _ in range(3):   # warm-up: compiles kernels and makes auto's choices
                    got = call()
                ms, how = timed_ms(call, graph=name in ("nm_grouped", "nm_grouped_mapped", "nm_grouped_mapped_in_kernel",
                                                                "dense_grouped_mm"))
                rows.append(moe_row(args, tokens, name, ms, how, got, want))
                if mode == "auto":   # what auto measured faster for this token count (run eagerly, as it chose)
                    rows[-1]["choice"] = experts_mode(layer.experts, x, top, weights)
                print(rows[-1], flush=True)
            save_moe_results(args, __doc__, dtype, nbytes, rows, complete=False)
    save_moe_results(args, __doc__, dtype, nbytes, rows)


def route_rows(args: argparse.Namespace, device, gen, timed_ms) -> list[dict]:
    """The router's pairs grouped by expert (``route_blocks``, once per MoE layer and step) at each token
    count the one-launch kernel takes: ``route_kernel`` against ``route_torch`` (PyTorch's sort, scatter
    and search), each captured into a CUDA graph; ``rel_err`` 0 where the two give the same slots and
    blocks (else 1)."""
    import torch

    from shuffleprune.kernels.nm_experts import ROUTE_KERNEL_PAIRS, experts_block_t, route_blocks

    rows = []
    for tokens in args.tokens:
        pairs = tokens * args.top_k
        if pairs > ROUTE_KERNEL_PAIRS:
            continue
        top = torch.rand(tokens, args.experts, generator=gen).topk(args.top_k, dim=-1).indices.to(device)
        block_t = experts_block_t(pairs, args.experts)
        ref = route_blocks(top, args.experts, block_t, kernel=False)
        for impl, kernel in (("route_kernel", True), ("route_torch", False)):
            got = route_blocks(top, args.experts, block_t, kernel=kernel)
            same = all(torch.equal(a, b) for a, b in zip(got, ref))
            ms, how = timed_ms(lambda kernel=kernel: route_blocks(top, args.experts, block_t, kernel=kernel), True)
            rows.append({"shape": f"{args.experts} experts, top {args.top_k}", "tokens": tokens, "impl": impl,
                         "ms": round(ms, 4), "timing": how, "rel_err": 0.0 if same else 1.0,
                         "block_t": block_t})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
