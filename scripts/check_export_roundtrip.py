"""Round trip of a permuted 2:4 checkpoint through ``shuffleprune export``: logits, greedy tokens, size.

    .venv/bin/python scripts/check_export_roundtrip.py PRUNED_DIR [--out scripts/results/export_roundtrip.json]

Exports PRUNED_DIR (written by ``prune --perm …``), loads both, and compares on held-out windows:
max |Δlogit| (float32 on CPU), greedy ``generate`` tokens from several prompts, checkpoint bytes of
the dense original, the pruned dir and the export, and which permutations were folded.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pruned")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "export_roundtrip.json"))
    ap.add_argument("--text", default="brown")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    from shuffleprune.calib import eval_tokens, get_source
    from shuffleprune.deploy.export import export_checkpoint
    from shuffleprune.models import load_model
    from shuffleprune.runtime.facts import machine, versions
    from shuffleprune.deploy.sparse_linear import SparseLinear

    pruned = Path(args.pruned)
    report = json.loads((pruned / "prune_report.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        exported = Path(tmp) / "exported"
        fmt = export_checkpoint(pruned, exported)
        export_s = time.time() - t0
        ref = load_model(str(pruned))
        dep = load_model(str(exported))
        n_sparse = sum(isinstance(m, SparseLinear) for m in dep.model.modules())
        ids = eval_tokens(get_source(args.text), ref.tokenizer, args.windows * args.ctx).view(args.windows, args.ctx)
        with torch.no_grad():
            a, b = ref.model(ids).logits, dep.model(ids).logits
        max_abs = float((a - b).abs().max())
        same_gen = []
        for w in range(args.windows):
            prompt = ids[w:w + 1, :32]
            g1 = ref.model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
            g2 = dep.model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
            same_gen.append(bool(torch.equal(g1, g2)))
        sizes = {"dense_original_bytes": _bytes(Path(report["model_path"])), "pruned_dir_bytes": _bytes(pruned),
                 "exported_bytes": _bytes(exported),
                 "exported_sparse_file_bytes": (exported / "sparse.safetensors").stat().st_size}
    result = {
        "what": "export round trip: pruned (PermutedLinear, dense-masked) vs exported (SparseLinear, compressed)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), "versions": versions(),
        "pruned": str(pruned), "prune": {k: report.get(k) for k in ("model", "method", "pattern", "calib")},
        "perm": None if report.get("perm") is None else report["perm"].get("perm"),
        "dtype": "float32 (CPU)", "windows": args.windows, "ctx": args.ctx, "text": args.text,
        "max_abs_logit_diff": max_abs, "max_abs_logit": float(a.abs().max()),
        "greedy_tokens_identical": same_gen, "new_tokens": args.new_tokens,
        "sparse_layers": n_sparse, "runtime_gathers": len(fmt["runtime_gathers"]), "folded": fmt["folded"],
        "export_seconds": round(export_s, 1), **sizes,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("folded", "versions", "machine")}, indent=1))


if __name__ == "__main__":
    main()
