"""Perplexity: the one implementation used by ``prune`` reports, ``eval`` and the benchmarks.

Non-overlapping windows of ``ctx`` tokens over one token stream (the SparseGPT/Wanda recipe);
the trailing partial window is dropped; ppl = exp(mean next-token NLL over all predicted tokens).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from shuffleprune.errors import UserError


@torch.no_grad()
def perplexity(model: nn.Module, tokens: torch.Tensor, ctx: int, device: torch.device | str = "cpu",
               batch_size: int = 1, progress: bool = False, bos: int | None = None, blockwise: bool = False) -> float:
    """Perplexity of ``model`` on ``tokens`` ``[1, T]`` in windows of ``ctx`` tokens. With ``bos``
    (a tokenizer that starts texts with it), every window is that token plus ``ctx − 1`` text tokens,
    all of which are predicted. ``blockwise``: the model stays where it is (the CPU) and only one
    decoder block at a time is on ``device``, all windows passing through it before the next (as
    SparseGPT scores models larger than the GPU); otherwise the model must be on ``device``."""
    if ctx < 2:
        raise UserError(f"a perplexity window needs at least 2 tokens, got {ctx}")
    stream = tokens.reshape(-1)
    width = ctx - (bos is not None)   # ≥ 1
    n_windows = stream.numel() // width
    if n_windows == 0:
        count = f"{stream.numel()} token" + ("" if stream.numel() == 1 else "s")
        raise UserError(f"the perplexity text has {count}, fewer than one window of {ctx}; give a "
                        "longer text (or more of it: --eval-tokens / --ppl-tokens) or a shorter window "
                        "(--eval-ctx / --ppl-ctx)")
    windows = stream[: n_windows * width].reshape(n_windows, width)
    if bos is not None:
        windows = torch.cat([torch.full((n_windows, 1), bos, dtype=windows.dtype), windows], dim=1)
    if blockwise:
        total_nll = _blockwise_nll(model, windows, torch.device(device), batch_size, progress)
    else:
        total_nll = 0.0
        for start in tqdm(range(0, n_windows, batch_size), desc="perplexity", disable=not progress, leave=False):
            batch = windows[start:start + batch_size].to(device)
            total_nll += _nll(model(input_ids=batch, use_cache=False).logits, batch)
    return math.exp(total_nll / (n_windows * (windows.shape[1] - 1)))


def _nll(logits: torch.Tensor, batch: torch.Tensor) -> float:
    """Summed next-token negative log-likelihood of ``batch`` under ``logits``."""
    logits = logits.float()
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                 reduction="sum"))


def _blockwise_nll(model: nn.Module, windows: torch.Tensor, device: torch.device, batch_size: int,
                   progress: bool) -> float:
    """:func:`_nll` over all windows, the blocks run one at a time on ``device`` (all windows through
    one block before the next; their hidden states kept where the model is), then the model's own
    code after its blocks (final norm, LM head, …) on ``device``."""
    from shuffleprune.block_inputs import capture_block_inputs, logits_after_blocks, outside_blocks_on, run_blocks
    from shuffleprune.blocks import find_blocks

    blocks = find_blocks(model)
    home = next(model.parameters()).device
    captured = capture_block_inputs(model, blocks, windows, device, batch_size)
    hidden = run_blocks(blocks, captured.hidden.to(home), captured, device, batch_size, progress)
    total = 0.0
    with outside_blocks_on(model, blocks, device):
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start:start + batch_size].to(device)
            last = hidden[start:start + batch_size].to(device)
            total += _nll(logits_after_blocks(model, blocks, batch, last, captured), batch)
    return total


def scored_tokens(n_tokens: int, ctx: int, bos: int | None = None) -> int:
    """How many of ``n_tokens`` a :func:`perplexity` call scores (whole windows only)."""
    width = ctx - (bos is not None)
    return (n_tokens // width) * (ctx - 1) if width > 0 else 0
