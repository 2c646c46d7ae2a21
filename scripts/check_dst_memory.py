"""How far a ``dst`` run's first steps grow past the lower bound its pre-flight refuses runs by.

    .venv/bin/python scripts/check_dst_memory.py            # the cases below, CPU, ~7 min

Each case trains a random model for 3 steps (``nm`` with learned maps, or ``rigl``) on random words, in a
process of its own; the process's resident memory just before the first step and its high-water mark
after the third give the growth, set beside ``shuffleprune.dst.train.training_step_bytes`` (logits,
log-softmax and its gradient; gradients and AdamW moments; activations not counted). The bound must
stay below every growth (it only refuses runs that cannot fit). Results:
``scripts/results/dst_memory.json``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [   # arch, hidden, blocks, batch, seq, method, tokenizer
    ("gpt2", 256, 4, 8, 256, "nm", "default"),
    ("gpt2", 256, 4, 16, 256, "nm", "default"),
    ("llama", 256, 4, 8, 256, "rigl", "default"),
    ("gpt2", 512, 8, 8, 256, "nm", "bpe:1024"),
    ("llama", 512, 8, 16, 512, "nm", "bpe:1024"),
]

CHILD = r"""
import json, sys
import torch
import shuffleprune.dst.train as T
from shuffleprune.dst.config import DSTConfig, TrainConfig
from shuffleprune.runtime.memory import peak_rss_mb

def resident_bytes():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) * 1024

seen = {}
step = T._train_step
def counted(model, *args, **kwargs):
    if 'before' not in seen:
        seen['before'] = resident_bytes()
        tokens = T_cfg.batch_size * T_cfg.seq_len
        seen['bound'] = T.training_step_bytes(model, tokens, torch.device('cpu'))
    out = step(model, *args, **kwargs)
    seen['after'] = round(peak_rss_mb() * 2**20)   # VmHWM
    return out
T._train_step = counted
arch, hidden, blocks, batch, seq, method, tok, data, out = sys.argv[1:]
hidden, blocks, batch, seq = int(hidden), int(blocks), int(batch), int(seq)
kw = {"gpt2": dict(n_embd=hidden, n_layer=blocks, n_head=4),
      "llama": dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=blocks, num_attention_heads=4,
                    num_key_value_heads=4)}[arch]
T_cfg = TrainConfig(arch=arch, config_kw=kw, tokenizer=tok, data=data, seq_len=seq, batch_size=batch, steps=3, warmup=0,
                    eval_every=0, eval_tokens=seq, checkpoint_every=0)
T.train(T_cfg, DSTConfig(method=method, perm="learned" if method == "nm" else "none"), out, progress=False, stop_after=3)
print(json.dumps(seen))
"""


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import random_text
    from shuffleprune.runtime.facts import machine, versions

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "text.txt"
        data.write_text(random_text(300_000, 1))
        for i, case in enumerate(CASES):
            res = subprocess.run([sys.executable, "-c", CHILD, *map(str, case), str(data), f"{tmp}/out{i}"],
                                 capture_output=True, text=True, check=True)
            seen = json.loads(res.stdout.strip().splitlines()[-1])
            growth = seen["after"] - seen["before"]
            row = dict(zip(("arch", "hidden", "blocks", "batch", "seq", "method", "tokenizer"), case),
                       bound_mib=round(seen["bound"] / 2**20, 1), growth_mib=round(growth / 2**20, 1),
                       growth_over_bound=round(growth / seen["bound"], 2))
            rows.append(row)
            print(row, flush=True)
    result = {"what": "dst: the first 3 steps' memory growth on the CPU against training_step_bytes (the pre-flight's lower bound)",
              "command": "python scripts/check_dst_memory.py", "data": "random words (300 000), seed 1",
              "seed": 0, "machine": machine(), "versions": versions(), "rows": rows,
              "bound_below_every_growth": all(r["growth_over_bound"] > 1 for r in rows)}
    out = ROOT / "scripts" / "results" / "dst_memory.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
