"""Check ``kernels/launch.py``'s fast launches against Triton's own dispatch, kernel by kernel.

    python scripts/check_fast_launch.py          # no GPU needed → scripts/results/fast_launch.json
    python scripts/check_fast_launch.py --gpu    # CUDA → scripts/results/fast_launch_cuda.json

Each case calls a host function the runtime calls (``nm_decode`` at 1, 2 and 16 tokens, plain, with a
map, split-K summed in the kernel or by a second launch, as a dependent launch, with its weight tiles
copied by the Tensor Memory Accelerator; the resident decode so too; ``nm_gemm``; the
scratch fills; both gathers; the mapped RMSNorm; the MoE experts kernel, its one-launch routing and its pairs' gather) three times on the same inputs: the first call
compiles and keeps the compiled kernel, the later ones take the fast path (split-K's arrival counters
move along a ring, so a second call may meet a new alignment, which Triton compiles apart too).

Without a GPU (run in a process without ``TRITON_INTERPRET``; the tests do), every kernel is compiled
for sm_90a and nothing runs (``kernels/compile_check.recorded_launches``): at every launch, what
Triton's dispatch passes the compiled kernel's launcher for these arguments is recorded beside what
the fast path passes, and the two must be the same objects in the same order, the launch metadata
apart (``identical``); the third call must have gone fast (``fast``). Then the key: for each launch, each positional argument
is varied where Triton's specialization can change (a pointer off 16-byte alignment; an integer of
1, 16, 17, 2³¹+16; a tensor descriptor over fewer rows, with another block, of another dtype) and Triton's own binder is asked for its specialization: two variants the fast
path's key (:func:`~shuffleprune.kernels.launch.args_key`) calls the same must be the same to Triton
(``key_refines``). Then each case's host µs per call both ways, the launcher a list append: Triton's
dispatch against the fast path on this machine's CPU, the driver's launch left out. Last, a whole eager
decode step of a small LLaMA laid out as ``load`` serves it (the decode kernels an H100 chose, the fused
norms): every Triton launch of a warmed-up step must go fast (no call site of the decode path falls back
to Triton's dispatch), its host ms per step both ways, and the sparse runtime's share of it (µs and
Python function calls per decoder layer: the step's less the same step with the sparse layers and
fused norms stubbed; the calls, counted by cProfile, do not move with the machine's load).

On a GPU (``--gpu``) the kernels run: each case's output with fast launches on must equal its output
through Triton's dispatch bit for bit (``identical``), and the host's µs per call are timed both ways
(calls queued without a synchronisation, median of 5 rounds).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

from bench_host_overhead import host_us  # noqa: E402  (scripts/, this script's folder, is on the path)

ROOT = Path(__file__).resolve().parents[1]


def cases(device, dtype):
    """``(name, call)`` pairs: each ``call()`` runs one host function on fixed inputs."""
    import torch

    from shuffleprune.deploy.format import compress
    from shuffleprune.kernels.gather import gather_columns, gather_rows
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_experts import nm_experts, route_blocks
    from shuffleprune.kernels.nm_gemm import nm_decompress_into, nm_decompress_mapped_into, nm_gemm
    from shuffleprune.kernels.nm_resident import nm_decode_resident
    from shuffleprune.kernels.nm_words import position_words
    from shuffleprune.kernels.norm_map import rmsnorm_mapped
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.perm.core import random_block_perm

    gen = torch.Generator().manual_seed(0)
    rows, cols = 512, 1024
    w = torch.randn(rows, cols, generator=gen)
    w = w * nm_keep_mask(w.abs(), 2, 4)
    values, meta = compress(w.to(dtype), 2, 4)
    values, words = values.to(device), position_words(meta).to(device)
    perm = random_block_perm(cols, 64, gen).to(device=device, dtype=torch.int32)
    inverse = torch.argsort(perm).to(torch.int32)
    scale = torch.rand(cols, generator=gen).to(device)
    bias = torch.randn(rows, generator=gen).to(device, dtype)
    scratch = torch.empty(rows * cols, dtype=dtype, device=device)
    x = {t: torch.randn(t, cols, generator=gen).to(device, dtype) for t in (1, 2, 16, 64)}
    experts = [compress((e * nm_keep_mask(e.abs(), 2, 4)).to(dtype), 2, 4)
               for e in torch.randn(4, rows // 2, cols, generator=gen)]   # 4 experts, each with a map
    e_values = torch.stack([v for v, _ in experts]).to(device)
    e_words = torch.stack([position_words(meta) for _, meta in experts]).to(device)
    e_perm = torch.stack([random_block_perm(cols, 64, gen) for _ in experts]).to(device=device, dtype=torch.int32)
    routed = torch.tensor([[0, 2], [1, 2]], device=device)   # 2 tokens, top 2
    return [
        ("nm_decode 1 token", lambda: nm_decode(x[1], values, words, 2, 4, 2)),
        ("nm_decode 1 token, map read in the kernel, bias", lambda: nm_decode(x[1], values, words, 2, 4, 2, perm, bias)),
        ("nm_decode 1 token, dependent launch", lambda: nm_decode(x[1], values, words, 2, 4, 2, pdl=True)),
        ("nm_decode 2 tokens, split-K summed by a second launch",
         lambda: nm_decode(x[2], values, words, 2, 4, 2, split=4, sum_in_kernel=False)),
        ("nm_decode 2 tokens, split-K summed in the kernel", lambda: nm_decode(x[2], values, words, 2, 4, 2, split=4)),
        ("nm_decode 16 tokens", lambda: nm_decode(x[16], values, words, 2, 4, 2)),
        ("nm_decode 16 tokens, 32-row tile expanded by broadcasts, map read in the kernel",
         lambda: nm_decode(x[16], values, words, 2, 4, 2, perm, bias, use_dot=True, weight_a=True, block_r=32,
                           num_warps=2, block_k=64, spread=True)),
        ("nm_decode 16 tokens, weight tiles by TMA (tensor descriptors)",
         lambda: nm_decode(x[16], values, words, 2, 4, 2, use_dot=True, weight_a=True, stages=3, tma=True)),
        ("nm_decode_resident 1 token, map, weight tiles by TMA",
         lambda: nm_decode_resident(x[1], values, words, 2, 4, 2, perm, tma=True)),
        ("nm_gemm 64 tokens", lambda: nm_gemm(x[64], values, words, 2, 4, 2, bias)),
        ("nm_decompress_into", lambda: nm_decompress_into(values, words, 2, 4, 2, cols, scratch)),
        ("nm_decompress_mapped_into", lambda: nm_decompress_mapped_into(values, words, 2, 4, 2, cols, inverse, scratch)),
        ("gather_columns 1 token", lambda: gather_columns(x[1], perm)),
        ("gather_rows 64 tokens, dependent launch", lambda: gather_rows(x[64], perm, pdl=True)),
        ("rmsnorm_mapped 16 tokens", lambda: rmsnorm_mapped(x[16], scale, perm, 1e-5)),
        ("nm_experts 2 tokens, top 2, maps", lambda: nm_experts(x[2], e_values, e_words, 2, 4, 2, routed, 2, e_perm)[0]),
        ("route_blocks 2 tokens, top 2, one launch", lambda: route_blocks(routed, 4, 1, kernel=True)[0]),
    ]


METADATA = 6   # the launcher's launch-metadata argument, which only a launch hook reads (none is set here)


def same_call(a: tuple, b: tuple) -> bool:
    """Whether two recorded launcher calls passed the same things: tensors the same objects, the rest
    equal, but the launch metadata (Triton 3.9, here, builds it whether or not a hook reads it, since its
    unset hooks are empty chains, not None; the fast path passes None, what Triton's dispatch passes
    where an unset hook is None)."""
    import torch

    if len(a) != len(b):
        return False
    a, b = a[:METADATA] + a[METADATA + 1:], b[:METADATA] + b[METADATA + 1:]
    return all(u is v if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor) else
               (u is v or (type(u) is type(v) and u == v)) for u, v in zip(a, b))


def variants(value):
    """``value`` and values of its kind that Triton may specialize differently (see the module docstring)."""
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.reshape(-1)
        return [value] + ([flat[1:]] if flat.numel() > 1 else [])
    if isinstance(value, int) and not isinstance(value, bool):
        return [value, 1, 16, 17, (1 << 31) + 16]
    if type(value).__name__ == "TensorDescriptor":   # fewer rows; another block; another dtype
        rows, block = value.base.shape[0], list(value.block_shape)
        return [value, type(value).from_tensor(value.base[: max(1, rows // 2)], block),
                type(value).from_tensor(value.base, [max(1, block[0] // 2), *block[1:]]),
                type(value).from_tensor(value.base.view(torch.float32), block)]
    return [value]


def key_refines(kernel, grid_args: tuple, kwargs: dict) -> bool:
    """Whether, varying each positional argument in turn, every two variants with one fast-path key
    have one Triton specialization (and options)."""
    from triton.runtime.driver import driver

    from shuffleprune.kernels.launch import args_key

    binder = kernel.device_caches[driver.active.get_current_device()][4]
    for i, value in enumerate(grid_args):
        seen: dict = {}
        for v in variants(value):
            args = grid_args[:i] + (v,) + grid_args[i + 1:]
            _, spec, options = binder(*args, **kwargs)
            ours = (args_key(args), tuple(kwargs.values()))
            theirs = (str(spec), str(options))
            if seen.setdefault(ours, theirs) != theirs:
                return False
    return True


def check_recorded(timed_calls: int) -> list[dict]:
    """The compile-only comparison (no GPU): every launch of every case, Triton's call against ours."""
    import torch

    from shuffleprune.kernels import launch
    from shuffleprune.kernels.compile_check import recorded_launches

    rows: list[dict] = []
    original = launch.BoundLaunch.__call__   # every fast launch goes through one (FastKernel.launch too)
    current: dict = {}

    def compared(self, grid, *args):
        kernel, kwargs = self.fast_kernel.kernel, self.kwargs
        calls.clear()
        kernel[grid](*args, **kwargs)              # Triton's dispatch, for the same arguments
        theirs = calls[-1]
        before, n = self.fast_kernel.fast_launches, len(calls)
        out = original(self, grid, *args)
        ours = calls[-1] if len(calls) > n else None
        rows.append({"case": current["name"], "call": current["call"], "kernel": kernel.fn.__name__,
                     "fast": self.fast_kernel.fast_launches > before,
                     "identical": ours is not None and same_call(theirs, ours),
                     "key_refines": key_refines(kernel, args, kwargs)})
        return out

    with recorded_launches() as calls, launch.enabled():
        launch.BoundLaunch.__call__ = compared
        try:
            for name, call in cases(torch.device("cpu"), torch.bfloat16):
                for n in (1, 2, 3):
                    current.update(name=name, call=n)
                    call()
        finally:
            launch.BoundLaunch.__call__ = original
        for name, call in cases(torch.device("cpu"), torch.bfloat16):   # the host's µs, the launch a list append
            times = {}
            for on in (False, True):
                with launch.enabled(on):
                    times[on] = host_us(call, calls.clear, timed_calls)
            rows.append({"case": name, "host_us_triton_dispatch": times[False], "host_us_fast": times[True]})
            print(f"{name:55s} {times[False]:7.2f} → {times[True]:7.2f} µs per call (launch not run)", flush=True)
        rows.append(check_step(calls, max(5, timed_calls // 100)))
    return rows


def decode_step_model(layers: int = 4):
    """A small LLaMA (512 wide) laid out as ``load`` serves it (maps at the fused norms, q/k/v and gate/up
    stacked; export's layout), every sparse layer on the decode kernel an H100 chose eagerly at one token
    (the map read in the kernel where one is left, a dependent launch), the norms on their kernel on any
    device; and its one-token eager decode step (a static cache, reset to the same position each step)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

    from bench_e2e import set_cache_length, sparsify_like_export
    from shuffleprune.deploy.producer_maps import MappedOutput
    from shuffleprune.deploy.serving import arrange_for_serving
    from shuffleprune.deploy.sparse_linear import SparseLinear

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=1000, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    sparsify_like_export(model, torch.Generator().manual_seed(0))
    arrange_for_serving(model, cslt=False)
    for mod in model.modules():
        if isinstance(mod, SparseLinear):
            mod.policy = "decode_mapped+pdl" if mod.perm is not None else "decode+pdl"
        elif isinstance(mod, MappedOutput):
            mod.kernel = True
    prompt = 8
    cache = StaticCache(config=cfg, max_cache_len=prompt + 4)
    tok, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([prompt])

    @torch.no_grad()
    def step() -> None:
        set_cache_length(cache, prompt)   # the write position back to the prompt's end
        model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)

    with torch.no_grad():
        model(input_ids=torch.zeros(1, prompt, dtype=torch.long), past_key_values=cache,
              cache_position=torch.arange(prompt), use_cache=True)
    return model, step


LAYERS = 4   # decode_step_model's decoder layers in the step checked


def python_calls(step, sync, steps: int = 10) -> float:
    """Python function calls (those of C builtins too) per ``step()``, counted by cProfile: a measure of
    the interpreter's work per step that does not move with the machine's load, as its time does."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    sync()
    return pstats.Stats(profile).total_calls / steps


@contextlib.contextmanager
def sparse_stubbed() -> Iterator[None]:
    """Every sparse layer and fused norm returns an empty output of its shape at once (no host work of
    ours, no launch): a step's host time and calls without the sparse runtime."""
    import torch

    from shuffleprune.deploy.producer_maps import MappedOutput
    from shuffleprune.deploy.sparse_linear import SparseLinear

    before = SparseLinear.forward, MappedOutput.forward
    SparseLinear.forward = lambda self, x: x.new_empty(*x.shape[:-1], self.out_features)
    MappedOutput.forward = lambda self, x, *args, **kwargs: torch.empty_like(x)
    try:
        yield
    finally:
        SparseLinear.forward, MappedOutput.forward = before


def check_step(calls: list, timed_steps: int) -> dict:
    """One eager decode step of :func:`decode_step_model` with launches recorded: how many Triton launches
    it makes and how many went fast (after warm-up steps: all should), the host's ms per step both ways
    (median of 7 rounds, the modes' rounds interleaved),
    and the sparse runtime's share of the step (fast launches on): its host µs and Python calls per
    decoder layer, the step's less the same step with the sparse layers and fused norms stubbed."""
    from shuffleprune.kernels import launch

    model, step = decode_step_model(LAYERS)
    for _ in range(3):
        step()
    wrapped = list(launch._FAST.values())
    before = sum(k.fast_launches for k in wrapped)
    calls.clear()
    step()
    launches, fast_ones = len(calls), sum(k.fast_launches for k in wrapped) - before
    modes = {False: lambda: launch.enabled(False), True: lambda: launch.enabled(True), "stub": sparse_stubbed}
    rounds: dict = {mode: [] for mode in modes}
    for _ in range(7):   # the modes' rounds interleaved, so a drift of the machine's speed moves all three alike
        for mode, context in modes.items():
            with context():
                rounds[mode].append(host_us(step, calls.clear, timed_steps, rounds=1) / 1e3)
    times = {mode: statistics.median(ms) for mode, ms in rounds.items()}
    stub_ms = times["stub"]
    counted = python_calls(step, calls.clear)
    with sparse_stubbed():
        stub_calls = python_calls(step, calls.clear)
    row = {"case": f"eager decode step, {LAYERS}-layer LLaMA 512 wide as load serves it (decode kernels, fused norms)",
           "launches_per_step": launches, "fast_launches_per_step": fast_ones,
           "host_ms_per_step_triton_dispatch": round(times[False], 3), "host_ms_per_step_fast": round(times[True], 3),
           "host_ms_per_step_sparse_stubbed": round(stub_ms, 3),
           "sparse_runtime_host_us_per_layer": round((times[True] - stub_ms) * 1e3 / LAYERS, 1),
           "sparse_runtime_python_calls_per_layer": round((counted - stub_calls) / LAYERS, 1)}
    print(f"{row['case']}: {launches} launches, {fast_ones} fast; {times[False]:.3f} → {times[True]:.3f} ms per step; "
          f"the sparse runtime {row['sparse_runtime_host_us_per_layer']} µs and "
          f"{row['sparse_runtime_python_calls_per_layer']} Python calls per layer", flush=True)
    return row


def check_gpu(calls: int) -> list[dict]:
    """Outputs with fast launches on against Triton's dispatch, and the host's µs per call both ways."""
    import torch

    from shuffleprune.kernels import launch

    rows = []
    for name, call in cases(torch.device("cuda"), torch.bfloat16):
        with launch.enabled(False):
            ref = call().clone()
            slow = host_us(call, torch.cuda.synchronize, calls)
        with launch.enabled(True):
            call(), call()
            out = call()
            fast = host_us(call, torch.cuda.synchronize, calls)
        torch.cuda.synchronize()
        rows.append({"case": name, "identical": bool(torch.equal(out, ref)), "host_us_triton_dispatch": slow,
                     "host_us_fast": fast})
        print(f"{name:55s} identical={rows[-1]['identical']}  {slow:7.2f} → {fast:7.2f} µs", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="run the kernels on CUDA (default: compile-only, no GPU)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the check compiles the kernels (for sm_90a without a GPU)")
    import torch

    from shuffleprune.outdir import atomic_write
    from shuffleprune.runtime.facts import machine, versions

    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or without --gpu")
    rows = check_gpu(args.calls) if args.gpu else check_recorded(args.calls)
    if args.gpu:
        ok = all(r["identical"] for r in rows)
    else:
        launches = [r for r in rows if "call" in r]
        thirds = [r for r in launches if r["call"] == 3]
        steps = [r for r in rows if "launches_per_step" in r]
        ok = bool(thirds) and all(r["identical"] and r["key_refines"] for r in launches) and \
            all(r["fast"] for r in thirds) and bool(steps) and \
            all(r["launches_per_step"] > 0 and r["fast_launches_per_step"] == r["launches_per_step"] for r in steps)
    out = Path(args.out or ROOT / "scripts" / "results" / f"fast_launch{'_cuda' if args.gpu else ''}.json")
    result = {"what": "fast launches (kernels/launch.py) against Triton's dispatch" + (
                  ", run on the GPU" if args.gpu else ", compile-only for sm_90a (launches recorded, not run)"),
              "ok": ok, "device": torch.cuda.get_device_name() if args.gpu else "none (compile-only, sm_90a)",
              "data": "random bf16 weights (2:4) and inputs, 512x1024 layers and 4 experts of 256x1024, 64-column "
                      "block maps; the decode step: a random 4-layer LLaMA (512 wide, 8 heads), an 8-token prompt "
                      "in a static cache, one token per step",
              "seed": 0, "calls": args.calls, "dtype": "bfloat16",
              "rows": rows, "command": "python " + " ".join(sys.argv), "machine": machine(),
              "versions": versions("triton")}
    atomic_write(out, lambda path: path.write_text(json.dumps(result, indent=1) + "\n"))
    print(f"{'ok' if ok else 'FAILED'}: {len(rows)} launches checked → {out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
