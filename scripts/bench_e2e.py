"""End-to-end prefill / decode speed and GPU memory: a random LLaMA-2-7B-shaped model, dense vs 2:4
with index maps (``SparseLinear``, automatic kernel choice), bf16, batch 1, static KV cache and
CUDA graphs for both (issue 24's second table).

    python scripts/bench_e2e.py                 # CUDA → scripts/results/bench_e2e.json
    python scripts/bench_e2e.py --smoke         # CPU, a 2-layer small config: checks the code path only
    python scripts/bench_e2e.py --arch mixtral  # CUDA, 8 Mixtral-8x7B layers → scripts/results/bench_e2e_mixtral.json
    python scripts/bench_e2e.py --decode compile  # decode steps by torch.compile(mode="reduce-overhead"), as users
                                                  # serve → scripts/results/bench_e2e_compile.json
    python scripts/bench_e2e.py --decode eager    # decode steps run eagerly, as a plain generate() runs them
                                                  # (the host's launches counted) → scripts/results/bench_e2e_eager.json

Per model: prefill of the ``--prompt`` tokens into a transformers ``StaticCache``, eagerly (as
``generate`` runs a prompt: host-bound at this size) and replayed from one CUDA graph (the GPU's
time; ``prefill_ms`` and the ratio use it where capture works), median of ``--runs``, then ``--new-tokens`` greedy decode steps replayed from one CUDA graph of a decode step
(static cache, fixed input buffers; if capture fails, ``torch.compile(mode="reduce-overhead")``,
then eager — the row says which), median of ``--runs``. Weights in GPU memory are the model's
parameters and buffers; peak is ``max_memory_allocated`` over that model's measurement (the dense
model's linears are replaced one by one, and the peak counter is reset before the sparse model is
measured).

The sparse model is laid out as ``export`` does: each decoder linear is 2:4 in permuted column order
with a random block index map (q/k/v share one, gate/up share one, o_proj has its own), except
down_proj, whose map ``export`` folds into gate/up rows. The same sparse model is then measured
with the shared maps moved to the RMSNorms that produce q/k/v's and gate/up's input
(``move_maps_to_producers``: one fused norm kernel writes the permuted output; ``maps_at_producer``
in the results), so the two places for an index map are compared end to end; then, as ``load``
does, with the layers that read one input run as one stacked layer (``fuse_shared_inputs``); last,
unstacked and stacked again, with each layer's weight held as one cuSPARSELt buffer
(``use_cslt_layout``: ``auto`` may then prefill on Hopper's sparse tensor cores; ``cslt_buffer``).
``load_default`` names the variant ``load`` serves on this device (``arrange_for_serving``: the
stacked cuSPARSELt buffer on Hopper); ``--decode compile`` and ``--decode eager`` measure that one only. The eager prefill
(``prefill_eager_ms``) shows what a model run without CUDA graphs gets: there ``auto`` keeps
cuSPARSELt only if it also wins eagerly (``eager_kernel_choices_…``). Last, that model again with
every kernel ``auto`` chose as a programmatic dependent (``+pdl``, Hopper) launched plainly
(``cslt_buffer_stacked_no_pdl``): what the dependent launches add end to end.

A prompt whose CUDA-graph capture fails is captured again by ``scripts/capture_probe.py`` (the row's
``prefill_capture_probe``: the first module after which the capture was invalidated, the error, and
which of PyTorch's capture modes allow it). ``--decode eager`` profiles one decode step per model
(``eager_step_profile``: the host's queueing time against the GPU's end, the CUDA calls made, the
kernels run, the operators with the most host time; ``python``: three steps under ``cProfile``, Python's
own time by package — Triton's launcher, this package, transformers, torch — and the costliest
functions, which the smoke run on the CPU also reports). ``--layers`` sets the decoder layers (a short
model for a quick check).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def set_cache_length(cache, n: int) -> None:
    """Point a static cache's write position at ``n`` (transformers ≥ 5 keeps it in a tensor per layer,
    updated in place — graph-safe; older versions read ``cache_position``)."""
    import torch

    for layer in getattr(cache, "layers", []):
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.fill_(n)
        elif length is not None:
            layer.cumulative_length = n


def wall_seconds(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """Seconds ``fn()`` takes, ``sync`` (the device's synchronisation) called before and after."""
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def sparsify_like_export(model, gen) -> None:
    """Every decoder linear of ``model`` 2:4 in a random 64-column block map's order, as ``export``
    leaves it (in place, on the model's device): a :class:`SparseLinear` with that map (q/k/v and
    gate/up sharing theirs through a :class:`SharedGather`; down_proj without one, as ``export`` folds
    it into gate/up's rows), and MoE experts each 2:4 under a map of its own, held as ``export`` holds
    them."""
    import torch

    from shuffleprune.blocks import block_experts, block_linears, experts_by_tensor, find_blocks
    from shuffleprune.deploy.format import compress
    from shuffleprune.deploy.experts_export import compress_experts
    from shuffleprune.deploy.experts_load import attach_sparse_experts
    from shuffleprune.deploy.shared_input import SharedGather
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.perm.core import random_block_perm

    device = next(model.parameters()).device
    blocks = find_blocks(model)
    with torch.no_grad():
        for prefix, block in blocks.named():
            maps: dict[str, torch.Tensor] = {}
            gathers: dict[str, SharedGather] = {}
            for name, lin in block_linears(block, prefix).items():
                kind = name.rsplit(".", 1)[-1]
                share = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp"}.get(kind, kind)
                perm = None if kind == "down_proj" else maps.setdefault(share, random_block_perm(lin.in_features, 64, gen))
                w = lin.weight.data
                w = w if perm is None else w[:, perm.to(device)]
                w = w * nm_keep_mask(w.float().abs(), 2, 4).to(w.dtype)
                values, meta = compress(w, 2, 4, name)
                layer = SparseLinear(values, meta, lin.in_features, 2, 4, perm).to(device)
                if perm is not None:
                    layer.shared_gather = gathers.setdefault(share, SharedGather()).join()
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name), child, layer)
                del w, lin
            tensors, entries = {}, {}   # MoE: every expert 2:4 in its own random map's order, held as export does
            for fused, experts in experts_by_tensor(block_experts(block, prefix)).items():
                maps = {}
                for e, expert in experts.items():
                    maps[e] = perm = random_block_perm(expert.in_features, 64, gen).to(device)
                    wp = expert.weight[:, perm]
                    expert.weight[:, perm] = wp * nm_keep_mask(wp.float().abs(), 2, 4).to(wp.dtype)
                compressed, entries[fused] = compress_experts(fused, experts, 2, 4, maps)
                tensors.update(compressed)
            if entries:
                attach_sparse_experts(model, tensors, {"n": 2, "m": 4, "experts": entries})
                del tensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--arch", choices=("llama", "mixtral"), default="llama",
                    help="mixtral: a Mixtral-8x7B-shaped MoE (8 experts, top 2), --layers of its 32 decoder layers")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: llama 32, as LLaMA-2-7B; mixtral 8, since all 32 need 94 GB dense)")
    ap.add_argument("--decode", choices=("graph", "compile", "eager"), default="graph",
                    help="graph: each decode step replayed from one CUDA graph captured by hand; compile: as "
                         "torch.compile(model.forward, mode='reduce-overhead') runs it (→ …_compile.json); eager: "
                         "run as is, as generate() without CUDA graphs runs it (→ …_eager.json)")
    ap.add_argument("--out", default=None, help="default: scripts/results/bench_e2e.json (mixtral: bench_e2e_mixtral.json)")
    args = ap.parse_args()
    os.environ["SHUFFLEPRUNE_AUTO_STORE"] = "0"   # auto measures here (first_prefill_s, first_step_s: a cold start),
                                                  # not from choices an earlier run stored (deploy/choice_store.py)
    moe = args.arch == "mixtral"
    name = ("bench_e2e_mixtral" if moe else "bench_e2e") + ("" if args.decode == "graph" else f"_{args.decode}")
    args.out = args.out or str(ROOT / "scripts" / "results" / f"{name}.json")

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, StaticCache

    from shuffleprune.deploy.input_gather import gather_orders
    from shuffleprune.deploy.fused_inputs import fuse_shared_inputs, unfuse_shared_inputs
    from shuffleprune.deploy.producer_maps import move_maps_to_producers
    from shuffleprune.deploy.serving import arrange_for_serving, cslt_by_default
    from shuffleprune.deploy.auto_choice import relative_error
    from shuffleprune.deploy.impls import split_pdl
    from shuffleprune.deploy.sparse_linear import SparseLinear, release_scratch, use_cslt_layout
    from shuffleprune.outdir import atomic_write
    from shuffleprune.runtime.facts import machine, versions
    from shuffleprune.runtime.memory import module_bytes
    from capture_probe import capture_modes, python_profile, step_profile, wait

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke on CPU")
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    if moe:
        small = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, num_local_experts=4, vocab_size=1000, max_position_embeddings=1024)
        full = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers or 8, num_attention_heads=32,
                    num_key_value_heads=8, num_local_experts=8, vocab_size=32000, max_position_embeddings=4096)
        cfg = MixtralConfig(**(small if args.smoke else full), num_experts_per_tok=2)
        if args.smoke:
            args.prompt, args.new_tokens, args.runs = 32, 8, 2
    elif args.smoke:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                          vocab_size=1000, max_position_embeddings=1024)
        args.prompt, args.new_tokens, args.runs = 32, 8, 2
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=args.layers or 32, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    def sync() -> None:   # every wait polls with a limit: a model step that never ends is a DeviceFault, named
        if cuda:
            wait("a timed model call (prompt or decode)")
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device=device)

    def wall(fn) -> float:
        return wall_seconds(fn, sync)

    def capture(warm, body) -> torch.cuda.CUDAGraph:
        """One CUDA graph of ``body``, after ``warm`` ran on the capturing stream."""
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm()
            with torch.cuda.graph(graph, stream=side):
                body()
        torch.cuda.current_stream().wait_stream(side)
        return graph

    @torch.no_grad()
    def measure(model, label: str) -> tuple[dict, torch.Tensor]:
        total = args.prompt + args.new_tokens + 1
        cache = StaticCache(config=model.config, max_cache_len=total)
        positions = torch.arange(args.prompt, device=device)

        def prefill() -> torch.Tensor:
            set_cache_length(cache, 0)
            return model(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True).logits

        # the first prompt: SparseLinear chooses its prompt-length kernels here and Triton compiles them (the wait
        # a user's first call sees, against the dense model's first call)
        first_prefill_s = wall(prefill)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        prefill_eager_s = statistics.median(wall(prefill) for _ in range(args.runs))
        prefill_how, prefill_s, graph_err, probe = "eager", prefill_eager_s, None, None
        if cuda:  # the prompt as one CUDA graph too: the GPU's time, without the host's launch cost
            try:
                replayed: dict[str, torch.Tensor] = {}
                graph = capture(prefill, lambda: replayed.setdefault("logits", prefill()))
                prefill_s, prefill_how = statistics.median(wall(graph.replay) for _ in range(args.runs)), "cuda_graph"
                graph.replay()   # the replayed prompt computes what the eager one does (no kernel lost in capture)
                eager = prefill().float()
                graph_err = relative_error(replayed["logits"], eager)
                del graph, replayed
            except Exception as exc:  # noqa: BLE001 - recorded: the eager time stands
                print(f"{label}: prefill graph capture failed ({str(exc).splitlines()[0][:120]})", flush=True)
                sync()
                probe = capture_modes(model, prefill)   # where it broke, and which capture modes allow it
                print(json.dumps({"prefill_capture_probe": probe}), flush=True)
        # where an eager prompt's time goes (host queue against the GPU's end, the kernels with the most GPU time):
        # load's default layout took 2.66x dense's eager prompt on the H200 (stop 85), 1.41x with dependent launches off
        prefill_profile = step_profile(prefill) if cuda and label != "dense" else None
        first = prefill()[:, -1:].argmax(-1)
        tok = first.clone()
        pos = torch.tensor([args.prompt], device=device)

        def step() -> None:
            logits = model(input_ids=tok, past_key_values=cache, cache_position=pos, position_ids=pos.unsqueeze(0),
                           use_cache=True).logits
            tok.copy_(logits[:, -1:].argmax(-1))
            pos.add_(1)

        def restart() -> None:
            tok.copy_(first)
            pos.fill_(args.prompt)
            set_cache_length(cache, args.prompt)

        first_step_s = None
        if args.decode != "compile":   # the one-token kernels are chosen and compiled outside any capture
            first_step_s = wall(step)    # (compile: inside the compiled step's first call, as a user's model is)
            for _ in range(2):
                step()
            restart()

        def compiled_step() -> Callable[[], None]:
            """The decode step as ``torch.compile(mode="reduce-overhead")`` runs it (CUDA graphs of the
            compiled graphs), warmed up and checked against the eager step's token. Its first call is the
            first one-token call of a model not run before (``--decode compile``): ``auto`` measures
            inside the compiled model's warm-up run, as it does for a user who compiles before any call."""
            torch._dynamo.reset()
            compiled = torch.compile(model.forward, mode="reduce-overhead")

            def step_compiled() -> None:
                logits = compiled(input_ids=tok, past_key_values=cache, cache_position=pos,
                                  position_ids=pos.unsqueeze(0), use_cache=True).logits
                tok.copy_(logits[:, -1:].argmax(-1))
                pos.add_(1)

            nonlocal first_step_s
            first_step_s = wall(step_compiled)   # torch.compile's and the one-token choice's wait
            got = tok.clone()
            restart()
            step()
            if not torch.equal(got, tok):
                raise RuntimeError("the compiled decode step chose another token than the eager one")
            restart()
            for _ in range(2):
                step_compiled()
            restart()
            return step_compiled

        how, run_step = "eager", step
        if args.decode == "compile":
            try:
                run_step, how = compiled_step(), "torch.compile(reduce-overhead)"
            except Exception as exc:  # noqa: BLE001 - recorded in the row: what failed, and the eager decode's time
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                print(f"{label}: torch.compile failed ({first_line}); eager", flush=True)
                restart()
                how = f"eager (torch.compile failed: {type(exc).__name__}: {first_line})"
        elif cuda and args.decode == "graph":
            try:
                graph = capture(lambda: (step(), restart()), step)
                how, run_step = "cuda_graph", graph.replay
            except Exception as exc:  # noqa: BLE001 - fall back the way users would
                print(f"{label}: CUDA graph capture failed ({str(exc).splitlines()[0][:120]}); torch.compile", flush=True)
                try:
                    run_step, how = compiled_step(), "torch.compile(reduce-overhead)"
                except Exception as exc2:  # noqa: BLE001
                    print(f"{label}: torch.compile failed too ({str(exc2).splitlines()[0][:120]}); eager", flush=True)
        tokens_out = []

        def decode() -> None:
            restart()
            for _ in range(args.new_tokens):
                run_step()
            tokens_out.append(int(tok.item()))

        decode_s = statistics.median(wall(decode) for _ in range(args.runs))
        profiled = None
        if args.decode == "eager":   # where an eager step's host time goes (launches, any sync; Python by package)
            restart()
            profiled = step_profile(run_step) if cuda else {}
            profiled["python"] = python_profile(run_step)
            print(json.dumps({"eager_host_queue_ms": profiled.get("host_queue_ms"),
                              "python_own_ms_by_area": profiled["python"]["own_ms_per_step_by_area"]}), flush=True)
        row = {"model": label, "decode_mode": how, "prefill_mode": prefill_how, "prefill_ms": round(prefill_s * 1e3, 2),
               "prefill_eager_ms": round(prefill_eager_s * 1e3, 2),
               "decode_ms_per_token": round(decode_s * 1e3 / args.new_tokens, 3),
               "decode_tokens_per_s": round(args.new_tokens / decode_s, 2),
               "first_prefill_s": round(first_prefill_s, 3),
               "first_step_s": None if first_step_s is None else round(first_step_s, 3),
               "weights_mb": round(module_bytes(model) / 2**20, 1),
               "peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
               "prefill_graph_vs_eager_max_rel_err": graph_err,
               **({"prefill_capture_probe": probe} if probe else {}),
               **({"eager_step_profile": profiled} if profiled else {}),
               **({"eager_prefill_profile": prefill_profile} if prefill_profile else {}),
               "last_token_each_run": tokens_out}
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_profile")}), flush=True)   # in the file
        return row, first

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    dense_row, dense_first = measure(model, "dense")
    sparsify_like_export(model, torch.Generator().manual_seed(0))
    if cuda:
        torch.cuda.empty_cache()
    release_scratch()

    def ratios(row: dict) -> dict:
        return {"decode_speedup": round(row["decode_tokens_per_s"] / dense_row["decode_tokens_per_s"], 3),
                "prefill_time_ratio": round(row["prefill_ms"] / dense_row["prefill_ms"], 3),
                "prefill_eager_time_ratio": round(row["prefill_eager_ms"] / dense_row["prefill_eager_ms"], 3),
                "weights_ratio": round(row["weights_mb"] / dense_row["weights_mb"], 3),
                "peak_ratio": round(row["peak_mb"] / dense_row["peak_mb"], 3) if cuda else None}

    shape = (f"Mixtral-8x7B-shaped model ({cfg.num_hidden_layers} layers, {cfg.num_local_experts} experts, top 2; "
             "experts 2:4 with a map "
             "each, the grouped kernel or the loop as auto measures, the grouped one in CUDA graphs)") if moe \
        else f"LLaMA-2-7B-shaped model ({cfg.num_hidden_layers} layers)"

    def save(ratio: dict, rows: list[dict], complete: bool = True, **extra) -> None:
        """Write the results file (after every model measured, so a run cut off by its time limit keeps
        its rows; ``complete`` says whether every variant was reached)."""
        result = {"complete": complete, "what": f"end-to-end prefill/decode, random {shape}, static cache, "
                          + {"compile": "decode by torch.compile(mode='reduce-overhead')",
                             "eager": "decode eager (no CUDA graphs)"}.get(args.decode, "CUDA graphs")
                          + (" (smoke)" if args.smoke else ""),
                  "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "dtype": str(dtype),
                  "seed": 0, "batch": 1, "prompt": args.prompt, "new_tokens": args.new_tokens, "runs": args.runs,
                  "targets": "decode ≥1.35× dense tokens/s; prefill ≤1.0× dense time; weights ≤0.6× dense; peak below dense",
                  **ratio, "rows": rows, **extra, "command": " ".join([Path(sys.executable).name, *sys.argv]),
                  "machine": machine(), "versions": versions("triton")}
        out = Path(args.out) if not args.smoke else Path(args.out).with_name(Path(args.out).stem + "_smoke.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))
        if complete:
            print(json.dumps(ratio, indent=1))

    # load's default layout on this device (cuSPARSELt's buffer on Hopper): the key of its variant below
    default_variant = "cslt_buffer_stacked" if cuda and cslt_by_default(device) else "stacked"
    if args.decode != "graph":   # load's default only (each compile of a 32-layer model takes minutes)
        save({}, [dense_row], complete=False)
        done = arrange_for_serving(model)
        row, _ = measure(model, f"2:4 as load lays it out ({default_variant})")
        row.update(maps_moved=len(done["maps_moved"]), groups=len(done["stacked_groups"]),
                   layers_tiled=len(done["cslt_layers"]))
        save(ratios(row), [dense_row, row], load_default=default_variant)
        return
    save({}, [dense_row], complete=False)
    sparse_row, _ = measure(model, "2:4+index maps (SparseLinear auto)")

    def layers_and_stacks() -> tuple[list, list]:
        """The model's sparse layers, and the stacked layers their groups run (built so far)."""
        layers = [mod for mod in model.modules() if isinstance(mod, SparseLinear)]
        stacks = list({id(m.fused_inputs): m.fused_inputs.stacked for m in layers
                       if m.fused_inputs is not None and m.fused_inputs.stacked is not None}.values())
        return layers, stacks

    def launch_plainly() -> int:
        """Every sparse layer's (and stacked group's) ``+pdl`` choices launched plainly; returns how many."""
        layers, stacks = layers_and_stacks()
        changed = 0
        for layer in layers + stacks:
            for made in (layer.choices, layer.eager_choices):
                for bucket, impl in made.items():
                    made[bucket], pdl = split_pdl(impl)
                    changed += pdl
        return changed

    def kernel_choices(eager: bool = False) -> dict:
        """Per kind of layer, token bucket → what auto runs in a CUDA graph (``eager``: outside one); a
        stacked group's own layer (what its members run) as ``ROWSxCOLS stacked``."""
        choices = {}
        layers, stacks = layers_and_stacks()
        for mod, suffix in [(mod, "") for mod in layers] + [(mod, " stacked") for mod in stacks]:
            key = f"{mod.out_features}x{mod.in_features}{'+map' if mod.perm is not None else ''}{suffix}"
            made = mod.eager_choices if eager else mod.choices
            if made:
                choices.setdefault(key, {str(k): v for k, v in made.items()})
        return choices

    choices = kernel_choices()
    done = [dense_row, sparse_row]
    save(ratios(sparse_row), done, complete=False, kernel_choices=choices)

    from shuffleprune.deploy.fused_inputs import FusedInputs

    built: list[int] = []   # the stacked layers built (FusedInputs._build): once per group and placement, unless
    build = FusedInputs._build   # something replaces a member's buffers (then at every call: its weight stacked anew)
    FusedInputs._build = lambda self: built.append(1) or build(self)

    def measured(label: str, **facts) -> tuple[dict, dict]:
        """The model as it stands now: its row (with ``facts``, the stacked layers built while it was
        measured and what auto runs outside a CUDA graph) and the kernels ``auto`` chose; the rows so
        far saved."""
        before = len(built)
        row, _ = measure(model, label)
        row.update(facts, stacked_builds=len(built) - before, eager_kernel_choices=kernel_choices(eager=True))
        done.append(row)
        save({**ratios(sparse_row), "partial": {r["model"]: ratios(r) for r in done[2:]}}, done, complete=False,
             kernel_choices=choices)
        return row, kernel_choices()

    # The other place for the shared maps (issue 24): the RMSNorms feeding q/k/v and gate/up write
    # their output permuted (one fused kernel) and those layers read in order; o_proj keeps its map.
    moved = move_maps_to_producers(model)   # the layers that lost their map choose their kernels again
    producer_row, choices_at_producer = measured("2:4+index maps at the producer (fused RMSNorm)", maps_moved=len(moved))
    # What load() does last: the layers reading one input (q/k/v, gate/up) run as one stacked layer.
    groups = fuse_shared_inputs(model)
    fused_row, choices_stacked = measured("2:4+maps at the producer, q/k/v and gate/up stacked"
                                          + (" (load's default here)" if default_variant == "stacked" else ""),
                                          groups=len(groups))
    # One buffer per layer that cuSPARSELt multiplies from and the decode kernels read (use_cslt_layout):
    # prefill may then run on the sparse tensor cores, without a second copy; stacked again as load does.
    unfuse_shared_inputs(model)
    tiled = use_cslt_layout(model)
    if cuda:
        torch.cuda.empty_cache()
    cslt_row, choices_cslt = measured("2:4 in cuSPARSELt's buffer, maps at the producer", layers_tiled=len(tiled))
    groups = fuse_shared_inputs(model)
    cslt_fused_row, choices_cslt_stacked = measured(
        "2:4 in cuSPARSELt's buffer, maps at the producer, stacked"
        + (" (load's default here)" if default_variant == "cslt_buffer_stacked" else ""), groups=len(groups))
    eager_choices_cslt_stacked = kernel_choices(eager=True)
    # The same model with every "+pdl" choice launched plainly: what programmatic dependent launch adds
    # (kernels/overlap.py; none of the choices has it off Hopper, and the row then repeats the one before)
    plain_row, _ = measured("2:4 in cuSPARSELt's buffer, maps at the producer, stacked, no dependent launches",
                            choices_made_plain=launch_plainly())
    rows = [dense_row, sparse_row, producer_row, fused_row, cslt_row, cslt_fused_row, plain_row]
    ratio = {**ratios(sparse_row), "maps_at_producer": ratios(producer_row), "stacked": ratios(fused_row),
             "cslt_buffer": ratios(cslt_row), "cslt_buffer_stacked": ratios(cslt_fused_row),
             "cslt_buffer_stacked_no_pdl": ratios(plain_row)}
    save(ratio, rows, load_default=default_variant, kernel_choices=choices,
         kernel_choices_maps_at_producer=choices_at_producer, kernel_choices_stacked=choices_stacked,
         kernel_choices_cslt_buffer=choices_cslt, kernel_choices_cslt_buffer_stacked=choices_cslt_stacked,
         eager_kernel_choices_cslt_buffer_stacked=eager_choices_cslt_stacked,
         gather_orders={f"{width} cols, {bucket} tokens, map span {span}": list(order)   # how mapped inputs were gathered
                        for (width, bucket, span), order in sorted(gather_orders().items(), key=str)})

if __name__ == "__main__":
    from shuffleprune.runtime.faults import run_to_fault

    run_to_fault(main)   # a kernel that faulted or hung the GPU: the process ends at once, named
