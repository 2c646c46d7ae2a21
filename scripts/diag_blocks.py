"""Shared by the block diagnostics: the embedded model's decoder blocks fed the *dense* model's inputs."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class DenseBlock:
    index: int
    prefix: str                  # module path of the block, e.g. "model.layers.12"
    block: torch.nn.Module
    linears: dict                # name → nn.Linear
    stats: dict                  # name → InputStats of the dense inputs
    hidden: torch.Tensor         # the block's dense input, [windows, L, d]
    target: torch.Tensor         # its dense output
    captured: object             # CapturedInputs (extra args of the block's forward)
    device: torch.device


def dense_blocks(nsamples: int, seqlen: int, seed: int, upto: int, batch: int = 8) -> Iterator[DenseBlock]:
    """Blocks 0…``upto`` of the embedded SmolLM2 on ``nsamples``×``seqlen`` `wiki` calibration windows
    (``seed``), each with its input statistics and dense output; the next block gets that output."""
    from shuffleprune.block_inputs import capture_block_inputs, run_block
    from shuffleprune.blocks import block_linears, find_blocks
    from shuffleprune.calib import calibration_windows, get_source
    from shuffleprune.models import load_model
    from shuffleprune.prune.input_stats import collect_input_stats

    lm = load_model(None)
    blocks = find_blocks(lm.model)
    tokens = calibration_windows(get_source("wiki"), lm.tokenizer, nsamples, seqlen, seed)
    dev = torch.device("cpu")
    cap = capture_block_inputs(lm.model, blocks, tokens, dev, batch)
    hidden = cap.hidden
    for idx in range(upto + 1):
        block = blocks.layers[idx]
        prefix = blocks.prefix(idx)
        linears = block_linears(block, prefix)
        with collect_input_stats(linears, False) as stats:
            target = run_block(block, hidden, cap, idx, dev, batch)
        yield DenseBlock(idx, prefix, block, linears, stats, hidden, target, cap, dev)
        hidden = target
