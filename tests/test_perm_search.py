"""The score-retention swap search (``--perm search`` and ``--perm-init search``)."""
from __future__ import annotations

import torch

from shuffleprune.masks import nm_keep_mask
from shuffleprune.perm.search import kept_score, swap_search
from shuffleprune.perm.core import random_block_perm


def _brute_force_best(score: torch.Tensor) -> float:
    """Best kept 2:4 score over every assignment of 8 columns to two groups of four."""
    from itertools import combinations

    cols = list(range(8))
    best = 0.0
    for first in combinations(cols, 4):
        perm = torch.tensor(list(first) + [c for c in cols if c not in first])
        best = max(best, kept_score(score, perm, 2, 4))
    return best


def test_search_never_loses_score_and_stays_block_diagonal():
    gen = torch.Generator().manual_seed(0)
    for rows, cols, block in ((12, 96, 32), (7, 40, 16), (30, 64, 64)):  # 40 = 2 blocks of 16 + a tail of 8
        score = torch.rand(rows, cols, generator=gen) * torch.rand(1, cols, generator=gen)
        init = random_block_perm(cols, block, gen)
        perm = swap_search(score, 2, 4, block, init=init)
        assert torch.equal(perm.sort().values, torch.arange(cols))
        assert ((perm // block) == (torch.arange(cols) // block)).all()
        assert kept_score(score, perm, 2, 4) >= kept_score(score, init, 2, 4) - 1e-4
        assert kept_score(score, perm, 2, 4) > kept_score(score, torch.arange(cols), 2, 4)


def test_search_finds_the_optimum_of_small_blocks():
    gen = torch.Generator().manual_seed(1)
    hits = 0
    for _ in range(20):
        score = torch.rand(3, 8, generator=gen)
        found = kept_score(score, swap_search(score, 2, 4, 8), 2, 4)
        best = _brute_force_best(score)
        assert found <= best + 1e-5
        hits += abs(found - best) < 1e-5
    assert hits >= 15  # a local search: optimal on most small problems


def test_search_undoes_a_secret_shuffle_of_a_two_four_layout():
    gen = torch.Generator().manual_seed(2)
    cols, block = 128, 64
    strong = torch.zeros(cols, dtype=torch.bool)
    for g in range(cols // 4):
        strong[g * 4 + torch.randperm(4, generator=gen)[:2]] = True
    hidden = torch.rand(48, cols, generator=gen) * torch.where(strong, 1.0, 0.05) + torch.where(strong, 0.5, 0.0)
    secret = random_block_perm(cols, block, gen)
    score = torch.empty_like(hidden)
    score[:, secret] = hidden  # score[:, secret] is 2:4-friendly
    perm = swap_search(score, 2, 4, block)
    kept = nm_keep_mask(score[:, perm], 2, 4)
    assert kept_score(score, perm, 2, 4) >= 0.999 * kept_score(score, secret, 2, 4)
    assert kept_score(score, torch.arange(cols), 2, 4) < 0.9 * kept_score(score, secret, 2, 4)
    assert bool(strong[torch.argsort(secret)][perm][kept.any(0)].all())  # every kept column is a strong one


def test_row_chunking_gives_the_same_search(monkeypatch):
    """The gains are summed over rows in chunks (bounded memory on large layers): any chunk size
    must give the same permutation as one chunk."""
    import shuffleprune.perm.search as ps

    gen = torch.Generator().manual_seed(3)
    score = torch.rand(50, 128, generator=gen) * torch.rand(1, 128, generator=gen)
    monkeypatch.setitem(ps.CHUNK_ELEMENTS, "cpu", 2**30)  # all rows in one chunk
    whole = swap_search(score, 2, 4, 64)
    monkeypatch.setitem(ps.CHUNK_ELEMENTS, "cpu", 2 * 64 * 64 * 7)  # 7 rows per chunk, a ragged last one
    assert torch.equal(swap_search(score, 2, 4, 64), whole)


def test_scores_without_each_position_match_a_topk_of_the_rest():
    """The one-sort shortcut gives exactly each group's top-N sum and, for each position, the top-N
    sum and N-th largest of the group's other scores (ties included)."""
    from shuffleprune.perm.search import _group_scores

    gen = torch.Generator().manual_seed(5)
    for m in (4, 8):
        g = torch.cat([torch.rand(30, 6, m, generator=gen), torch.randint(0, 3, (30, 6, m), generator=gen).float()])
        for n in range(1, m):
            kept, a, t = _group_scores(g, n)
            assert torch.equal(kept, g.topk(n, dim=-1).values.sum(-1))
            for q in range(m):
                rest = torch.cat([g[..., :q], g[..., q + 1:]], dim=-1).topk(n, dim=-1).values
                assert torch.equal(a[..., q], rest.sum(-1)) and torch.equal(t[..., q], rest[..., -1])


def test_fewer_rounds_keep_less_or_equal_score_and_the_stage_passes_them_on():
    from shuffleprune.prune import PruneConfig

    score = torch.rand(64, 128, generator=torch.Generator().manual_seed(3))
    ident = kept_score(score, torch.arange(128), 2, 4)
    one, full = (kept_score(score, swap_search(score, 2, 4, 64, max_rounds=r), 2, 4) for r in (1, 200))
    assert ident < one < full  # one round already helps; more rounds help more on a random score
    stage = PruneConfig.build(None, overrides=["permutation.rounds=10"]).stages[1]
    assert stage["permutation"] == "search" and stage["rounds"] == 10
