"""A fast, data-free permutation search: maximise the importance score an N:M mask keeps.

Within each permutation block, columns are assigned to groups of ``M``; the mask keeps the top
``N`` scores of every (row, group). :func:`swap_search` starts from a given block-diagonal
permutation and repeatedly applies the column swaps between two groups that most increase the
kept score summed over rows (several swaps per round when they touch disjoint groups), until no
swap helps. This is the channel-permutation heuristic of Pool & Yu (NeurIPS 2021) applied to
Wanda's score |W|·‖X‖, restricted to the same block-diagonal structure the learned permutations
use. ShuffleSparse uses it (beyond the paper, ``--perm-init search``) as the starting point of the
learned soft permutation; it is also available on its own (``--perm search``).

Gain of a swap, exactly: removing position ``q`` from a group leaves scores whose top-N sum is
``A`` and whose N-th largest is ``t``; inserting a column of score ``c`` gives ``A + max(0, c − t)``.
"""
from __future__ import annotations

import torch

from shuffleprune.perm.core import block_sizes


def _kept(groups: torch.Tensor, n: int) -> torch.Tensor:
    """Top-``n`` sum over the last axis."""
    return groups.topk(n, dim=-1).values.sum(-1)


# Bound on the [K, rows, B, B] temporary of one round, per device type. On a GPU a large temporary
# (256 MB in float32; LLaMA-2-7B's q/k/v unit takes 48 chunks) keeps the launches few. On the CPU the
# sweep is memory-bound, and a 4 MB temporary that stays in cache runs it 4.5x faster than 256 MB.
CHUNK_ELEMENTS = {"cuda": 2**26, "cpu": 2**20}


def _chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cpu"])


def _group_scores(g: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From one sort of each group ``g`` ``[..., M]``: its kept (top-``n``) sum ``[...]``, and for
    every position ``q`` the top-``n`` sum ``A`` of the group's other scores and their ``n``-th
    largest ``t`` (both ``[..., M]``).

    Without ``q`` the top ``n`` are the sorted values ``0..n`` minus ``q``'s rank when ``q`` ranks
    below ``n``, else the first ``n``. Every sum adds values in descending order, as a sum over
    ``topk`` does, so the results are exactly those of a top-k per group and per removed position."""
    m = g.shape[-1]
    vals, order = g.sort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(m, device=g.device).expand_as(order))
    j = torch.arange(n, device=g.device)
    pick = j + (j >= rank.unsqueeze(-1)).long()                                           # [..., M, n]
    top = torch.gather(vals.unsqueeze(-2).expand(*vals.shape[:-1], m, m), -1, pick)
    return vals[..., :n].contiguous().sum(-1), top.sum(-1), top[..., -1]


@torch.no_grad()
def _search_blocks(score: torch.Tensor, perm: torch.Tensor, n: int, m: int, max_rounds: int) -> torch.Tensor:
    """``score`` ``[K, R, B]`` (K blocks of B columns), ``perm`` ``[K, B]`` local index maps → improved maps.

    The gains are computed on ``score``'s device (a GPU when there is one), rows in chunks so the
    temporary stays under the device's bound (:func:`_chunk_elements`); the greedy choice of swaps runs on the CPU."""
    k_blocks, rows, width = score.shape
    dev = score.device
    groups = width // m
    perm = perm.clone().cpu()
    group_of = torch.arange(width) // m
    group_of_dev = group_of.to(dev)
    same_group = group_of_dev.unsqueeze(0) == group_of_dev.unsqueeze(1)
    chunk = max(1, _chunk_elements(dev) // (k_blocks * width * width))
    for _ in range(max_rounds):
        index = perm.to(dev).unsqueeze(1).expand(k_blocks, rows, width)
        sp = torch.gather(score, 2, index)                                                  # [K, R, B] permuted
        g = sp.view(k_blocks, rows, groups, m)
        # kept score per group; without position q of its group: top-N sum A and N-th largest t of the rest
        kept, a, t = _group_scores(g, n)
        base = kept.sum(1)                                                                 # [K, G]
        a, t = a.view(k_blocks, rows, width), t.view(k_blocks, rows, width)                # per position
        # value[p, c]: kept score of p's group when position p holds the column now at position c
        value = a.sum(1).unsqueeze(-1)                                                     # [K, B, 1]
        for r in range(0, rows, chunk):
            value = value + torch.relu(sp[:, r:r + chunk].unsqueeze(2) - t[:, r:r + chunk].unsqueeze(3)).sum(1)
        base_p = base[:, group_of_dev]                                                     # [K, B]
        gain = value + value.transpose(1, 2) - base_p.unsqueeze(2) - base_p.unsqueeze(1)
        gain = gain.masked_fill(same_group, float("-inf")).cpu()
        tol = (1e-6 * base.sum(1, keepdim=True).unsqueeze(-1).clamp_min(1e-30)).cpu()
        improved = False
        for k in range(k_blocks):
            flat = gain[k].flatten()
            order = torch.argsort(flat, descending=True)
            used: set[int] = set()
            for idx in order[: 4 * groups * m].tolist():
                if flat[idx] <= tol[k]:
                    break
                p, c = divmod(idx, width)
                gp, gc = int(group_of[p]), int(group_of[c])
                if gp in used or gc in used:
                    continue
                used.update((gp, gc))
                perm[k, p], perm[k, c] = perm[k, c].clone(), perm[k, p].clone()
                improved = True
                if len(used) >= groups - 1:
                    break
        if not improved:
            break
    return perm


def swap_search(score: torch.Tensor, n: int, m: int, block: int = 64, init: torch.Tensor | None = None,
                max_rounds: int = 200) -> torch.Tensor:
    """A block-diagonal index map ``perm`` (``[C]``) such that the top-N-of-M mask of ``score[:, perm]``
    keeps at least as much total score as under ``init`` (default: the identity). Runs on ``score``'s
    device; the map returned is on the CPU."""
    rows, cols = score.shape
    score = score.float()
    init = torch.arange(cols) if init is None else init.to(torch.long).cpu()
    out, offset = [], 0
    for count, width in block_sizes(cols, block):
        span = count * width
        local = init[offset:offset + span].view(count, width) - (offset + torch.arange(count).unsqueeze(1) * width)
        s = score[:, offset:offset + span].reshape(rows, count, width).transpose(0, 1).contiguous()
        if width % m == 0 and width // m > 1:
            local = _search_blocks(s, local, n, m, max_rounds)
        out.append((local + offset + torch.arange(count).unsqueeze(1) * width).flatten())
        offset += span
    return torch.cat(out)


def kept_score(score: torch.Tensor, perm: torch.Tensor, n: int, m: int) -> float:
    """Total score kept by the top-N-of-M mask of ``score[:, perm]``."""
    sp = score[:, perm.to(score.device)]
    return float(_kept(sp.view(sp.shape[0], -1, m), n).sum())
