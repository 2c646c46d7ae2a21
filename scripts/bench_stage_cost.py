"""Cost of every pruning stage per decoder block (seconds, peak memory), extrapolated to a whole model.

    python scripts/bench_stage_cost.py --device cuda                  # random LLaMA-2-7B-shaped blocks
    .venv/bin/python scripts/bench_stage_cost.py --smoke              # tiny shapes on the CPU (code paths only)

Builds a random-initialised LLaMA model with the shapes of LLaMA-2-7B's decoder blocks (hidden 4096,
MLP 11008, 32 heads) but only ``--layers`` of them, a word-level tokenizer and a text of random words
(nothing is downloaded), and prunes it with each ``--recipes`` entry (default: SparseGPT alone as
``balanced/permutation=none``, ``accurate`` (the default recipe), ``balanced``, ``best``) through the normal driver
(``shuffleprune.prune.prune``) at ``--nsamples`` × ``--seqlen`` calibration tokens. Each recipe's
``stage_cost`` (from its prune report: seconds, seconds per block, peak memory while the stage ran)
is written with its extrapolation to ``--model-blocks`` blocks (LLaMA-2-7B: 32). Random weights give
the cost, not the accuracy: the swap search's rounds depend on the scores, so its time on a trained
model can differ. Results are appended to ``scripts/results/bench_stage_cost.json``, rewritten after
every recipe (a run stopped by a time limit keeps the recipes it finished).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32}
SMOKE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4}


def word_tokenizer(words: int):
    """A word-level fast tokenizer over ``w0 … w{words-1}`` (no special tokens but ``<unk>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def random_text(path: Path, words: int, count: int, seed: int) -> None:
    """``count`` random words in documents of 1000, separated by blank lines."""
    rng = random.Random(seed)
    docs = [" ".join(f"w{rng.randrange(words)}" for _ in range(1000)) for _ in range(max(1, count // 1000))]
    path.write_text("\n\n".join(docs), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="default: float16 on CUDA (as LLaMA-2-7B ships), float32 on the CPU")
    ap.add_argument("--recipes", nargs="+", default=["balanced/permutation=none", "accurate", "balanced", "best"],
                    help="a preset or .yaml file, then optional /kind=name or /kind.param=value overrides (as --set)")
    ap.add_argument("--layers", type=int, default=2, help="decoder blocks built and pruned")
    ap.add_argument("--model-blocks", type=int, default=32, help="blocks of the model extrapolated to")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 8×64 tokens: checks the code paths")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_stage_cost.json"))
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shuffleprune.models import LoadedModel
    from shuffleprune.prune import PruneConfig, prune
    from shuffleprune.runtime.devices import pick_device

    if args.smoke:
        args.nsamples, args.seqlen, args.layers = 8, 64, 2
    device = pick_device(args.device)
    dtype_name = args.dtype or ("float16" if device.type == "cuda" else "float32")
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    shape = SMOKE if args.smoke else LLAMA7B
    words = 8000
    tokenizer = word_tokenizer(words)
    rows: list[dict] = []
    out = Path(args.out)
    existing = json.loads(out.read_text()) if out.is_file() and not args.smoke else {"runs": []}

    def write(rows: list[dict]) -> None:
        """This run's result so far, in place of its earlier partial entry (the smoke run prints it)."""
        result = _result(args, device, dtype_name, rows)
        if args.smoke:
            if len(rows) == len(args.recipes):
                print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "versions")}, indent=1))
            return
        out.write_text(json.dumps({**existing, "runs": existing["runs"] + [result]}, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "random_words.txt"
        random_text(text, words, max(200_000, 2 * args.seqlen), args.seed)
        for recipe in args.recipes:
            torch.manual_seed(args.seed)
            cfg = LlamaConfig(**shape, num_hidden_layers=args.layers, vocab_size=words + 1,
                              max_position_embeddings=max(4096, args.seqlen))
            model = LlamaForCausalLM(cfg).to(dtype).eval()
            loaded = LoadedModel(model=model, tokenizer=tokenizer, source="random", path="random")
            name, *overrides = recipe.split("/")
            config = PruneConfig.build(name, overrides=overrides, model="random", calib=str(text), nsamples=args.nsamples,
                                       seqlen=args.seqlen, seed=args.seed, eval_text=None, device=args.device,
                                       dtype=dtype_name, batch_size=args.batch_size)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
            report = prune(config, progress=False, loaded=loaded).report
            seconds = time.time() - t0
            cost = report["stage_cost"]
            per_block = sum(v["seconds_per_block"] for v in cost.values())
            rows.append({
                "recipe": recipe, "stages": report["stages"],
                "stage_cost": cost, "seconds_per_block": round(per_block, 3),
                "extrapolated_model_hours": round(per_block * args.model_blocks / 3600, 3),
                "wall_seconds": round(seconds, 1),
            })
            print(json.dumps(rows[-1]), flush=True)
            del model, loaded
            write(rows)


def _result(args: argparse.Namespace, device, dtype_name: str, rows: list[dict]) -> dict:
    import torch

    from shuffleprune.runtime.facts import machine, versions

    return {
        "what": ("tiny smoke shapes" if args.smoke else "random LLaMA-2-7B-shaped blocks") + f", {args.layers} blocks",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": dtype_name,
        "calibration": f"{args.nsamples}x{args.seqlen} tokens of random words, seed {args.seed}",
        "extrapolation": f"{args.model_blocks} blocks × the measured seconds per block of each stage",
        "rows": rows, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(), "versions": versions(),
    }


if __name__ == "__main__":
    main()
