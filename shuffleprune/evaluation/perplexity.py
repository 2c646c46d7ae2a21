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
               batch_size: int = 1, progress: bool = False, bos: int | None = None) -> float:
    """Perplexity of ``model`` on ``tokens`` ``[1, T]`` in windows of ``ctx`` tokens. With ``bos``
    (a tokenizer that starts texts with it), every window is that token plus ``ctx − 1`` text tokens,
    all of which are predicted."""
    stream = tokens.reshape(-1)
    width = ctx - (bos is not None)
    n_windows = stream.numel() // width if width > 0 else 0
    if n_windows == 0:
        raise UserError(f"eval text has {stream.numel()} tokens, fewer than one window of {ctx}")
    windows = stream[: n_windows * width].reshape(n_windows, width)
    if bos is not None:
        windows = torch.cat([torch.full((n_windows, 1), bos, dtype=windows.dtype), windows], dim=1)
    total_nll, total_count = 0.0, 0
    for start in tqdm(range(0, n_windows, batch_size), desc="perplexity", disable=not progress, leave=False):
        batch = windows[start:start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                              reduction="sum")
        total_nll += float(nll)
        total_count += batch[:, 1:].numel()
    return math.exp(total_nll / total_count)


def scored_tokens(n_tokens: int, ctx: int, bos: int | None = None) -> int:
    """How many of ``n_tokens`` a :func:`perplexity` call scores (whole windows only)."""
    width = ctx - (bos is not None)
    return (n_tokens // width) * (ctx - 1) if width > 0 else 0
