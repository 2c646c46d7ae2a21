"""Weight-update stages: the masked least-squares update reaches the closed-form optimum, never
loosens a mask, and keeps N:M in memory order through a whole pruning run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shuffleprune.masks import Pattern, satisfies_nm
from shuffleprune.prune import PruneConfig, prune
from shuffleprune.prune.input_stats import InputStats
from shuffleprune.prune.methods import sparsegpt, wanda
from shuffleprune.prune.methods.lsq import masked_lstsq


def _layer(rows=24, cols=48, tokens=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    x = torch.randn(tokens, cols, generator=gen) * torch.linspace(0.2, 3.0, cols)  # uneven input scales
    stats = InputStats(cols, gram=True, device=torch.device("cpu"))
    stats.add(x)
    return w, x, stats


def test_masked_least_squares_reaches_the_closed_form_optimum():
    w, x, stats = _layer()
    pruned = wanda(w, stats, Pattern(2, 4))
    mask = pruned != 0
    got = masked_lstsq(w, mask, stats.gram, start=pruned, damp=0.0, iters=500, tol=1e-10)
    xn, wn = x.double().numpy(), w.double().numpy()
    for i in range(w.shape[0]):
        keep = mask[i].numpy()
        sol, *_ = np.linalg.lstsq(xn[:, keep], xn @ wn[i], rcond=None)  # per row, on the kept columns
        assert np.allclose(got[i].double().numpy()[keep], sol, atol=1e-4), i
        assert (got[i][~mask[i]] == 0).all()
    err = lambda v: float(((x @ (w - v).T) ** 2).sum())
    assert err(got) < err(pruned) and err(got) <= err(sparsegpt(w, stats, Pattern(2, 4))) * 1.0001


def test_the_update_never_makes_a_pruned_position_nonzero():
    w, x, stats = _layer(seed=1)
    pruned = sparsegpt(w, stats, Pattern(2, 4))
    for damp in (0.0, 0.01):
        got = masked_lstsq(w, pruned != 0, stats.gram, start=pruned, damp=damp)
        assert ((got != 0) <= (pruned != 0)).all() and satisfies_nm(got, 2, 4)


@pytest.mark.parametrize("recipe,base", [("fast", None), ("balanced", None), ("fast", "magnitude")])
def test_lsq_stage_keeps_nm_in_memory_order_and_lowers_each_layers_error(recipe, base, tiny_dir, text_file, tmp_path):
    kw = dict(model=str(tiny_dir), calib=str(text_file), eval_text=None, nsamples=4, seqlen=32, batch_size=4,
              perm_block=16, **({"method": base} if base else {}))
    plain = prune(PruneConfig.build(recipe, **kw), progress=False)
    updated = prune(PruneConfig.build(recipe, overrides=["update=lsq"], **kw), out=tmp_path / "u", progress=False)
    report = updated.report
    assert report["stages"][-1] == "update:lsq" and report["nm_ok"]
    assert all(l["nm_ok"] for l in report["layers"])  # in memory (permuted) order, after every stage
    # block 0's inputs are the same in both runs: there the update must reach a lower layer error
    from shuffleprune.models import load_model
    from shuffleprune.calib import calibration_windows, get_source

    dense = load_model(str(tiny_dir)).model
    tokens = calibration_windows(get_source(str(text_file)), load_model(str(tiny_dir)).tokenizer, 4, 32, 0)
    seen = {}
    lin = dense.model.layers[0].mlp.down_proj
    h = lin.register_forward_pre_hook(lambda m, a: seen.update(x=a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        dense(tokens)
    h.remove()
    x = seen["x"]
    name = "model.layers.0.mlp.down_proj"
    errs = {k: float(((x @ (lin.weight - r.model.get_submodule(name).weight).T) ** 2).sum())
            for k, r in (("plain", plain), ("lsq", updated))}
    assert errs["lsq"] < errs["plain"]
    if base != "magnitude":  # (magnitude: the update's statistics also group q/k/v for the search, so other maps)
        # same inputs, same mask: the update changed kept weights only
        kept_plain = plain.model.get_submodule(name).weight != 0
        assert ((updated.model.get_submodule(name).weight != 0) <= kept_plain).all()
