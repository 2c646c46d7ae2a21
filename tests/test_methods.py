import pytest
import torch

from shuffleprune.masks import Pattern, satisfies_nm
from shuffleprune.prune.methods import magnitude, sparsegpt, wanda, wanda_score
from shuffleprune.prune.input_stats import InputStats


def synthetic_layer(rows=64, cols=128, tokens=2048, seed=0):
    """A layer whose inputs have correlated, very unequal channels (as LLM activations do)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    mix = torch.randn(cols, cols, generator=g) / cols ** 0.5 + torch.eye(cols)
    scale = torch.exp(torch.randn(cols, generator=g))
    x = (torch.randn(tokens, cols, generator=g) @ mix) * scale
    stats = InputStats(cols, gram=True, device=torch.device("cpu"))
    for chunk in x.split(500):
        stats.add(chunk)
    return w, x, stats


def recon_error(w, w_hat, x):
    return float(((x @ w.t()) - (x @ w_hat.t())).norm() / (x @ w.t()).norm())


def test_wanda_score_is_the_formula():
    w, x, stats = synthetic_layer()
    expected = w.abs() * x.norm(dim=0, keepdim=True)
    assert torch.allclose(wanda_score(w, stats), expected, rtol=1e-5)
    assert torch.allclose(stats.gram, x.t() @ x, rtol=1e-4, atol=1e-3)


def test_wanda_nm_keeps_top_scores_per_group():
    w, x, stats = synthetic_layer()
    pruned = wanda(w, stats, Pattern(2, 4))
    assert satisfies_nm(pruned, 2, 4)
    score = (w.abs() * x.norm(dim=0)).reshape(64, -1, 4)
    kept = (pruned != 0).reshape(64, -1, 4)
    assert (score[kept].reshape(64, -1, 2).min(-1).values >= score[~kept].reshape(64, -1, 2).max(-1).values).all()
    assert torch.equal(pruned[pruned != 0], w[pruned != 0])  # Wanda does not change kept weights


@pytest.mark.parametrize("pattern", [Pattern(2, 4), Pattern(4, 8), Pattern(unstructured_sparsity=0.5)])
def test_sparsegpt_reconstructs_better_than_wanda_and_magnitude(pattern):
    w, x, stats = synthetic_layer()
    errs = {name: recon_error(w, fn(w, stats, pattern), x)
            for name, fn in (("sparsegpt", sparsegpt), ("wanda", wanda), ("magnitude", magnitude))}
    assert errs["sparsegpt"] < errs["wanda"] < errs["magnitude"], errs
    assert errs["sparsegpt"] < 0.9 * errs["wanda"], errs


def test_sparsegpt_pattern_and_sparsity():
    w, x, stats = synthetic_layer()
    out = sparsegpt(w, stats, Pattern(2, 4))
    assert satisfies_nm(out, 2, 4) and float((out == 0).float().mean()) == 0.5
    out = sparsegpt(w, stats, Pattern(unstructured_sparsity=0.6))
    assert abs(float((out == 0).float().mean()) - 0.6) < 0.01
    assert not torch.equal(out[out != 0], w[out != 0])  # weights are updated, not only masked


def test_magnitude_keeps_largest():
    w = torch.tensor([[1.0, -4.0, 2.0, 0.5], [3.0, 0.1, -0.2, -5.0]])
    out = magnitude(w, None, Pattern(2, 4))
    assert torch.equal(out, torch.tensor([[0.0, -4.0, 2.0, 0.0], [3.0, 0.0, 0.0, -5.0]]))
