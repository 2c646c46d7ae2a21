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

from .errors import UserError


@torch.no_grad()
def perplexity(model: nn.Module, tokens: torch.Tensor, ctx: int, device: torch.device | str = "cpu",
               batch_size: int = 1, progress: bool = False) -> float:
    """Perplexity of ``model`` on ``tokens`` ``[1, T]`` in windows of ``ctx`` tokens."""
    stream = tokens.reshape(-1)
    n_windows = stream.numel() // ctx
    if n_windows == 0:
        raise UserError(f"eval text has {stream.numel()} tokens, fewer than one window of {ctx}")
    windows = stream[: n_windows * ctx].reshape(n_windows, ctx)
    total_nll, total_count = 0.0, 0
    for start in tqdm(range(0, n_windows, batch_size), desc="perplexity", disable=not progress, leave=False):
        batch = windows[start:start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                              reduction="sum")
        total_nll += float(nll)
        total_count += batch[:, 1:].numel()
    return math.exp(total_nll / total_count)
