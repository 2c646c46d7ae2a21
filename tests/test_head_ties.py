"""Head-tied index maps: under grouped-query attention every permutation kind gives the output
projection a map that export folds into the value projection's rows."""
from __future__ import annotations

import pytest
import torch
import yaml

from conftest import tiny_model
from shuffleprune.blocks import block_linears, find_blocks, text_config
from shuffleprune.deploy.export import export_checkpoint
from shuffleprune.deploy.fold import grouped_head_perm
from shuffleprune.perm.core import random_block_perm
from shuffleprune.perm.heads import HeadTie, head_ties
from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps
from shuffleprune.prune import PruneConfig, prune


def test_fold_unfold_and_expand_agree_with_indexing_the_layer():
    tie = HeadTie(heads=6, kv=2, head_dim=8)
    w = torch.randn(5, 48)
    assert torch.equal(tie.unfold(tie.fold(w)), w)
    folded = tie.fold(w)
    assert folded.shape == (15, 16)
    assert torch.equal(folded[2 * 5 + 4, 8 + 3], w[4, (1 * 3 + 2) * 8 + 3])   # row (i=2, r=4), column (g=1, j=3)
    perm = random_block_perm(16, 4, torch.Generator().manual_seed(0))
    full = tie.expand(perm)
    assert torch.equal(tie.unfold(folded[:, perm]), w[:, full])
    assert torch.equal(full.sort().values, torch.arange(48))
    assert torch.equal(grouped_head_perm(full, (6, 2, 8), 16), perm)   # what export folds into v_proj's rows
    with pytest.raises(ValueError, match="stay inside heads"):
        tie.expand(torch.randperm(16, generator=torch.Generator().manual_seed(1)).roll(8))


def _block_layers(model):
    blocks = find_blocks(model)
    layers = block_linears(blocks.layers[0], blocks.prefix(0))
    names = {k.rpartition(".")[2]: k for k in layers}
    groups = [[names[n] for n in ("q_proj", "k_proj", "v_proj")], [names["o_proj"]],
              [names["gate_proj"], names["up_proj"]], [names["down_proj"]]]
    return blocks.layers[0], layers, groups, names


def test_only_the_output_projection_under_gqa_is_tied():
    model = tiny_model("llama")   # 4 query heads of 16 dims, 2 KV heads
    block, layers, groups, names = _block_layers(model)
    config = text_config(model)
    # q_proj reads as many columns as o_proj, but with v_proj (one input): it is not tied
    assert head_ties(block, layers, groups, config, 16) == {names["o_proj"]: HeadTie(4, 2, 16)}
    assert head_ties(block, layers, groups, config, 32) == {}     # blocks wider than a head cannot be tied
    mha = tiny_model("llama")
    mha_block = mha.model.layers[0]
    mha_block.self_attn.num_key_value_groups = 1   # as multi-head attention reports it
    mha.config.num_key_value_heads = mha.config.num_attention_heads
    _, mha_layers, mha_groups, _ = _block_layers(mha)
    assert head_ties(mha_block, mha_layers, mha_groups, text_config(mha), 16) == {}   # MHA folds untied


def _tiny_dir(tmp_path, layers: int = 2):
    from conftest import make_tokenizer

    path = tmp_path / "gqa"
    tiny_model("llama", layers=layers).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("perm", ["random", "search", "learned"])
def test_every_permutation_kind_ties_o_proj_and_export_folds_it(perm, tmp_path, text_file):
    model = _tiny_dir(tmp_path)
    options = dict(model=str(model), method="wanda", pattern="2:4", calib=str(text_file), nsamples=4, seqlen=32,
                   eval_text=None, perm=perm, perm_block=8, **({"perm_steps": 3} if perm == "learned" else {}))
    out = tmp_path / "tied"
    result = prune(PruneConfig.build("balanced", overrides=["permutation.tie_heads=true"], **options), out=out,
                   progress=False)
    maps = load_index_maps(out / INDEX_MAPS)
    o_maps = {k: v for k, v in maps.items() if k.endswith("o_proj")}
    assert len(o_maps) == 2
    for name, perm_map in o_maps.items():
        assert grouped_head_perm(perm_map, (4, 2, 16), 32) is not None, name
        if perm == "random":
            assert not torch.equal(perm_map, torch.arange(64))
    entries = [p for b in result.report["perm"]["blocks"] for k, p in b["perms"].items() if k.endswith("o_proj")]
    assert [p.get("tied_heads") for p in entries] == [2, 2]
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert any(s.get("permutation") == perm and s.get("tie_heads") is True for s in recipe["stages"])
    fmt = export_checkpoint(out, tmp_path / "deployed")
    assert not any(n.endswith("o_proj") for n in fmt["runtime_gathers"])
    assert sum(k.endswith("o_proj") for k in fmt["folded"]) == 2
    if perm == "random":   # off (the default), the query heads' maps disagree and o_proj keeps its gather
        free = tmp_path / "free"
        prune(PruneConfig.build("balanced", **options), out=free, progress=False)
        assert yaml.safe_load((free / "recipe.yaml").read_text())["stages"][1]["tie_heads"] is False
        free_maps = load_index_maps(free / INDEX_MAPS)
        assert all(grouped_head_perm(free_maps[k], (4, 2, 16), 32) is None for k in o_maps)
        assert sum(n.endswith("o_proj") for n in export_checkpoint(free, tmp_path / "d2")["runtime_gathers"]) == 2


def test_model_recon_ties_too(tmp_path, text_file):
    model = _tiny_dir(tmp_path)
    options = dict(model=str(model), method="wanda", pattern="2:4", calib=str(text_file), nsamples=4, seqlen=32,
                   eval_text=None, perm="learned", recon="model", perm_block=8, perm_steps=2)
    out = tmp_path / "m"
    prune(PruneConfig.build("balanced", overrides=["permutation.tie_heads=true"], **options), out=out, progress=False)
    maps = load_index_maps(out / INDEX_MAPS)
    assert all(grouped_head_perm(v, (4, 2, 16), 32) is not None for k, v in maps.items() if k.endswith("o_proj"))


def test_a_fold_that_changes_a_later_layer_through_the_kv_cache_is_undone(tmp_path, text_file):
    """Gemma 3n's last layer reads the values the layer before cached: o_proj's tied map folded into
    that layer's v_proj rows passes its own block's check but reorders what the last layer reads, so
    export's whole-decoder check undoes it; the other layer's fold stays and the logits are unchanged."""
    import shuffleprune
    from conftest import make_tokenizer
    from transformers import AutoModelForCausalLM

    src = tmp_path / "gemma3n"
    tiny_model("gemma3n_text").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    out = tmp_path / "pruned"
    prune(PruneConfig.build("fast", model=str(src), calib=str(text_file), eval_text=None, nsamples=4, seqlen=32,
                            batch_size=2, pattern="2:4", perm="random", perm_block=16,
                            overrides=["permutation.tie_heads=true"]), out=out, progress=False)
    tied = load_index_maps(out / INDEX_MAPS)
    assert grouped_head_perm(tied["model.layers.1.self_attn.o_proj"], (4, 2, 16), 32) is not None
    fmt = export_checkpoint(out, tmp_path / "deployed")
    assert [k for k in fmt["folded"] if k.endswith("o_proj")] == ["model.layers.0.self_attn.o_proj"]
    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        torch.testing.assert_close(shuffleprune.load(str(tmp_path / "deployed"))(ids).logits, want, rtol=0, atol=1e-4)
