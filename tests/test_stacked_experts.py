"""Experts stacked in a model's own parameters (outside transformers' experts interface), found by
tracing the block's matrix products: Llama 4 (one bmm over [experts, in, out], every token through
every expert with its router weight folded into the input) and DBRX (2-D [experts·ffn, hidden]
parameters, one slice per expert, w2 read the other way round)."""
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from shuffleprune.blocks import find_blocks
from shuffleprune.masks import Pattern, satisfies_nm
from shuffleprune.prune import prune
from shuffleprune.prune.input_stats import collect_input_stats
from shuffleprune.prune.methods import wanda
from shuffleprune.stacked_experts import MatmulTrace, expert_layout, stacked_experts
from conftest import flat_config, make_tokenizer, tiny_model


def _traced(model, block_index: int, ids: torch.Tensor) -> dict:
    blocks = find_blocks(model)
    trace = MatmulTrace()
    with trace.watch(blocks.layers[block_index]), torch.no_grad():
        model(ids)
    return stacked_experts(blocks.layers[block_index], blocks.prefix(block_index), trace)


def _reference_matrices(model_type: str, model, i: int) -> dict[str, torch.Tensor]:
    """Each expert's matrix as its forward applies it, ``[out, in]``, read from the modules by hand."""
    if model_type == "llama4_text":
        ex = model.model.layers[i].feed_forward.experts
        prefix = f"model.layers.{i}.feed_forward.experts"
        return {**{f"{prefix}.gate_up_proj[{e}]": ex.gate_up_proj[e].t() for e in range(4)},
                **{f"{prefix}.down_proj[{e}]": ex.down_proj[e].t() for e in range(4)}}
    mlp = model.transformer.blocks[i].ffn.experts.mlp
    prefix = f"transformer.blocks.{i}.ffn.experts.mlp"
    split = lambda p: p.view(4, 128, 64)  # noqa: E731  (ffn 128, hidden 64)
    return {**{f"{prefix}.w1[{e}]": split(mlp.w1)[e] for e in range(4)},
            **{f"{prefix}.v1[{e}]": split(mlp.v1)[e] for e in range(4)},
            **{f"{prefix}.w2[{e}]": split(mlp.w2)[e].t() for e in range(4)}}


@pytest.mark.parametrize("model_type", ["llama4_text", "dbrx"])
def test_the_trace_finds_each_stacked_expert_the_way_round_its_forward_reads_it(model_type):
    model = tiny_model(model_type, layers=2)
    found = _traced(model, 1, torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0)))
    want = _reference_matrices(model_type, model, 1)
    assert sorted(found) == sorted(want)          # only the experts: no linear, no router, no norm
    for name, expert in found.items():
        assert expert.weight.data_ptr() == want[name].data_ptr() and torch.equal(expert.weight, want[name]), name
        assert expert.weight.stride() == want[name].stride(), name   # a view: a stage's copy_ lands in the model
    name = next(iter(found))
    expert, param = found[name], getattr(found[name].owner, found[name].param).detach()
    rebuilt = expert.rebuilt({expert.index: torch.zeros_like(expert.weight)}).detach()
    assert rebuilt.shape == param.shape and rebuilt.abs().sum() > 0
    assert float(expert.weight.abs().sum()) > 0    # exactly that expert replaced:
    assert float((rebuilt - param).abs().sum()) == pytest.approx(float(expert.weight.abs().sum()), rel=1e-5)


def _routed_inputs(model_type: str, model, i: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per expert matrix: the rows its forward multiplies (the tokens routed to it), by hand from the
    experts layer's call and its own weights."""
    seen = {}
    if model_type == "llama4_text":
        moe = model.model.layers[i].feed_forward
        h1 = moe.router.register_forward_hook(lambda m, a, out: seen.update(scores=out[0]))
        h2 = moe.experts.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
    else:
        moe = model.transformer.blocks[i].ffn
        h1 = moe.experts.register_forward_pre_hook(lambda m, a: seen.update(x=a[0].reshape(-1, 64), top=a[1]))
        h2 = None
    with torch.no_grad():
        model(ids)
    h1.remove()
    if h2 is not None:
        h2.remove()
    mats, out = _reference_matrices(model_type, model, i), {}
    for name, w in mats.items():
        e = int(name[name.rindex("[") + 1:-1])
        if model_type == "llama4_text":
            x = seen["x"].view(4, -1, 64)[e][seen["scores"][:, e] != 0]
            gate, up = (x @ mats[name.replace("down_proj", "gate_up_proj")].t()).chunk(2, dim=-1)
            h = up * moe.experts.act_fn(gate)
            out[name] = x if "gate_up" in name else h
        else:
            x = seen["x"][(seen["top"] == e).any(-1)]
            prefix = name[:name.rindex(".")]
            h = moe.experts.mlp.activation_fn(x @ mats[f"{prefix}.w1[{e}]"].t()) * (x @ mats[f"{prefix}.v1[{e}]"].t())
            out[name] = h if ".w2[" in name else x
    return out


@pytest.mark.parametrize("model_type", ["llama4_text", "dbrx"])
def test_each_stacked_expert_gets_the_statistics_of_the_tokens_routed_to_it(model_type):
    model = tiny_model(model_type, layers=2)
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(1))
    experts = _traced(model, 1, ids[:1])
    with collect_input_stats(experts, gram=True) as stats, torch.no_grad():
        model(ids)
    want = _routed_inputs(model_type, model, 1, ids)
    top_k = 1 if model_type == "llama4_text" else 2
    firsts = [n for n in want if n.endswith("gate_up_proj[0]") or ".w1[" in n or "gate_up" in n]
    assert sum(stats[n].tokens for n in firsts) == 3 * 12 * top_k   # every token, in its top-k experts
    for name, x in want.items():
        assert stats[name].tokens == x.shape[0], name
        torch.testing.assert_close(stats[name].gram, x.t() @ x, rtol=1e-4, atol=1e-5)


def test_stacked_experts_are_pruned_in_place_and_served_compressed(text_file, tmp_path):
    """Wanda on a Llama 4 text model: every expert matrix is 2:4 in the checkpoint plain transformers
    loads, with Wanda's mask on that expert's routed tokens; almost nothing is left outside pruning;
    the export compresses every expert, and the loaded model holds no dense copy of them and gives
    the pruned logits (its own forward, its bmm over all experts served by the compressed ones)."""
    import shuffleprune
    from shuffleprune.calib import calibration_windows, get_source
    from shuffleprune.deploy.export import export_checkpoint
    from shuffleprune.deploy.sparse_experts import SparseExperts, set_experts_mode

    src = tmp_path / "llama4"
    tiny_model("llama4_text", layers=2).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    dense = AutoModelForCausalLM.from_pretrained(src).eval()
    tokens = calibration_windows(get_source(str(text_file)), make_tokenizer(), 6, 32, 0)
    experts0 = _traced(dense, 0, tokens[:1])
    with collect_input_stats(experts0, gram=False) as want, torch.no_grad():
        dense(tokens)
    cfg = flat_config(model=str(src), calib=str(text_file), eval_text=None, nsamples=6, seqlen=32, batch_size=4,
                      method="wanda", pattern="2:4")
    report = prune(cfg, out=tmp_path / "out", progress=False).report
    rows = {r["name"]: r for r in report["layers"] if r.get("expert")}
    assert len(rows) == 2 * 2 * 4 and report["nm_ok"] is True
    assert report["outside_linears"]["share"] < 0.01   # the routers only (was 76 % before the trace)
    assert sum(rows[f"model.layers.0.feed_forward.experts.gate_up_proj[{e}]"]["routed_tokens"] for e in range(4)) \
        == 6 * 32
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    pattern = Pattern(2, 4)
    for i in range(2):
        for name, w in _reference_matrices("llama4_text", pruned, i).items():
            assert satisfies_nm(w, 2, 4), name
    mats_dense, mats_pruned = (_reference_matrices("llama4_text", m, 0) for m in (dense, pruned))
    for name, stats in want.items():
        expected = wanda(mats_dense[name].float(), stats, pattern)
        assert torch.equal(mats_pruned[name] != 0, expected != 0), name

    fmt = export_checkpoint(tmp_path / "out", tmp_path / "exported")
    assert fmt["kept_dense"] == [] and fmt["version"] == 3
    entry = fmt["experts"]["model.layers.1.feed_forward.experts.down_proj"]
    assert entry["stacked"] == {"view": [4, 128, 64], "scope": "model.layers.1.feed_forward.experts"}
    assert entry["transposed"] is True and entry["shape"] == [64, 128]
    loaded = shuffleprune.load(str(tmp_path / "exported"))
    experts = loaded.model.layers[1].feed_forward.experts
    assert experts.gate_up_proj.is_meta and "gate_up_proj" not in dict(loaded.named_parameters())
    assert isinstance(experts.nm_experts["down_proj"], SparseExperts)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = pruned(ids).logits
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)   # expert by expert (CPU)
        assert set_experts_mode(loaded, "grouped") == 4
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)   # one grouped launch (interpreted)
        set_experts_mode(loaded, "auto")
        torch._dynamo.reset()   # torch.compile: the served scope runs eagerly inside the compiled model
        torch.testing.assert_close(torch.compile(loaded, backend="aot_eager")(ids).logits, want, rtol=0, atol=1e-5)
        torch._dynamo.reset()


def test_learned_maps_reach_stacked_experts(text_file, tmp_path):
    """A DBRX with learned index maps: each expert matrix is 2:4 in its own map's column order."""
    from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps
    from shuffleprune.prune import PruneConfig

    src = tmp_path / "dbrx"
    tiny_model("dbrx", layers=2).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    cfg = PruneConfig.build("balanced", model=str(src), calib=str(text_file), eval_text=None, nsamples=4, seqlen=32,
                            batch_size=4, pattern="2:4", perm="learned", perm_steps=3, perm_block=16)
    report = prune(cfg, out=tmp_path / "out", progress=False).report
    maps = load_index_maps(tmp_path / "out" / INDEX_MAPS)
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    mats = {**_reference_matrices("dbrx", pruned, 0), **_reference_matrices("dbrx", pruned, 1)}
    assert set(mats) <= set(maps) and report["nm_ok"] is True
    assert sum(not torch.equal(maps[n], torch.arange(maps[n].numel())) for n in mats) > len(mats) // 2
    for name, w in mats.items():
        assert satisfies_nm(w[:, maps[name]], 2, 4), name
    # each expert compressed in its map's order and read through it; DBRX's own loop over the experts
    # it routes to, each slice of the stand-in served by that expert
    import shuffleprune
    from shuffleprune.deploy.export import export_checkpoint

    fmt = export_checkpoint(tmp_path / "out", tmp_path / "exported")
    assert fmt["kept_dense"] == [] and len(fmt["experts"]) == 2 * 3
    assert all(e["perm"] and e["stacked"]["scope"].endswith("ffn.experts") for e in fmt["experts"].values())
    assert [e["transposed"] for e in fmt["experts"].values()][:3] == [False, False, True]   # w1, v1, w2
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(shuffleprune.load(str(tmp_path / "exported"))(ids).logits, pruned(ids).logits,
                                   rtol=0, atol=1e-5)


class _TwoWays(nn.Module):
    """Stacked matrices read whole by a bmm and again in part (the first rows of one of them): two
    tilings, so the trace leaves the parameter alone; and a parameter holding one matrix."""

    def __init__(self):
        super().__init__()
        self.stack = nn.Parameter(torch.randn(4, 8, 8))
        self.single = nn.Parameter(torch.randn(8, 8))   # one matrix, not a stack of experts

    def forward(self, x):
        y = torch.bmm(x.expand(4, -1, -1), self.stack).sum(0)
        return y + x[0][:, :4] @ self.stack[2][:4] + x[0] @ self.single.t()


def test_a_parameter_read_in_part_or_holding_one_matrix_is_not_taken_for_experts():
    module = _TwoWays()
    trace = MatmulTrace()
    with trace.watch(module):
        module(torch.randn(1, 5, 8))
    assert stacked_experts(module, "m", trace) == {}
    p = torch.randn(3, 6, 10)
    assert expert_layout(p, p) == ((3, 6, 10), True)                       # bmm(x, P): [experts, in, out]
    assert expert_layout(p.transpose(1, 2), p) == ((3, 6, 10), False)      # bmm(x, Pᵀ): stored [out, in]
    assert expert_layout(p[1], p) == ((3, 6, 10), True)                    # x @ P[1]
    assert expert_layout(p[1, :, :5], p) is None and expert_layout(p[1, 1:], p) is None
    flat = torch.randn(30, 10)                                             # DBRX: [experts·rows, cols]
    assert expert_layout(flat.view(3, 10, 10)[2].t(), flat) == ((3, 10, 10), False)
    assert expert_layout(flat, flat) is None                               # the whole 2-D parameter: one matrix


def test_experts_pruned_only_in_part_stay_dense_in_the_export_listed_and_exact(text_file, tmp_path):
    import warnings

    import shuffleprune
    from shuffleprune.deploy.export import export_checkpoint

    src = tmp_path / "llama4"
    tiny_model("llama4_text", layers=2).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    cfg = flat_config(model=str(src), calib=str(text_file), eval_text=None, nsamples=4, seqlen=32, batch_size=4,
                      method="wanda", pattern="2:4", skip=["*.1.feed_forward.experts.gate_up_proj[[]2]"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = prune(cfg, out=tmp_path / "out", progress=False).report
    assert "model.layers.1.feed_forward.experts.gate_up_proj[2]" not in {r["name"] for r in report["layers"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fmt = export_checkpoint(tmp_path / "out", tmp_path / "exported")
    assert fmt["kept_dense"] == [f"model.layers.1.feed_forward.experts.gate_up_proj[{e}]" for e in (0, 1, 3)]
    assert "model.layers.1.feed_forward.experts.gate_up_proj" not in fmt["experts"] and len(fmt["experts"]) == 3
    assert any("3 pruned matrices stay dense in the export" in str(w.message)
               and "3 experts of fused tensors pruned only in part" in str(w.message) for w in caught)
    assert "Stored dense, N:M-valued: 3 experts of fused tensors pruned only in part." in \
        (tmp_path / "exported" / "README.md").read_text()
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    loaded = shuffleprune.load(str(tmp_path / "exported"))
    assert not loaded.model.layers[1].feed_forward.experts.gate_up_proj.is_meta   # the dense one, as pruned
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, pruned(ids).logits, rtol=0, atol=1e-5)


def test_a_stacked_expert_read_in_a_way_the_export_did_not_see_is_refused():
    from shuffleprune.deploy.sparse_experts import SparseExperts
    from shuffleprune.deploy.stacked_serving import StackedProducts
    from shuffleprune.deploy.format import compress
    from shuffleprune.errors import UserError

    weights = torch.randn(3, 8, 16) * (torch.arange(16) % 4 < 2)          # 3 experts [out 8, in 16], 2:4
    parts = [compress(w, 2, 4, f"e{i}") for i, w in enumerate(weights)]
    experts = SparseExperts(torch.stack([v for v, _ in parts]), torch.stack([m for _, m in parts]), 16, 2, 4,
                            None, [False] * 3)
    stand_in = torch.empty(3, 8, 16, device="meta")                       # stored [experts, out, in]
    x = torch.randn(5, 16)
    with StackedProducts({id(stand_in): (stand_in, experts, (3, 8, 16), False)}):
        y = torch.nn.functional.linear(x, stand_in[1])                    # one expert, as seen
        z = torch.bmm(x.expand(3, 5, 16), stand_in.transpose(1, 2))       # all of them at once
        with pytest.raises(UserError, match="in a way its export did not see"):
            x[:, :8] @ stand_in[1][:, :8]                                 # a part of one
    torch.testing.assert_close(y, x @ weights[1].t())
    torch.testing.assert_close(z, torch.stack([x @ w.t() for w in weights]))


def test_whole_model_permutations_reach_llama4_whose_causal_lm_names_no_base_model(text_file, tmp_path):
    """``--recon model`` (the `learned` recipe) trains every map against the text decoder's final hidden
    state; Llama 4's causal LM is its own ``base_model``, so the decoder is the module holding the
    blocks (``decoder_of``). Its stacked experts get learned maps and stay N:M in their order."""
    from shuffleprune.blocks import decoder_of
    from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps
    from shuffleprune.prune import PruneConfig

    model = tiny_model("llama4_text", layers=2)
    assert model.base_model is model                                # what the old code called
    decoder = decoder_of(model, find_blocks(model))
    assert decoder is model.model
    with torch.no_grad():
        assert decoder(input_ids=torch.randint(0, 128, (1, 8)), use_cache=False).last_hidden_state.shape == (1, 8, 64)
    src = tmp_path / "llama4"
    model.save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    cfg = PruneConfig.build("learned", model=str(src), calib=str(text_file), eval_text=None, nsamples=4, seqlen=32,
                            batch_size=2, pattern="2:4", perm_steps=3, seed=0)
    report = prune(cfg, out=tmp_path / "out", progress=False).report
    maps = load_index_maps(tmp_path / "out" / INDEX_MAPS)
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    mats = {**_reference_matrices("llama4_text", pruned, 0), **_reference_matrices("llama4_text", pruned, 1)}
    assert report["nm_ok"] is True and set(mats) <= set(maps)
    assert all(satisfies_nm(w[:, maps[n]], 2, 4) for n, w in mats.items())


def _qwen2_moe():
    """A tiny Qwen2-MoE: a router module of its own, and a shared expert gated by a 1-output nn.Linear."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2_moe", vocab_size=128, hidden_size=64, intermediate_size=128,
                                  moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4,
                                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type, block_gates", [
    ("dbrx", ["ffn.router.layer"]), ("qwen2_moe", ["mlp.shared_expert_gate"]),
    ("gemma3n_text", ["altup.correction_coefs", "altup.modality_router", "altup.prediction_coefs"])])
def test_linears_that_route_gate_or_mix_stay_dense(model_type, block_gates, text_file, tmp_path):
    """A router held as a plain nn.Linear (DBRX's ``router.layer``: one logit per expert), a shared
    expert's scalar gate (Qwen2-MoE's ``shared_expert_gate``) and Gemma 3n's AltUp router and
    coefficient layers (4 streams in; 4 or 16 coefficients out) are neither pruned nor sparsified by
    dst: they are tiny and what the block computes hangs on them. Every other linear of the block is
    pruned, and a LLaMA keeps no linear out."""
    from shuffleprune.blocks import block_experts, block_linears, gating_linears
    from shuffleprune.dst.layers import sparsifiable_layers

    src = tmp_path / model_type
    model = _qwen2_moe() if model_type == "qwen2_moe" else tiny_model(model_type, layers=2)
    model.save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    blocks = find_blocks(model)
    gates = [f"{blocks.prefix(i)}.{gate}" for i in range(2) for gate in block_gates]
    cfg = flat_config(model=str(src), calib=str(text_file), eval_text=None, nsamples=4, seqlen=32, batch_size=4,
                      method="wanda", pattern="2:4")
    report = prune(cfg, out=tmp_path / "out", progress=False).report
    assert report["gating_linears"] == gates
    pruned_names = {r["name"] for r in report["layers"]}
    assert not pruned_names & set(gates) and report["nm_ok"] is True
    assert any(n.endswith(("attn.Wqkv", "self_attn.q_proj")) for n in pruned_names)   # the other linears are pruned
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for name in gates:
        assert torch.equal(pruned.get_submodule(name).weight, model.get_submodule(name).weight)  # untouched
    dst_layers = sparsifiable_layers(model)
    assert not set(gates) & set(dst_layers) and {n for n in pruned_names if not n.endswith("]")} <= set(dst_layers)
    assert any(n.endswith("]") for n in dst_layers) == (model_type != "gemma3n_text")   # the experts are layers
    llama = tiny_model("llama")
    block = find_blocks(llama).layers[0]
    assert gating_linears(block_linears(block, "b"), block_experts(block, "b")) == set()


def test_a_router_is_told_by_where_it_sits_and_what_it_reads_not_by_width_alone():
    """With as many experts as the hidden size (64), attention's q/o projections and a shared
    expert's down projection also have one output per expert; they are not routers: attention is
    outside the module holding the experts, and the shared down projection reads the expert width,
    not the layer's input. Only the shared expert's scalar gate is kept dense."""
    from transformers import AutoConfig

    from shuffleprune.blocks import block_experts, block_linears, gating_linears

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2_moe", vocab_size=128, hidden_size=64, intermediate_size=128,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=64,
                                  num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256)
    block = find_blocks(AutoModelForCausalLM.from_config(config)).layers[0]
    linears = block_linears(block, "b")
    assert linears["b.self_attn.q_proj"].out_features == 64 == linears["b.mlp.shared_expert.down_proj"].out_features
    assert gating_linears(linears, block_experts(block, "b")) == {"b.mlp.shared_expert_gate"}
