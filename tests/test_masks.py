import itertools

import pytest
import torch

from shuffleprune.errors import UserError
from shuffleprune.masks import Pattern, keep_mask, layer_keep_mask, nm_keep_mask, parse_pattern, row_keep_mask, satisfies_nm


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4), (1, 2), (3, 4), (2, 8)])
def test_nm_mask_keeps_exactly_the_top_n_of_every_group(n, m):
    torch.manual_seed(n * 10 + m)
    score = torch.randn(7, 4 * m)
    keep = nm_keep_mask(score, n, m)
    for r, g in itertools.product(range(7), range(4)):
        group = score[r, g * m:(g + 1) * m]
        expected = torch.zeros(m, dtype=torch.bool)
        expected[group.argsort(descending=True)[:n]] = True
        assert torch.equal(keep[r, g * m:(g + 1) * m], expected)
    assert satisfies_nm(score * keep, n, m)
    assert int(keep.sum()) == 7 * 4 * n


def test_satisfies_nm_detects_violation():
    w = torch.ones(2, 8)
    w[:, [1, 3, 5, 7]] = 0
    assert satisfies_nm(w, 2, 4)
    w[1, 1] = 0.5
    assert not satisfies_nm(w, 2, 4)
    assert not satisfies_nm(torch.ones(2, 6), 2, 4)  # width not divisible


def test_unstructured_masks():
    torch.manual_seed(0)
    score = torch.rand(10, 20)
    keep = row_keep_mask(score, 0.3)
    assert (keep.sum(1) == 14).all()
    for r in range(10):  # the pruned are the 6 smallest of the row
        assert score[r][~keep[r]].max() < score[r][keep[r]].min()
    keep = layer_keep_mask(score, 0.5)
    assert int((~keep).sum()) == 100 and score[~keep].max() < score[keep].min()


@pytest.mark.parametrize("text,n,m", [("2:4", 2, 4), (" 4 : 8 ", 4, 8), ("1:4", 1, 4)])
def test_parse_pattern(text, n, m):
    p = parse_pattern(text, None)
    assert (p.n, p.m) == (n, m) and p.sparsity == pytest.approx(1 - n / m)


@pytest.mark.parametrize("text,sp", [("4:2", None), ("0:4", None), ("4:4", None), ("2-4", None), ("2:4", 0.5)])
def test_parse_pattern_rejects_impossible(text, sp):
    with pytest.raises(UserError):
        parse_pattern(text, sp)


def test_sparsity_ratio_bounds():
    assert parse_pattern(None, 0.5).sparsity == 0.5
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(UserError):
            parse_pattern(None, bad)


def test_width_check_names_layer():
    with pytest.raises(UserError, match="layer x.q_proj has 6 input columns"):
        Pattern(2, 4).check_width("x.q_proj", 6)
    with pytest.raises(UserError) as err:   # several: all counted, one glob per name inside a block
        Pattern(2, 4).check_widths([("b.0.mlp.down", "mlp.down", 6), ("b.0.attn.q", "attn.q", 8),
                                    ("b.1.mlp.down", "mlp.down", 6), ("b.1.attn.o", "attn.o", 10)])
    assert str(err.value) == ("3 layers have input widths not divisible by M=4 (e.g. b.0.mlp.down: 6 columns); "
                              "skip them with --skip '*.mlp.down' --skip '*.attn.o' or choose another M")
    Pattern(2, 4).check_widths([("b.0.attn.q", "attn.q", 8)])
    Pattern(0, 0, 0.5).check_widths([("b.0.mlp.down", "mlp.down", 6)])   # unstructured: any width



def test_skip_glob_of_an_expert_matches_it():
    """An expert's name ends in ``[i]``, which a glob reads as a character class: the error's ``--skip`` for
    it matched nothing (``fnmatch('x[3]', 'x[3]')`` is false)."""
    from fnmatch import fnmatch
    from shuffleprune.masks import skip_glob

    name = "model.layers.0.mlp.experts.down_proj[3]"
    assert not fnmatch(name, name) and fnmatch(name, skip_glob(name))
    assert not fnmatch("model.layers.0.mlp.experts.up_proj[3]", skip_glob(name))
    assert skip_glob("model.layers.0.mlp.down_proj") == "model.layers.0.mlp.down_proj"
    with pytest.raises(UserError, match=r"--skip '\*\.mlp\.experts\.down_proj\*' or"):
        Pattern(2, 4).check_widths([(f"b.{b}.mlp.experts.down_proj[{e}]", f"mlp.experts.down_proj[{e}]", 6)
                                    for b in range(2) for e in range(4)])
    keep_mask(torch.rand(2, 8), Pattern(2, 4))
