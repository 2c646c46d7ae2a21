"""Which Hugging Face decoder families ``dst`` trains N:M with learned index maps, exports and serves.

    .venv/bin/python scripts/dst_sweep.py                          # every family of the arch sweep, CPU
    .venv/bin/python scripts/dst_sweep.py --types llama mixtral     # some of them

The arch sweep (``scripts/arch_sweep.py``) prunes pretrained-shaped models; this one trains them
sparse from scratch, the other regime of the method. For each ``model_type`` of the arch sweep, a
random model at the same sizes (``SIZE`` and the family's ``EXTRA``) is trained by
``shuffleprune.dst.train`` for 6 steps of ``--method nm`` 2:4 with learned input permutations
(``--perm learned`` from a uniform soft start, hardened at step 5)
on random words (a word-level tokenizer; nothing is downloaded), exported, and loaded. A family
passes when every trained layer is N:M with its pruned weights zero and the export gives the
trained checkpoint's logits (the arch sweep's rule, ``agrees``: within 1e-5 of the largest logit or
4× what float32 rounding alone moves them). Each row records that difference,
the trained layers (expert matrices among them), the maps that are not the identity, the layers
the export compressed, the time, or the error. Results: ``scripts/results/dst_sweep.json``
(rewritten after every family).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("TRITON_INTERPRET", "1")


def one_family(model_type: str, tmp: Path, seed: int) -> dict:
    """Train, export and reload one family; the row of results."""
    import torch

    import shuffleprune
    from arch_sweep import EXTRA, SIZE, agrees, float32_noise
    from bench_stage_cost import word_tokenizer
    from shuffleprune.deploy.export import export_checkpoint
    from shuffleprune.dst.config import DSTConfig
    from shuffleprune.dst.config import TrainConfig
    from shuffleprune.dst.fresh_model import config_builder, unknown_config_keys
    from shuffleprune.dst.train import train
    from shuffleprune.models import load_model
    from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps

    tokenizer = word_tokenizer(SIZE["vocab_size"] - 1)
    tokenizer.save_pretrained(tmp / "tokenizer")
    rng = random.Random(seed)
    text = tmp / "text.txt"
    text.write_text("\n\n".join(" ".join(f"w{rng.randrange(255)}" for _ in range(60)) for _ in range(80)))
    size = {k: v for k, v in SIZE.items() if "token_id" not in k and k != "vocab_size"}
    config_kw = {**size, **EXTRA.get(model_type, {})}   # the sweep's sizes under every family's names: the family's
    unused = unknown_config_keys(config_builder(model_type), config_kw)   # own are passed (dst refuses the others)
    config_kw = {k: v for k, v in config_kw.items() if k not in unused}
    cfg = TrainConfig(arch=model_type, config_kw=config_kw, tokenizer=str(tmp / "tokenizer"),
                      data=str(text), seq_len=32, batch_size=4, steps=6, warmup=2, eval_every=3, eval_tokens=1024,
                      checkpoint_every=100, seed=seed)
    dcfg = DSTConfig(method="nm", pattern="2:4", sparsity=0.5, delta_t=2, t_end=4, perm="learned", t_perm=5,
                     lambda_max=1e-2, perm_init=0.0, seed=seed)   # a uniform start: the maps move
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = train(cfg, dcfg, tmp / "run", progress=False)
        fmt = export_checkpoint(tmp / "run" / "model", tmp / "exported")
    layers = report["layers"]
    maps_file = tmp / "run" / "model" / INDEX_MAPS
    maps = load_index_maps(maps_file) if maps_file.is_file() else {}
    moved = sum(not torch.equal(p, torch.arange(p.numel())) for p in maps.values())
    trained = load_model(str(tmp / "run" / "model")).model.eval()
    model = shuffleprune.load(str(tmp / "exported"))
    ids = torch.randint(1, SIZE["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = trained(ids).logits
        diff = float((model(ids).logits - ref).abs().max())
    noise = float32_noise(trained, ids)
    structured = all(l["n_of_m"] and l["pruned_weights_zero"] for l in layers.values())
    return {"model_type": model_type, "ok": structured and agrees(diff, ref, noise), "max_abs_logit_diff": diff,
            "max_rel_logit_diff": diff / float(ref.abs().max()), "float32_noise": noise,
            "trained_layers": len(layers), "trained_experts": sum(n.endswith("]") for n in layers),
            "n_of_m": structured, "maps": len(maps), "maps_not_identity": moved,
            "compressed_layers": len(fmt["layers"]), "compressed_expert_tensors": len(fmt.get("experts") or {}),
            "kept_dense": sorted(fmt.get("kept_dense") or []), "final_ppl": report.get("final_ppl"),
            "seconds": round(time.time() - t0, 1)}


def main() -> None:
    from arch_sweep import TYPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "dst_sweep.json"))
    args = ap.parse_args()

    from arch_sweep import SIZE, sweep
    from shuffleprune.runtime.facts import machine, versions

    result = {"what": "dst --method nm 2:4 --perm learned → export → load on tiny random models of each transformers "
                      "decoder family of the arch sweep (logits of the export against the trained checkpoint; a family "
                      "passes within 1e-5 of its largest logit or 4× the float32-vs-float64 difference of the "
                      "checkpoint's)",
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "seed": args.seed,
              "model": {k: v for k, v in SIZE.items() if "token" not in k},
              "training": "6 steps, batch 4 × 32 tokens, mask updates every 2 steps to step 4, maps hardened at step 5",
              "data": "random words (word-level tokenizer of 255 words)", "machine": machine(), "versions": versions()}
    sweep(args.types, lambda model_type, tmp: one_family(model_type, tmp, args.seed), result, Path(args.out))


if __name__ == "__main__":
    main()
