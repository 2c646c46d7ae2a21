"""Learn cuSPARSELt's 2:4 layout on this GPU (the step before one weight copy serves both it and the decode kernels).

    python scripts/probe_sparse_tc.py            # CUDA → scripts/results/sparse_tc_layout.json
    python scripts/probe_sparse_tc.py --smoke    # CPU: the same steps with PyTorch's CUTLASS layout as the compressor

Prefill can only beat dense cuBLAS on the 2:4 sparse tensor cores, and on Hopper PyTorch reaches them
only through cuSPARSELt, whose compressed buffer (values, then metadata) is not documented; a second
compressed copy per layer would break the 0.6× weight-memory target. For bfloat16 and float16 this
script learns, with ``shuffleprune.deploy.sparse_layout``:

- whether the buffer starts with the export's ``values`` (row-major kept values), so a layer's values
  could *be* the head of cuSPARSELt's buffer and only the metadata differ;
- where each group's position code lies and how the six patterns are coded, on three small shapes,
  tiled and extended (``layout_at``) to larger ones, where the rebuilt buffer is compared with
  ``torch._cslt_compress`` bit for bit;
- whether cuSPARSELt multiplies correctly from a buffer this code built itself (values + metadata from
  the learned layout, no ``_cslt_compress``), against a dense matmul;
- whether PyTorch's own writer of the reverse-engineered cuSPARSELt format
  (``torch._sparse_semi_structured_tile``) matches this GPU's cuSPARSELt.

The speed side (cuSPARSELt with its searched algorithm against cuBLAS at 64–2048 tokens) is
``bench_kernel.py``'s ``cslt`` rows (``gpu_run.sh sparse_tc``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LEARN_SHAPES = [(256, 256), (512, 256), (256, 512)]   # three shapes fit the strides (a + b·R + c·C)
CHECK_SHAPES = [(1024, 768), (2048, 4096)]           # never probed: the extended layout must rebuild them
LARGE_SHAPE = (1024, 1024)                           # learned only where the small shapes show no tile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "sparse_tc_layout.json"))
    args = ap.parse_args()

    from shuffleprune.deploy.sparse_layout import (PATTERNS, LayoutError, dense_from_patterns, layout_at,
                                                   learn_layout, random_24)
    from shuffleprune.deploy.auto_choice import relative_error
    from shuffleprune.outdir import atomic_write
    from shuffleprune.runtime.facts import machine, versions

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke to check the steps on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        def compressor(dense: torch.Tensor) -> torch.Tensor:
            return torch._cslt_compress(dense.to(device)).cpu()
    else:
        from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

        def compressor(dense: torch.Tensor) -> torch.Tensor:
            values, meta = sparse_semi_structured_from_dense_cutlass(dense)
            return torch.cat([values.reshape(-1).view(torch.uint8), meta.reshape(-1).view(torch.uint8)])

    def locate_values(rows: int, cols: int, dtype: torch.dtype) -> dict:
        """Where each kept value lands (they are given distinct bit patterns): the buffer slot of kept
        value ``k`` of row ``r``, fitted as a tile like the metadata's, for a buffer whose values are
        not simply first or last."""
        from shuffleprune.deploy.sparse_layout import fit_tile

        kept = rows * cols // 2
        ids = torch.randint(len(PATTERNS), (rows, cols // 4), generator=torch.Generator().manual_seed(2))

        def with_codes(first: int) -> torch.Tensor:
            codes = (torch.arange(kept, dtype=torch.int32) + first).to(torch.int16).view(dtype)
            return compressor(dense_from_patterns(ids, dtype, codes)).reshape(-1).view(torch.int16).to(torch.int64)

        first = 0x3F80 if dtype == torch.bfloat16 else 0x3C00      # 1.0, then larger finite numbers
        buf = with_codes(first)
        moved = buf != with_codes(first + 0x100)    # the same patterns, other values: the metadata stays
        index = buf - first
        found = moved & (index >= 0) & (index < kept)
        slots = torch.full((kept,), -1, dtype=torch.int64)
        slots[index[found]] = torch.nonzero(found).reshape(-1)
        if bool((slots < 0).any()):
            return {"all_found": False}
        tile = fit_tile(slots.reshape(rows, -1))
        return {"all_found": True, "first_slots": slots[:16].tolist(), "tile": None if tile is None else vars(tile)}

    results: dict = {}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        entry: dict = {"learned": [], "checked": []}
        results[name] = entry
        t0 = time.perf_counter()
        try:
            learned = [learn_layout(compressor, r, c, dtype=dtype) for r, c in LEARN_SHAPES]
        except (LayoutError, RuntimeError) as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            if "kept values" in entry["error"]:
                entry["values"] = locate_values(128, 128, dtype)
            print(name, entry, flush=True)
            continue
        entry["learned"] = [l.describe() for l in learned]
        if any(l.tile is None for l in learned):   # no tiling within these shapes: one larger probe to show a tile
            try:
                entry["learned_large"] = learn_layout(compressor, *LARGE_SHAPE, dtype=dtype).describe()
            except (LayoutError, RuntimeError) as exc:
                entry["learned_large"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        entry["learn_s"] = round(time.perf_counter() - t0, 2)
        print(name, json.dumps(entry["learned"][0])[:600], flush=True)
        for rows, cols in CHECK_SHAPES:
            check: dict = {"shape": [rows, cols]}
            entry["checked"].append(check)
            try:
                layout = layout_at(learned, rows, cols)
            except LayoutError as exc:
                check["error"] = str(exc)
                continue
            dense = random_24(rows, cols, dtype, seed=rows + cols)
            built = layout.encode(dense)
            packed = compressor(dense)   # its shape (and dtype) are what cuSPARSELt's multiply takes
            check["rebuilds_compress"] = bool(torch.equal(built, packed.reshape(-1).view(torch.uint8)))
            if cuda:   # cuSPARSELt multiplying from the buffer built here, against a dense matmul
                x = torch.randn(64, cols, generator=torch.Generator().manual_seed(1)).to(device, dtype)
                try:
                    own = built.to(device).view(packed.dtype).reshape(packed.shape)
                    y = torch._cslt_sparse_mm(own, x.t(), transpose_result=True)
                    ref = torch.nn.functional.linear(x, dense.to(device))
                    check["max_rel_err_own_buffer"] = relative_error(y, ref)
                except RuntimeError as exc:
                    check["own_buffer_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                check["compressed_shape"] = list(packed.shape)
                try:   # its sparsifier may keep other pairs than ours: the values say whether the test is fair
                    tiled = torch._sparse_semi_structured_tile(dense.to(device), algorithm="", use_cutlass=False)[0]
                    tiled = tiled.reshape(-1).view(torch.uint8).cpu()
                    head = rows * cols   # bytes of values
                    check["torch_tile_same_values"] = bool(torch.equal(tiled[:head], built[:head]))
                    check["torch_tile_writer_matches"] = bool(torch.equal(tiled, built))
                except (RuntimeError, TypeError) as exc:
                    check["torch_tile_writer_matches"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(name, check, flush=True)

    cusparselt = None
    if cuda:
        try:
            cusparselt = torch.backends.cusparselt.version()
        except (AttributeError, RuntimeError):
            pass
    out = Path(args.out) if not args.smoke else Path(args.out).with_name("sparse_tc_layout_smoke.json")
    result = {"what": "cuSPARSELt's 2:4 compressed layout learned from probes (shuffleprune.deploy.sparse_layout)",
              "smoke": args.smoke,
              "compressor": "torch._cslt_compress" if cuda else "PyTorch's CUTLASS conversion (smoke stand-in)",
              "device": torch.cuda.get_device_name() if cuda else "cpu", "cusparselt_version": cusparselt,
              "learn_shapes": LEARN_SHAPES, "check_shapes": CHECK_SHAPES, "seed": 0,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "versions": versions("triton"), "layouts": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
