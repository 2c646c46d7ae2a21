"""Issue 24's targets read off the GPU results files: a short table of what holds and what does not.

    python scripts/gpu_targets.py                       # scripts/results/bench_kernel.json + bench_e2e.json
    python scripts/gpu_targets.py --kernel K.json --e2e E.json --json targets.json
    python scripts/gpu_targets.py --smoke --json x.json  # the CPU smoke runs' files (…_smoke.json, x_smoke.json)

Per layer (``bench_kernel.json``): ``auto`` at one token ≥ 1.5× dense, at 2–16 tokens ≥ 1.2×, never
slower than dense at any token count (and the same for ``auto_tiled``, the layer as ``load`` holds it on
Hopper, where timed); the index map's cost at one token ≤ 2 % (``auto`` with the map
against the same layer without one, ``auto_nomap``, or the map-free decode ``decode_nomap`` in older
files); the first two and the map's cost once more under a map within blocks of 64 columns, the kind
``prune`` makes (``auto_blockmap``; the table's random map spans all columns); beside them the
producer-side alternative: the
fused RMSNorm writing its output permuted against the plain norm). End to end (``bench_e2e.json``),
per variant: decode tokens/s ≥ 1.35× dense, prefill time ≤ 1.0× dense, weights ≤ 0.6× dense, peak
memory below dense. The largest relative error of any row against the dense bf16 product is printed
beside. Reads only; ``gpu_run.sh`` prints it last so the device call's reply ends with it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (target, the token counts it covers (lowest, highest), auto's least speed-up over dense there)
KERNEL_TARGETS = (("one token ≥1.5×", (1, 1), 1.5), ("2–16 tokens ≥1.2×", (2, 16), 1.2),
                  ("never slower", (1, float("inf")), 1.0))
MAP_COST_MAX = 0.02
# the layer as shuffleprune.load holds it on Hopper (serving.cslt_by_default): one cuSPARSELt buffer ("auto_tiled")
TILED_LABEL = ", cuSPARSELt buffer"
E2E_TARGETS = (("decode_speedup", ">=", 1.35), ("prefill_time_ratio", "<=", 1.0),
               ("weights_ratio", "<=", 0.6), ("peak_ratio", "<", 1.0))


def row_ms(rows: list[dict], shape: list[int], tokens: int, impl: str) -> float | None:
    """The time of ``impl`` on ``shape`` at ``tokens`` in ``rows`` (None where not timed, or where another
    implementation ran in its place: ``bench_kernel``'s ``ran``)."""
    return next((r["ms"] for r in rows if r.get("shape") == shape and r.get("tokens") == tokens
                 and r.get("impl") == impl and r.get("ms") and not r.get("ran")), None)


def kernel_checks(result: dict) -> list[dict]:
    """One line per target and shape: the worst ratio over the token counts it covers, and whether it holds;
    then the decode targets (1–16 tokens) and the map's cost once more for ``auto_blockmap``, the layer
    under a random map within blocks of 64 columns, the kind ``prune`` makes (``bench_kernel`` times it
    to 16 tokens); then the speed targets once more for ``auto_tiled``, the layer as ``shuffleprune.load``
    holds it on Hopper (one cuSPARSELt buffer: the decode kernels read it, and ``auto`` weighs cuSPARSELt's
    GEMM from 17 tokens), where the file has it."""
    rows, out = result["rows"], []
    shapes = sorted({tuple(r["shape"]) for r in rows}, key=lambda s: (s[1], s[0]))
    for shape in map(list, shapes):
        out += speed_checks(rows, shape, "auto", KERNEL_TARGETS)
        nomap = row_ms(rows, shape, 1, "auto_nomap") or row_ms(rows, shape, 1, "decode_nomap")
        out += map_cost_check(rows, shape, "auto", nomap, "map ≤2 % at one token (in the layer)")
        out += speed_checks(rows, shape, "auto_blockmap", KERNEL_TARGETS[:2], ", block map")
        out += map_cost_check(rows, shape, "auto_blockmap", row_ms(rows, shape, 1, "auto_nomap"),
                              "map ≤2 % at one token, block map")
        out += speed_checks(rows, shape, "auto_tiled", KERNEL_TARGETS, TILED_LABEL)
    return out


def speed_checks(rows: list[dict], shape: list[int], impl: str, targets: list, label: str = "") -> list[dict]:
    """Per target of ``targets``, ``impl``'s worst speed-up over dense among the token counts it covers."""
    speedups = {}
    for tokens in sorted({r["tokens"] for r in rows if r["shape"] == shape}):
        dense, ms = row_ms(rows, shape, tokens, "dense"), row_ms(rows, shape, tokens, impl)
        if dense and ms:
            speedups[tokens] = dense / ms
    out = []
    for target, (lowest, highest), floor in targets:
        covered = {t: v for t, v in speedups.items() if lowest <= t <= highest}
        if covered:
            worst = min(covered, key=covered.get)
            out.append({"shape": shape, "target": target + label, "worst": round(covered[worst], 3),
                        "at_tokens": worst, "ok": covered[worst] >= floor})
    return out


def map_cost_check(rows: list[dict], shape: list[int], impl: str, nomap: float | None, target: str) -> list[dict]:
    """``impl``'s cost at one token over the same layer without a map (``nomap`` ms), where both were timed."""
    ms = row_ms(rows, shape, 1, impl)
    if not (ms and nomap):
        return []
    cost = ms / nomap - 1
    return [{"shape": shape, "target": target, "worst": round(cost, 4), "at_tokens": 1, "ok": cost <= MAP_COST_MAX}]


def producer_map_costs(result: dict) -> list[dict]:
    """The fused norm's extra time over the plain RMSNorm at one token, per input width (a map moved to
    the producer costs this once per shared input instead of once per reading layer)."""
    out = []
    for width in sorted({r["width"] for r in result.get("norm_rows", [])}):
        ms = {r["impl"]: r["ms"] for r in result["norm_rows"] if r["width"] == width and r["tokens"] == 1}
        if ms.get("rmsnorm") and ms.get("rmsnorm_mapped"):
            out.append({"width": width, "extra_ms": round(ms["rmsnorm_mapped"] - ms["rmsnorm"], 5),
                        "ratio": round(ms["rmsnorm_mapped"] / ms["rmsnorm"], 3)})
    return out


def e2e_checks(result: dict) -> list[dict]:
    """One line per variant of the model (the top level is the layers holding their maps);
    ``load_default`` marks the one ``shuffleprune.load`` serves on the measured device."""
    variants = {"2:4 + maps in the layers": {k: result.get(k) for k, _, _ in E2E_TARGETS}}
    variants.update({k: v for k, v in result.items() if isinstance(v, dict) and "decode_speedup" in v})
    variants.update(result.get("partial", {}))
    out = []
    for name, ratios in variants.items():
        if all(ratios.get(k) is None for k, _, _ in E2E_TARGETS):
            continue   # not measured (a run cut off before it)
        checks = {}
        for key, op, bound in E2E_TARGETS:
            v = ratios.get(key)
            checks[key] = None if v is None else (v >= bound if op == ">=" else v <= bound if op == "<=" else v < bound)
        out.append({"variant": name, **{k: ratios.get(k) for k, _, _ in E2E_TARGETS},
                    "ok": all(c for c in checks.values() if c is not None), "checks": checks,
                    "load_default": name == result.get("load_default")})
    return out


def dependent_launches(result: dict) -> dict:
    """Of the ``auto`` rows that record their choices, how many ran one launched as a programmatic
    dependent (``+pdl``, ``kernels/overlap.py``) at their own token count."""
    from shuffleprune.deploy.input_gather import token_bucket

    rows = [r for r in result.get("rows", []) if r.get("impl", "").startswith("auto") and r.get("choice")]
    chosen = [r["choice"].get(str(token_bucket(r["tokens"])), "") for r in rows]
    return {"rows": len(rows), "pdl": sum(c.endswith("+pdl") for c in chosen)}


def stand_ins(result: dict) -> dict[str, int]:
    """``"impl → ran": rows`` for the rows whose implementation did not apply where it was timed, so another ran
    in its place (``bench_kernel``'s ``ran``: no sparse tensor cores, not Hopper, no tensor descriptors …)."""
    counts: dict[str, int] = {}
    for r in result.get("rows", []):
        if r.get("ran"):
            key = f"{r['impl']} → {r['ran']}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def max_error(result: dict) -> float | None:
    """The largest error relative to a dense bf16 matmul over the rows: of each row's eager call
    (``max_rel_err``) and of its last calls as the timed CUDA graph replayed them (``replayed_rel_err``)."""
    errs = [r[key] for r in result.get("rows", []) for key in ("max_rel_err", "replayed_rel_err")
            if r.get(key) is not None]
    return max(errs) if errs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default=None, help="default: scripts/results/bench_kernel.json")
    ap.add_argument("--e2e", default=None, help="default: scripts/results/bench_e2e.json")
    ap.add_argument("--json", default=None, help="also write the checks to this file")
    ap.add_argument("--smoke", action="store_true", help="read (and write) the CPU smoke runs' …_smoke.json files")
    args = ap.parse_args()
    tag = "_smoke" if args.smoke else ""
    args.kernel = args.kernel or str(ROOT / "scripts" / "results" / f"bench_kernel{tag}.json")
    args.e2e = args.e2e or str(ROOT / "scripts" / "results" / f"bench_e2e{tag}.json")
    if args.json and args.smoke:
        args.json = str(Path(args.json).with_name(Path(args.json).stem + "_smoke.json"))
    report: dict = {}
    for key, path in (("kernel", args.kernel), ("e2e", args.e2e)):
        if not Path(path).is_file():
            print(f"{key}: {path} missing")
            continue
        result = json.loads(Path(path).read_text())
        head = f"{key}: {result.get('device')} · complete {result.get('complete', '?')} · {Path(path).name}"
        if key == "kernel":
            checks = kernel_checks(result)
            report[key] = {"checks": checks, "producer_map": producer_map_costs(result),
                           "max_rel_err": max_error(result), "dependent_launches": dependent_launches(result),
                           "stand_ins": stand_ins(result)}
            print(head)
            for c in checks:
                print(f"  {'ok  ' if c['ok'] else 'MISS'} {c['shape'][0]:>5}x{c['shape'][1]:<5} {c['target']:<38}"
                      f" {c['worst']:>7} (tokens {c['at_tokens']})")
            for c in report[key]["producer_map"]:
                print(f"       fused norm with map, width {c['width']}: {c['ratio']}× the plain norm ({c['extra_ms']:+} ms)")
            print(f"  max relative error against dense bf16: {report[key]['max_rel_err']}")
            pdl = report[key]["dependent_launches"]
            print(f"  auto launched as a programmatic dependent in {pdl['pdl']} of its {pdl['rows']} rows")
            for swap, count in report[key]["stand_ins"].items():   # not these kernels' times: they did not run
                print(f"  did not apply, another ran in its place: {swap} ({count} rows)")
        else:
            checks = e2e_checks(result)
            report[key] = {"checks": checks}
            print(head)
            for c in checks:
                print(f"  {'ok  ' if c['ok'] else 'MISS'} {c['variant'][:60]:<60} decode {c['decode_speedup']}×"
                      f"  prefill {c['prefill_time_ratio']}×  weights {c['weights_ratio']}×  peak {c['peak_ratio']}×"
                      + ("  ← load's default" if c["load_default"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
