"""How ``torch.compile`` sees an export: graphs and graph breaks, dense against ``shuffleprune.load``.

    .venv/bin/python scripts/compile_graphs.py                  # llama, mixtral, gpt_oss, llama4_text
    .venv/bin/python scripts/compile_graphs.py --types llama

For each family a random model of 2 blocks (the arch sweep's sizes, ``scripts/arch_sweep.py``) is
pruned to 2:4 (``fast`` recipe, 4 windows × 32 tokens of random words), exported and loaded; then
``torch._dynamo.explain`` runs the dense original and the loaded export on the same 2 × 20 token ids
and reports how many graphs Dynamo made, how many breaks, and why (the first reasons). Every
``SparseLinear`` is one custom operator under Dynamo, so a dense-architecture export compiles to one
graph; the compressed experts forward is run eagerly (``torch.compiler.disable``): one break per MoE
layer. CPU only, no timing. Results: ``scripts/results/compile_graphs.json``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

TYPES = ["llama", "mixtral", "gpt_oss", "llama4_text"]


def explain(model, ids) -> dict:
    """Dynamo's graphs, breaks and the first break reasons for one forward of ``model`` on ``ids``."""
    import torch

    torch._dynamo.reset()
    out = torch._dynamo.explain(model)(ids)
    reasons = [str(getattr(b, "reason", b)).splitlines()[0][:200] for b in out.break_reasons]
    return {"graphs": out.graph_count, "graph_breaks": out.graph_break_count,
            "ops": out.op_count, "break_reasons": sorted(set(reasons))[:5]}


def one_family(model_type: str, tmp: Path, seed: int) -> dict:
    """Prune, export and load one family; Dynamo's view of the dense model and of the export."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import shuffleprune
    from arch_sweep import EXTRA, SIZE
    from bench_stage_cost import word_tokenizer
    from shuffleprune.deploy.export import export_checkpoint
    from shuffleprune.models import load_model
    from shuffleprune.prune import PruneConfig, prune

    torch.manual_seed(seed)
    src = tmp / model_type
    config = AutoConfig.for_model(model_type, **{**SIZE, **EXTRA.get(model_type, {})})
    dense = AutoModelForCausalLM.from_config(config).eval()
    dense.save_pretrained(src)
    tokenizer = word_tokenizer(SIZE["vocab_size"] - 1)
    tokenizer.save_pretrained(src)
    lm = load_model(str(src))
    lm.tokenizer = tokenizer
    rng = random.Random(seed)
    text = tmp / "text.txt"
    text.write_text("\n\n".join(" ".join(f"w{rng.randrange(255)}" for _ in range(60)) for _ in range(80)))
    cfg = PruneConfig.build("fast", model=str(src), pattern="2:4", calib=str(text), nsamples=4, seqlen=32,
                            batch_size=3, eval_text=None, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prune(cfg, out=tmp / "pruned", progress=False, loaded=lm)
        export_checkpoint(tmp / "pruned", tmp / "exported")
    ids = torch.randint(1, SIZE["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(seed))
    exported = shuffleprune.load(str(tmp / "exported"))
    with torch.no_grad():
        want = exported(ids).logits
        row = {"model_type": model_type, "dense": explain(dense, ids), "export": explain(exported, ids)}
        torch._dynamo.reset()
        got = torch.compile(exported, backend="aot_eager")(ids).logits
    row["export_compiled_max_abs_logit_diff"] = float((got - want).abs().max())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "compile_graphs.json"))
    args = ap.parse_args()

    from arch_sweep import SIZE
    from shuffleprune.runtime.facts import machine, versions

    rows = []
    result = {"what": "torch._dynamo.explain of a dense tiny model and of its 2:4 export loaded by shuffleprune.load",
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "seed": args.seed, "recipe": "fast",
              "model": {k: v for k, v in SIZE.items() if "token" not in k}, "input": "2 × 20 random token ids",
              "data": "random words, 4 windows × 32 tokens", "machine": machine(), "versions": versions(), "rows": rows}
    for model_type in args.types:
        with tempfile.TemporaryDirectory() as tmp:
            row = one_family(model_type, Path(tmp), args.seed)
        rows.append(row)
        print(f"{model_type:14s} dense {row['dense']['graphs']} graphs / {row['dense']['graph_breaks']} breaks, "
              f"export {row['export']['graphs']} / {row['export']['graph_breaks']}, "
              f"compiled |Δ| {row['export_compiled_max_abs_logit_diff']:.1e}", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
