"""What ``auto``'s warm-up costs a new process, and what its stored choices save (``deploy/choice_store.py``).

    python scripts/bench_warm_start.py            # CUDA → scripts/results/bench_warm_start.json
    python scripts/bench_warm_start.py --smoke    # CPU, a small config: checks the code path only (prints, writes nothing)

Three processes, one after the other, each building the same random LLaMA-2-7B-shaped model (``--layers``
decoder layers: every layer is of a kind the first one measures, so more layers add load time, not
measuring), 2:4 with block index maps as ``export`` leaves it and laid out as ``load`` serves it
(``arrange_for_serving``), bf16, then timing its first prompt (``--prompt`` tokens, eager) and first
decode step, against the same calls once warm:

- ``cold``: an empty Triton cache and an empty choice store (a new machine: Triton compiles, ``auto``
  measures every kind of layer);
- ``measured``: Triton's cache as ``cold`` left it, the store turned off (``SHUFFLEPRUNE_AUTO_STORE=0``):
  ``auto``'s measuring alone, as every restart paid it before the store;
- ``stored``: both caches as ``cold`` left them (a restarted server).

Each row: ``first_prefill_s``, ``first_step_s`` (wall, synchronized), the warm ``prefill_s`` / ``step_s``
(median of 3), ``stored_at_start`` (answers in the store for this GPU when the process began) and the
kernels chosen (``choices``: per kind of layer and token bucket, in a CUDA graph and eagerly). ``stored``'s choices equal ``cold``'s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = {"cold": {}, "measured": {"SHUFFLEPRUNE_AUTO_STORE": "0"}, "stored": {}}


def child(args: argparse.Namespace) -> dict:
    """Build, lay out and time the model in this process (module docstring); the row."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

    from bench_e2e import set_cache_length, sparsify_like_export, wall_seconds
    from shuffleprune.deploy import choice_store
    from shuffleprune.deploy.serving import arrange_for_serving
    from shuffleprune.deploy.sparse_linear import SparseLinear

    cuda = not args.smoke
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stored_at_start = choice_store.stored_count(device) if cuda else 0
    if args.smoke:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=args.layers, num_attention_heads=4,
                          vocab_size=1000, max_position_embeddings=1024)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=args.layers,
                          num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):   # initialised where it runs, as bench_e2e does
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    sparsify_like_export(model, torch.Generator().manual_seed(0))
    arrange_for_serving(model)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device=device)
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + 8)
    positions = torch.arange(args.prompt, device=device)
    tok, pos = ids[:, -1:].clone(), torch.tensor([args.prompt], device=device)

    def wall(fn) -> float:
        return wall_seconds(fn, sync)

    def prefill() -> None:
        set_cache_length(cache, 0)
        model(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True)

    def step() -> None:
        set_cache_length(cache, args.prompt)
        model(input_ids=tok, past_key_values=cache, cache_position=pos, position_ids=pos.unsqueeze(0), use_cache=True)

    with torch.no_grad():
        first_prefill_s, first_step_s = wall(prefill), wall(step)
        prefill_s = statistics.median(wall(prefill) for _ in range(3))
        step_s = statistics.median(wall(step) for _ in range(3))
    layers = {id(m): m for m in model.modules() if isinstance(m, SparseLinear)}
    layers.update({id(m.fused_inputs.stacked): m.fused_inputs.stacked for m in list(layers.values())
                   if m.fused_inputs is not None and m.fused_inputs.stacked is not None})   # q/k/v, gate/up stacked
    choices = {f"{m.out_features}x{m.in_features}{'+map' if m.perm is not None else ''} @{b}":
               [m.choices[b], m.eager_choices[b]] for m in layers.values() for b in m.choices}
    return {"first_prefill_s": round(first_prefill_s, 3), "first_step_s": round(first_step_s, 4),
            "prefill_s": round(prefill_s, 4), "step_s": round(step_s, 5), "stored_at_start": stored_at_start,
            "stored_at_end": choice_store.stored_count(device) if cuda else 0, "choices": choices}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_warm_start.json"))
    args = ap.parse_args()
    if args.smoke:
        args.prompt = 32
    if args.child:
        print(json.dumps(child(args)))
        return

    import torch

    from shuffleprune.outdir import atomic_write
    from shuffleprune.runtime.facts import machine, versions

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke on CPU")
    rows: list[dict] = []

    def save(complete: bool) -> None:
        """Write the results file (after each process, so a run cut off by its time limit keeps its rows)."""
        result = {"complete": complete,
                  "what": "a new process's first prompt and decode step: cold (Triton compiles, auto measures), "
                          "auto measuring alone (its store off), auto's stored choices (a restart)"
                          + (" (smoke)" if args.smoke else ""),
                  "model": f"random LLaMA-2-7B-shaped, {args.layers} layers, 2:4 with block index maps, "
                           "laid out as load serves it", "dtype": "float32 (smoke)" if args.smoke else "bfloat16",
                  "prompt": args.prompt, "batch": 1, "seed": 0,
                  "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
                  "same_choices_when_stored": rows[0]["choices"] == rows[2]["choices"] if complete else None,
                  "rows": rows, "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
                  "versions": versions("triton")}
        if args.smoke:   # the code path checked; no results file touched
            if complete:
                print(json.dumps(result, indent=1, ensure_ascii=False))
            return
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda tmp: tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n"))

    with tempfile.TemporaryDirectory() as caches:
        env = dict(os.environ, SHUFFLEPRUNE_CACHE=str(Path(caches) / "shuffleprune"),
                   TRITON_CACHE_DIR=str(Path(caches) / "triton"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")])))
        env.pop("SHUFFLEPRUNE_AUTO_STORE", None)
        command = [sys.executable, str(Path(__file__).resolve()), "--child", "--layers", str(args.layers),
                   "--prompt", str(args.prompt), *(["--smoke"] if args.smoke else [])]
        for name, extra in PROCESSES.items():
            t = time.perf_counter()
            done = subprocess.run(command, env={**env, **extra}, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the {name} process failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
            rows.append({"process": name, **json.loads(done.stdout.strip().splitlines()[-1]),
                         "process_s": round(time.perf_counter() - t, 2)})
            print(json.dumps(rows[-1]), flush=True)
            save(complete=len(rows) == len(PROCESSES))

if __name__ == "__main__":
    main()
