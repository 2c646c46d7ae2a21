"""Which weight element and which input column a sparse-MMA kernel paired for each output: a probe for a kernel whose
output disagrees with the reference on a GPU (a fragment, descriptor or metadata read another way than the kernel's
text assumes), so the next fix can be worked out from its results file alone.

Two weights with the same random 2:4 positions, their kept values exact small integers: the row's number + 1
(``rows``) and the column's number + 1 (``cols``); the input one-hot, token ``t`` holding 1 at column ``c_t`` (distinct
columns). Then every output is one weight element: ``y[t, r] = W[r, c_t]``, exact in fp32 and in 16 bits (integers up
to 256), so a wrong output names the row or column the kernel used instead. ``tune_sparse_gemm.py`` runs it on each
tile whose output it refuses.
"""
from __future__ import annotations

from typing import Callable

import torch

PROBE_EXAMPLES = 12   # wrong outputs kept per probe, with what they should have been


def probe_weights(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep, by_row, by_col)``: a random 2:4 mask ``[rows, cols]`` (positions varied per group) and the two probe
    weights, ``r + 1`` and ``c + 1`` where kept, in float32."""
    if rows > 256 or cols > 256:
        raise ValueError(f"the probe's values are integers up to 256 (exact in 16 bits): {rows} x {cols} is too large")
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, cols // 4, 4, generator=g)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, scores.topk(2, dim=2).indices, True)
    keep = keep.reshape(rows, cols)
    r = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, cols)
    c = torch.arange(cols, dtype=torch.float32)[None, :].expand(rows, cols)
    return keep, (r + 1) * keep, (c + 1) * keep


def probe_columns(tokens: int, cols: int) -> torch.Tensor:
    """The column each token's one-hot input holds its 1 at: distinct, spread over the groups and their positions."""
    if tokens > cols:
        raise ValueError(f"{tokens} tokens need as many distinct columns; the probe has {cols}")
    step = next(s for s in (5, 7, 11, 13, 1) if cols % s)   # coprime to cols (a power of two here): a permutation
    return (torch.arange(tokens) * step + 3) % cols


def layout_probe(run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rows: int, cols: int, tokens: int,
                 dtype: torch.dtype, perm: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Both probes through ``run(w, x)`` (``w`` ``[rows, cols]`` 2:4 in ``dtype``, ``x`` ``[tokens, cols]`` one-hot;
    it returns the kernel's ``[tokens, rows]``; with ``perm`` the kernel reads ``x[:, perm]``, so the 1 is placed at
    ``perm[c_t]``). Per probe: the wrong outputs' count and the first :data:`PROBE_EXAMPLES` as ``[t, r, want, got]``
    (``rows``: got − 1 is the row the kernel used; ``cols``: the column)."""
    keep, by_row, by_col = probe_weights(rows, cols, seed)
    col_t = probe_columns(tokens, cols)
    x = torch.zeros(tokens, cols)
    x[torch.arange(tokens), perm[col_t].long() if perm is not None else col_t] = 1.0
    out = {"rows": rows, "cols": cols, "tokens": tokens, "columns": col_t.tolist()}
    for name, w in (("rows", by_row), ("cols", by_col)):
        want = w[:, col_t].t()   # [tokens, rows]
        got = run(w.to(dtype), x.to(dtype)).float().cpu()
        wrong = (got != want).nonzero().tolist()
        out[name] = {"wrong": len(wrong), "of": want.numel(),
                     "examples": [[t, r, want[t, r].item(), got[t, r].item()] for t, r in wrong[:PROBE_EXAMPLES]]}
    out["kept_at_probe"] = keep[:, col_t].sum().item()   # outputs that should be non-zero
    return out
