"""The commands users type, run on a GPU: the command line's ``prune … --export`` (the default recipe),
``load`` onto the GPU, greedy ``generate`` with a static cache, ``eval``'s perplexity, ``finetune`` of that
checkpoint (its export's logits against it), ``dst`` with learned
maps (exported and loaded), every recipe of ``prune --device cuda``, the command line's run again and
the ``paper`` recipe again (same call, same checkpoint? ``paper`` learns its maps through the blocks'
backward pass, where a GPU's atomic adds may sum in any order), ``paper`` twice with ``--deterministic``
(PyTorch's deterministic algorithms: do those two agree, and at what cost in seconds?), ``dst
--deterministic``, and the default recipe on the CPU.

    python scripts/gpu_pipeline.py            # CUDA → scripts/results/gpu_pipeline.json
    python scripts/gpu_pipeline.py --smoke    # CPU, a tinier model: the code path only; nothing written

Until this script, the pruning pipeline had run on a GPU only as the permutation-learning cost
benchmark: a user's ``prune``, ``export``, ``eval`` and ``dst`` on CUDA had never run end to end.
Nothing is downloaded (a GPU machine without internet runs it): the model is a random LLaMA-shaped
decoder with grouped-query attention saved as an HF directory in bfloat16, its tokenizer a word-level
one, and the texts Zipf-distributed words from a fixed vocabulary (calibration and held-out files of
their own). Each row records what ran, whether it worked (the one-line error where not), seconds,
perplexities, whether every pruned layer is N:M, peak GPU memory and each stage's seconds per block;
the CPU row gives the perplexity the same command reaches on the CPU, which differs from the GPU's
only through rounding (the GPU computes in the checkpoint's bfloat16, the CPU in float32; masks flip at
near-ties), so the two should be close, not equal. The rows
are written after each (``complete: false`` until the last), in the order above.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))   # bench_stage_cost's word tokenizer, recon_memory's counts
from recon_memory import recon_lower_bound_bytes  # noqa: E402


def make_model_dir(path: Path, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int,
                   seed: int) -> list[str]:
    """A random LLaMA-shaped model (bfloat16, as users' checkpoints are) with the scripts' word-level
    tokenizer over ``vocab − 1`` words (``bench_stage_cost.word_tokenizer``) saved in ``path``; returns the
    words. No end-of-text token: a greedy generation runs its whole length."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from bench_stage_cost import word_tokenizer

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path)
    word_tokenizer(vocab - 1).save_pretrained(path)
    return [f"w{i}" for i in range(vocab - 1)]


def zipf_text(words: list[str], n_words: int, seed: int) -> str:
    """Paragraphs of words drawn by a Zipf law (rank r with weight 1/r), separated by blank lines."""
    import random

    rng = random.Random(seed)
    weights = [1.0 / (r + 1) for r in range(len(words))]
    out, left = [], n_words
    while left > 0:
        k = min(left, rng.randint(40, 120))
        out.append(" ".join(rng.choices(words, weights, k=k)))
        left -= k
    return "\n\n".join(out)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def buffers_row(model_dir: Path) -> dict:
    """On a machine with a GPU, does the loader ``prune`` and ``eval`` use give the model's buffers that
    its checkpoint does not hold (RoPE's ``inv_freq``) their values? Compared with the same config built
    in memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shuffleprune.models import load_model

    row = {"step": "load: buffers not in the checkpoint"}
    try:
        loaded = dict(load_model(str(model_dir)).model.named_buffers())
        built = dict(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).named_buffers())
        differ = [n for n, b in built.items() if n in loaded and not torch.equal(b.float(), loaded[n].float().cpu())]
        return {**row, "ok": not differ and loaded.keys() == built.keys(), "buffers": sorted(built), "differ": differ}
    except Exception as exc:   # noqa: BLE001 — a failing step is a row, not the end of the run
        return {**row, "ok": False, "error": one_line(exc)}


def prune_row(recipe: str, device: str, work: Path, model_dir: Path, calib: Path, heldout: Path, args,
              deterministic: bool = False) -> dict:
    """One ``shuffleprune.prune`` run of ``recipe`` on ``device`` (the Python API the command line calls),
    with ``deterministic`` under PyTorch's deterministic algorithms (``--deterministic``)."""
    import torch

    import shuffleprune

    out = work / f"{recipe}-{device}{'-deterministic' if deterministic else ''}"
    row = {"step": "prune", "recipe": recipe, "device": device, "deterministic": deterministic}
    t0 = time.perf_counter()
    try:
        result = shuffleprune.prune(str(model_dir), recipe=recipe, out=str(out), overwrite=True, calib=str(calib),
                                    eval_text=str(heldout), nsamples=args.nsamples, seqlen=args.seqlen,
                                    eval_ctx=args.seqlen, seed=args.seed, device=device, progress=False,
                                    deterministic=deterministic)
    except Exception as exc:   # noqa: BLE001 - a failing recipe is a result, the others still run
        traceback.print_exc()
        return {**row, "ok": False, "error": one_line(exc), "seconds": round(time.perf_counter() - t0, 2)}
    rep = result.report
    del result
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if recipe == "learned" and device == "cuda":   # the pre-flight's lower bound against the run's measured peak
        # (the report's peak_cuda_mb: the whole run's since 2026-11-28, before that the last stage's)
        row["recon_lower_bound_mb"] = round(recon_lower_bound(model_dir) / 2**20, 1)
        row["lower_bound_held"] = (rep.get("peak_cuda_mb") or 0) >= row["recon_lower_bound_mb"]
    return {**row, "ok": bool(rep.get("nm_ok")), "seconds": round(time.perf_counter() - t0, 2),
            "ran_on": rep.get("device"), "ppl_dense": rep["ppl"].get("dense"), "ppl_pruned": rep["ppl"].get("pruned"),
            "nm_ok": rep.get("nm_ok"), "sparsity": rep.get("sparsity"), "peak_cuda_mb": rep.get("peak_cuda_mb"),
            "stage_seconds_per_block": {k: v.get("seconds_per_block") for k, v in rep.get("stage_cost", {}).items()},
            "checkpoint_sha256": file_digest(out / "model.safetensors") if (out / "model.safetensors").is_file() else None}


def recon_lower_bound(model_dir: Path) -> int:
    """What ``--recon model`` holds on the GPU at least for the model as ``prune`` loads it
    (``recon_memory.recon_lower_bound_bytes``), to compare with its measured peak."""
    from shuffleprune.models import load_model

    return recon_lower_bound_bytes(load_model(str(model_dir)).model)


def cli_row(work: Path, model_dir: Path, calib: Path, heldout: Path, args, device: str, tag: str) -> dict:
    """``shuffleprune prune … --recipe accurate --export`` as a user types it, in a process of its own."""
    out, dep = work / f"cli-{tag}", work / f"cli-{tag}-deployed"
    cmd = [sys.executable, "-m", "shuffleprune", "prune", str(model_dir), "--recipe", "accurate", "--pattern", "2:4",
           "--calib", str(calib), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--seed",
           str(args.seed), "--eval-text", str(heldout), "--device", device, "--out", str(out), "--export", str(dep),
           "--overwrite", "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)   # not the checkout: its shuffleprune/ lacks calib/
    row = {"step": "cli prune --export", "tag": tag, "device": device, "rc": proc.returncode,
           "seconds": round(time.perf_counter() - t0, 2), "command": " ".join(["shuffleprune", *cmd[3:]])}
    if proc.returncode != 0:
        return {**row, "ok": False, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    rep = json.loads((out / "prune_report.json").read_text())
    return {**row, "ok": bool(rep.get("nm_ok")) and (dep / "config.json").is_file(), "ppl_pruned": rep["ppl"]["pruned"],
            "checkpoint_sha256": file_digest(out / "model.safetensors"), "out": str(out), "deployed": str(dep)}


def serving_row(pruned: Path, deployed: Path, heldout: Path, device: str) -> dict:
    """``load`` the export onto ``device`` against the pruned checkpoint in transformers: logits on a
    held-out prompt, greedy ``generate`` with a static cache, weight bytes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shuffleprune
    from shuffleprune.runtime.memory import module_bytes

    row = {"step": "load + generate", "device": device}
    try:
        tok = AutoTokenizer.from_pretrained(pruned)
        # one 64-token prompt for the logits and the generation: each token count the sparse layers see is
        # measured (and its kernels compiled) once, so few counts keep the step short
        ids = tok(" ".join(heldout.read_text().split()[:64]), return_tensors="pt").input_ids[:, :64].to(device)
        plain = AutoModelForCausalLM.from_pretrained(pruned, dtype=torch.bfloat16).to(device).eval()
        served = shuffleprune.load(str(deployed), device=device)
        with torch.no_grad():
            want, got = plain(ids).logits.float(), served(ids).logits.float()
            gen = dict(max_new_tokens=32, do_sample=False, cache_implementation="static")
            a = plain.generate(ids, **gen)[0, ids.shape[1]:]
            b = served.generate(ids, **gen)[0, ids.shape[1]:]
        same = int((a == b).sum())
        first_diff = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
        rel = float((got - want).abs().max() / want.abs().max())
        return {**row, "ok": rel < 2e-2 and len(b) == 32, "max_rel_logit_diff": rel,
                "greedy_tokens_equal": f"{same}/{len(a)}", "first_different_token": first_diff,
                "weights_mb_pruned": round(module_bytes(plain) / 2**20, 2), "weights_mb_deployed": round(module_bytes(served) / 2**20, 2),
                "served_linears": sorted({type(m).__name__ for m in served.modules() if hasattr(m, "in_features")})}
    except Exception as exc:   # noqa: BLE001
        traceback.print_exc()
        return {**row, "ok": False, "error": one_line(exc)}


def eval_row(pruned: Path, deployed: Path, heldout: Path, device: str, ctx: int) -> dict:
    """``shuffleprune.evaluate`` (``eval``'s Python form) on the perplexity task: pruned and deployed side by side."""
    import shuffleprune

    row = {"step": "eval ppl", "device": device}
    try:
        res = shuffleprune.evaluate([str(pruned), str(deployed)], tasks=["ppl"], ppl_text=str(heldout), ppl_ctx=ctx,
                                    device=device, dtype="bfloat16")
        ppls = [m["ppl"]["ppl"] if isinstance(m.get("ppl"), dict) else m.get("ppl") for m in res["models"]]
        return {**row, "ok": all(p == p and p > 0 for p in ppls) and abs(ppls[0] - ppls[1]) <= 0.02 * ppls[0],
                "ppl_pruned_bf16": ppls[0], "ppl_deployed_bf16": ppls[1]}
    except Exception as exc:   # noqa: BLE001
        traceback.print_exc()
        return {**row, "ok": False, "error": one_line(exc)}


def dst_row(work: Path, model_dir: Path, data: Path, args, device: str, deterministic: bool = False) -> dict:
    """``shuffleprune dst`` (2:4, learned maps; with ``deterministic``, ``--deterministic``) on ``device``, then
    its export loaded there: logits against the trained checkpoint."""
    tag = "-deterministic" if deterministic else ""
    out, dep = work / f"dst{tag}", work / f"dst{tag}-deployed"
    steps = args.dst_steps
    cmd = [sys.executable, "-m", "shuffleprune", "dst", "--arch", "llama", "--config-kw", args.dst_config,
           "--tokenizer", str(model_dir), "--data", str(data), "--method", "nm", "--pattern", "2:4", "--perm", "learned",
           "--steps", str(steps), "--delta-t", str(max(1, steps // 6)), "--warmup", str(max(1, steps // 10)),
           "--seq-len", str(args.seqlen), "--batch-size", "8", "--eval-every", "0", "--eval-tokens", "8192",
           "--checkpoint-every", "0", "--seed", str(args.seed), "--out", str(out), "--overwrite", "--quiet",
           *(["--deterministic"] if deterministic else [])]
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)   # as cli_row
    row = {"step": "dst", "device": device, "deterministic": deterministic, "rc": proc.returncode,
           "seconds": round(time.perf_counter() - t0, 2), "command": " ".join(["shuffleprune", *cmd[3:]])}
    return _trained_row(row, proc, out, dep, device)


def finetune_row(work: Path, pruned: Path, data: Path, args, device: str) -> dict:
    """``shuffleprune finetune`` of the command line's pruned checkpoint on ``device`` (``--dst-steps`` steps), then
    its export loaded there: logits against the fine-tuned checkpoint."""
    out, dep = work / "finetune", work / "finetune-deployed"
    steps = args.dst_steps
    cmd = [sys.executable, "-m", "shuffleprune", "finetune", str(pruned), "--data", str(data), "--steps", str(steps),
           "--warmup", str(max(1, steps // 10)), "--seq-len", str(args.seqlen), "--batch-size", "8", "--eval-every", "0",
           "--eval-tokens", "8192", "--checkpoint-every", "0", "--seed", str(args.seed), "--out", str(out),
           "--overwrite", "--quiet"]
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)   # as cli_row
    row = {"step": "finetune", "device": device, "rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 2),
           "command": " ".join(["shuffleprune", *cmd[3:]])}
    return _trained_row(row, proc, out, dep, device)


def _trained_row(row: dict, proc: subprocess.CompletedProcess, out: Path, dep: Path, device: str) -> dict:
    """A ``dst`` or ``finetune`` run's row: its error, or its perplexities and its export's logits against the
    trained checkpoint's on ``device``."""
    if proc.returncode != 0:
        return {**row, "ok": False, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    try:
        import torch
        from transformers import AutoModelForCausalLM

        import shuffleprune

        report = json.loads((out / "dst_report.json").read_text()) if (out / "dst_report.json").is_file() else {}
        shuffleprune.export(str(out / "model"), str(dep), overwrite=True, progress=False)
        ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(0)).to(device)
        plain = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).to(device).eval()
        served = shuffleprune.load(str(dep), device=device, dtype="float32")
        with torch.no_grad():
            want, got = plain(ids).logits, served(ids).logits
        rel = float((got - want).abs().max() / want.abs().max())
        return {**row, "ok": rel < 1e-3, "final_ppl": report.get("final_ppl", report.get("ppl")),
                "start_ppl": next((e["ppl"] for e in report.get("evals", []) if e["step"] == 0), None),
                "export_max_rel_logit_diff": rel}
    except Exception as exc:   # noqa: BLE001
        traceback.print_exc()
        return {**row, "ok": False, "error": one_line(exc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipes", nargs="+", default=None, help="default: every preset, the default recipe first")
    ap.add_argument("--cpu-recipes", nargs="*", default=["accurate"],
                    help="recipes also run on the CPU for the perplexity each device reaches")
    ap.add_argument("--repeat", nargs="*", default=["paper"],
                    help="recipes run a second time on the GPU: does the same call give the same checkpoint?")
    ap.add_argument("--dst-steps", type=int, default=60)
    ap.add_argument("--dst-config", default="hidden_size=256,intermediate_size=704,num_hidden_layers=2,"
                                            "num_attention_heads=4,num_key_value_heads=2")
    ap.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(ROOT / "scripts/results/gpu_pipeline.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model, every step once; nothing written")
    args = ap.parse_args()

    import tempfile

    import torch

    from shuffleprune.prune.recipes import DEFAULT_RECIPE, PRESETS

    if args.recipes is None:
        args.recipes = [DEFAULT_RECIPE, *(r for r in PRESETS if r != DEFAULT_RECIPE)]
    if args.smoke:
        args.hidden, args.inter, args.layers, args.heads, args.kv_heads, args.vocab = 128, 256, 2, 4, 2, 512
        args.nsamples, args.seqlen, args.dst_steps, args.recipes, args.cpu_recipes = 4, 64, 6, ["fast", "paper"], []
        args.dst_config = "hidden_size=64,intermediate_size=128,num_hidden_layers=1,num_attention_heads=4,num_key_value_heads=2"
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on the CPU")
        device = "cuda"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_pipeline_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run_steps(args, device, work)
    finally:
        if args.work is None:   # a temporary directory of its own: its checkpoints go with it
            shutil.rmtree(work, ignore_errors=True)


def run_steps(args: argparse.Namespace, device: str, work: Path) -> None:
    """Every step in order, each row printed and saved as it ends."""
    model_dir, calib, heldout = work / "model", work / "calib.txt", work / "heldout.txt"
    words = make_model_dir(model_dir, args.hidden, args.inter, args.layers, args.heads, args.kv_heads, args.vocab, args.seed)
    calib.write_text(zipf_text(words, args.nsamples * args.seqlen * 2, seed=1))
    heldout.write_text(zipf_text(words, 16 * args.seqlen, seed=2))
    rows: list[dict] = []
    started = time.perf_counter()

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        save(args, rows, complete=False)

    record(buffers_row(model_dir))   # a second or so
    # the default recipe and what users do with its output first, so that a step cut off by its time limit
    # keeps the rows that matter most; then the other recipes, then the CPU's perplexities
    first = cli_row(work, model_dir, calib, heldout, args, device, "1")
    record(first)
    if first["ok"]:
        record(serving_row(Path(first["out"]), Path(first["deployed"]), heldout, device))
        record(eval_row(Path(first["out"]), Path(first["deployed"]), heldout, device, args.seqlen))
    record(dst_row(work, model_dir, calib, args, device))
    if first["ok"]:
        record(finetune_row(work, Path(first["out"]), calib, args, device))
    for recipe in args.recipes:
        record(prune_row(recipe, device, work, model_dir, calib, heldout, args))
    if first["ok"]:
        again = cli_row(work, model_dir, calib, heldout, args, device, "2")
        api = next((r for r in rows if r.get("recipe") == "accurate" and r["device"] == device and r.get("ok")), None)
        again["same_checkpoint_as_first"] = again.get("checkpoint_sha256") == first["checkpoint_sha256"]
        again["same_checkpoint_as_api"] = api is not None and api["checkpoint_sha256"] == first["checkpoint_sha256"]
        record(again)
    def run_again(before: dict) -> None:
        """``before``'s call once more, as it ran: the same checkpoint?"""
        again = prune_row(before["recipe"], device, work, model_dir, calib, heldout, args, before["deterministic"])
        record({**again, "step": "prune again", "same_checkpoint_as_before":
                again.get("checkpoint_sha256") == before["checkpoint_sha256"]})

    for recipe in args.repeat:   # a recipe that trains through the blocks' backward (atomics on a GPU) once more
        before = next((r for r in rows if r.get("recipe") == recipe and r["device"] == device and r.get("ok")), None)
        if before is not None:
            run_again(before)
    for recipe in args.repeat:   # twice more with --deterministic: do those two agree, where the plain pair may not?
        first_det = prune_row(recipe, device, work, model_dir, calib, heldout, args, deterministic=True)
        record(first_det)
        if first_det["ok"]:
            run_again(first_det)
    record(dst_row(work, model_dir, calib, args, device, deterministic=True))   # does training run strict on the GPU?
    for recipe in args.cpu_recipes:
        record(prune_row(recipe, "cpu", work, model_dir, calib, heldout, args))
    print(f"all steps: {time.perf_counter() - started:.1f} s; failed: "
          f"{[r['step'] + ' ' + r.get('recipe', r.get('tag', '')) for r in rows if not r.get('ok')] or 'none'}")
    save(args, rows, complete=True)


def save(args: argparse.Namespace, rows: list[dict], complete: bool) -> None:
    """The results file, rewritten after every row (a step cut off by its time limit keeps the rows before it);
    a smoke run writes none."""
    if args.smoke:
        return
    import torch

    from shuffleprune.runtime.facts import machine, versions

    result = {"what": __doc__.splitlines()[0], "complete": complete, "command": " ".join(["python3", *sys.argv]),
              "model": {"kind": "random LlamaForCausalLM, bfloat16", "hidden": args.hidden, "intermediate": args.inter,
                        "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab},
              "data": f"Zipf-distributed words: calibration {args.nsamples}x{args.seqlen} tokens, held-out "
                      f"{16 * args.seqlen} words, seeds 1 and 2", "seed": args.seed, "context": args.seqlen,
              "machine": machine(), "versions": versions("triton", "accelerate"),
              "cuda": torch.version.cuda, "rows": rows}
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
