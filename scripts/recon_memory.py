"""What ``--recon model`` (recipe ``learned``) holds on a GPU at least, counted for real model shapes.

    .venv/bin/python scripts/recon_memory.py

The models are built on the meta device (no weights, no download) from their configs' shapes, in
bfloat16 as ``prune --dtype auto`` loads them on a GPU; the count is the model's parameters and
buffers plus ``recon_learning_bytes`` of the linears ``prune`` learns maps for: the pre-flight that
refuses a run the GPU cannot hold. Activations are not counted. Results:
``scripts/results/recon_memory.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {   # LlamaConfig keywords
    "LLaMA-2-7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000),
    "Llama-3.2-3B shape": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}


def learned_weights(model) -> dict:
    """Every decoder block's linears, by name: the weights ``--recon model`` learns maps for."""
    from shuffleprune.blocks import find_blocks, model_linears

    return model_linears(find_blocks(model))


def recon_lower_bound_bytes(model) -> int:
    """What ``--recon model`` holds on the GPU at least: the model and ``recon_learning_bytes`` of its
    blocks' linears (the pre-flight's count; activations not counted)."""
    from shuffleprune.perm.pruning import recon_learning_bytes
    from shuffleprune.runtime.memory import module_bytes

    return module_bytes(model) + recon_learning_bytes(learned_weights(model))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shuffleprune.perm.pruning import recon_learning_bytes
    from shuffleprune.runtime.facts import machine, versions
    from shuffleprune.runtime.memory import module_bytes

    rows = []
    for name, shape in SHAPES.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
        weights = learned_weights(model)
        held = module_bytes(model)
        learning = recon_learning_bytes(weights)
        rows.append({"model": name, "config": shape, "dtype": "bfloat16",
                     "parameters": sum(p.numel() for p in model.parameters()),
                     "learned_weights": sum(w.weight.numel() for w in weights.values()),
                     "model_gib": round(held / 2**30, 2), "learning_gib": round(learning / 2**30, 2),
                     "at_least_gib": round((held + learning) / 2**30, 1)})
        print(json.dumps(rows[-1]))
    out = ROOT / "scripts" / "results" / "recon_memory.json"
    out.write_text(json.dumps({"what": "--recon model's GPU memory at least (model + recon_learning_bytes), "
                                       "activations not counted; counted, not measured",
                               "machine": machine(), "versions": versions(), "command": "python " + " ".join(sys.argv),
                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
