"""What the kernel tuning scripts (``tune_kernel.py``, ``tune_sparse_mma.py``, ``tune_sparse_gemm.py``) share: the GPU
or the CPU smoke's device, a random 2:4 layer and input, and how many weight copies a timing rotates through."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

ROTATE_L2 = 2.5   # the rotated copies of a weight together hold this many times the L2, so none is read from it
REFUSED_REL_ERR = 2e-2   # a checked launch this far off the dense bf16 product (relative) is wrong: not timed


def add_timing_args(ap: argparse.ArgumentParser, out: Path) -> None:
    """The options every tuning script takes: ``--reps`` (CUDA graph replays a timing), ``--smoke`` (the CPU check of
    the code path) and ``--out`` (its results file, default ``out``)."""
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(out))


def timing_device(smoke: bool) -> torch.device:
    """The CUDA device, or the CPU for ``--smoke``; without a GPU and without ``--smoke``, exit in one line."""
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke to check the code path on the CPU")
    return torch.device("cpu" if smoke else "cuda")


def timing_setup(args: argparse.Namespace, smoke_shapes: list[tuple[int, int]]):
    """``(device, cuda, shapes, l2 bytes, SMs)`` of a tuning run: the GPU's, with ``args.shapes`` (``OUTxIN``); or for
    ``--smoke`` the CPU's with ``smoke_shapes``, an emulated GPU of 4 SMs, and the tests' folder on the path (their
    emulator runs the CUDA kernels there)."""
    import sys

    from shuffleprune.kernels.gpu import l2_bytes

    dev = timing_device(args.smoke)
    cuda = dev.type == "cuda"
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        shapes = smoke_shapes
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 4
    return dev, cuda, shapes, l2_bytes(dev), sms


def random_24_layer(out_f: int, in_f: int, tokens: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """A random 2:4 weight ``[out_f, in_f]`` (by magnitude), its kept values and position words, and ``tokens`` random
    inputs: ``(w, values, words, x)``, on the CPU."""
    from shuffleprune.deploy.format import compress
    from shuffleprune.kernels.nm_words import position_words
    from shuffleprune.masks import nm_keep_mask

    w = torch.randn(out_f, in_f, generator=gen)
    w = (w * nm_keep_mask(w.abs(), 2, 4)).to(dtype)
    values, meta = compress(w, 2, 4)
    return w, values, position_words(meta), torch.randn(tokens, in_f, generator=gen).to(dtype)


def rotated_copies(values: torch.Tensor, l2: int, cuda: bool) -> int:
    """How many copies of a 2:4 weight (``values`` and position words: 9/8 of the values' bytes) a timing cycles
    through so they hold :data:`ROTATE_L2` times the L2 together, at least 4 (one on the CPU)."""
    return max(4, -(-int(ROTATE_L2 * l2) // (values.numel() * values.element_size() * 9 // 8))) if cuda else 1


def dense_ms(x: torch.Tensor, w: torch.Tensor, copies: int, reps: int) -> float:
    """cuBLAS's time for ``x @ wᵀ`` over ``max(4, copies // 2)`` copies of the dense weight (twice the 2:4 one's bytes
    each) in one CUDA graph, the median replay (``runtime.timing.cuda_graph_ms``)."""
    import torch.nn.functional as F

    from shuffleprune.runtime.timing import cuda_graph_ms

    dense = [w] + [w.clone() for _ in range(max(4, copies // 2) - 1)]
    return cuda_graph_ms([lambda d=d: F.linear(x, d) for d in dense], reps)[0]


def run_facts(smoke: bool, cuda: bool) -> dict:
    """What a tuning run's results file records about the run: smoke or not, the seed, the device, the command,
    the machine and the versions (``runtime.facts.machine``, ``runtime.facts.versions``)."""
    import sys

    from shuffleprune.runtime.facts import machine, versions

    return {"smoke": smoke, "seed": 0, "device": torch.cuda.get_device_name() if cuda else "cpu (emulator)",
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
            "versions": versions("triton")}


def sparse_mma_variants(shapes, tokens_list, sms: int, pdl_tokens=()):
    """The sparse-MMA decode's launches (``kernels/nm_sparse_mma.py``) for ``shapes`` and ``tokens_list`` on a GPU of
    ``sms`` SMs: dicts of ``shape``, ``tokens``, ``mapped``, ``pdl``, ``tall``, ``inline`` and the ``plan``. The map
    read in the kernel to 16 tokens (staged, and read inline by each B load), launched as a programmatic dependent at
    ``pdl_tokens``, and the tall plan where ``auto`` weighs it (``tall_worth_weighing``)."""
    import itertools

    from shuffleprune.kernels import sparse_mma_tiles as tiles

    for shape, tokens in itertools.product(shapes, tokens_list):
        for mapped in (False, True) if tokens <= tiles.MAPPED_MAX_TOKENS else (False,):
            kinds = [(pdl, False, False) for pdl in ((False, True) if tokens in pdl_tokens else (False,))]
            if mapped:
                kinds.append((False, False, True))
            if tiles.tall_worth_weighing(tokens, *shape, sms, mapped):
                kinds.append((False, True, False))
            for pdl, tall, inline in kinds:
                plan = (tiles.tall_plan if tall else tiles.sparse_mma_plan)(tokens, *shape, sms=sms, mapped=mapped,
                                                                       **({"inline_map": True} if inline else {}))
                yield {"shape": shape, "tokens": tokens, "mapped": mapped, "pdl": pdl, "tall": tall, "inline": inline,
                       "plan": plan}


def wgmma_gemm_forms() -> list[tuple[tuple[int, int, int, int], bool]]:
    """``(tile, mapped)`` of every wgmma form of the prompt GEMM (``kernels/nm_sparse_gemm.py``): its GEMM tiles and
    decode tiles, then the decode tiles that read a map (up to ``WGMMA_MAPPED_MAX_TOKENS`` tokens)."""
    from shuffleprune.kernels import sparse_gemm_tiles as gemm_tiles

    forms = [(tile, False) for tile in dict.fromkeys((*gemm_tiles.WGMMA_TILES, *gemm_tiles.WGMMA_DECODE_TILES.values()))]
    return forms + [(tile, True) for bn, tile in gemm_tiles.WGMMA_DECODE_TILES.items() if bn <= gemm_tiles.WGMMA_MAPPED_MAX_TOKENS]


HUNG_EXIT = 75          # a tuning process's exit status where a launch never finished (hung_marker says which)
HANG_LIMIT_S = 10.0     # a check launch still running this long after it was issued (its compile done) is hung


def hung_marker(out: Path) -> Path:
    """Where a tuning run whose results file is ``out`` names the launch that hung (``<out>_hung.json``); removed
    at the run's start, so one found after it is that run's."""
    return out.with_name(out.stem + "_hung.json")


def checked_launch(run, label: dict, out: Path, limit_s: float = HANG_LIMIT_S):
    """``run()`` (one kernel launch, compiled on its first call) and its wait on the GPU
    (``runtime.faults.finish_or_fault``): where the kernel has not finished ``limit_s`` seconds after its launch it is
    taken as hung (a wrong barrier or loop on a GPU never returns, and the step's time limit would take the whole
    step with it). The process then writes ``label`` to :func:`hung_marker` and exits at once with
    :data:`HUNG_EXIT`, without the interpreter's cleanup (which could wait on the GPU); ``gpu_run.sh`` leaves that
    kernel out of the steps after. On the CPU, ``run()`` alone."""
    import json

    from shuffleprune.runtime.faults import DeviceFault, finish_or_fault

    y = run()
    try:
        finish_or_fault(y, json.dumps(label), limit_s=limit_s)
    except DeviceFault as exc:
        _end_hung(exc, label, out, limit_s)
    return y


def checked_timing(calls: list, reps: int, label: dict, out: Path, outputs: list | None = None,
                   limit_s: float = HANG_LIMIT_S) -> float:
    """``runtime.timing.cuda_graph_ms`` of ``calls`` (ms per call), each wait for the GPU bounded by ``limit_s``: a launch
    whose check finished but that never finishes in the warm rounds or as replayed in the graph ends the process
    as :func:`checked_launch` does, named in :func:`hung_marker`."""
    import json

    from shuffleprune.runtime.faults import DeviceFault
    from shuffleprune.runtime.timing import cuda_graph_ms

    try:
        return cuda_graph_ms(calls, reps, outputs=outputs, what=json.dumps(label), limit_s=limit_s)[0]
    except DeviceFault as exc:
        _end_hung(exc, {**label, "timed": True}, out, limit_s)


def _end_hung(exc: Exception, label: dict, out: Path, limit_s: float):
    """Name the launch that hung in :func:`hung_marker` and end the process at once with :data:`HUNG_EXIT`."""
    import json
    import os

    hung_marker(out).write_text(json.dumps({**label, "seconds": limit_s}) + "\n")
    print(f"hung: {exc}; the process ends (exit {HUNG_EXIT})", flush=True)
    os._exit(HUNG_EXIT)
