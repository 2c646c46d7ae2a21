"""Reference run of llm-compressor (runs inside the separate bench venv; does not import shuffleprune).

Prunes an HF model dir with llm-compressor's SparseGPTModifier or WandaPruningModifier on the given
token windows and saves the pruned decoder-layer weights (uncompressed) plus timing/memory JSON.
"""
import argparse
import json
import resource
import time
from importlib.metadata import version

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--tokens", required=True, help="torch file with a [n, seqlen] LongTensor")
p.add_argument("--method", choices=["sparsegpt", "wanda"], required=True)
p.add_argument("--pattern", default="2:4")
p.add_argument("--out", required=True)
a = p.parse_args()

from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier  # noqa: E402

tokens = torch.load(a.tokens)
n, seqlen = tokens.shape
ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
common = dict(sparsity=0.5, mask_structure=a.pattern, targets=["Linear"], ignore=["re:.*lm_head"])
if a.method == "sparsegpt":
    recipe = SparseGPTModifier(block_size=128, dampening_frac=0.01, **common)
else:
    recipe = WandaPruningModifier(**common)
t0 = time.time()
oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=n, max_seq_length=seqlen,
        shuffle_calibration_samples=False, output_dir=None)
seconds = time.time() - t0
state = {k: v.contiguous() for k, v in model.state_dict().items() if ".layers." in k}
save_file(state, f"{a.out}/layers.safetensors")
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]  # ru_maxrss survives exec; VmHWM does not
peak = int(hwm[0].split()[1]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
json.dump({"seconds": seconds, "peak_rss_mb": peak,
           "llmcompressor": version("llmcompressor"), "transformers": version("transformers"),
           "torch": torch.__version__}, open(f"{a.out}/llmc_report.json", "w"))
