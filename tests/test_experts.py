"""Fused MoE experts (transformers 5 stores a layer's experts as one [experts, out, in] parameter):
each expert's matrices get the statistics of the tokens routed to it and are pruned in place."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from shuffleprune.blocks import ExpertWeight, block_experts, block_linears, find_blocks
from shuffleprune.masks import Pattern, satisfies_nm
from shuffleprune.prune import prune
from shuffleprune.prune.input_stats import InputStats, collect_input_stats, load_norms, save_norms
from shuffleprune.prune.methods import magnitude, wanda
from shuffleprune.prune.stage import BlockWork
from shuffleprune.prune.stages.prune import Wanda
from shuffleprune.prune.stages.update import LeastSquares
from conftest import flat_config, make_tokenizer, tiny_model


def _routed_reference(model, block_index: int, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    """Per expert matrix name: (XᵀX, tokens) of its input, from the experts layer's own call
    arguments (hidden states and top-k choice) and its own gate, with the default (grouped) forward."""
    block = model.model.layers[block_index]
    experts = block.mlp.experts
    seen = {}
    handle = experts.register_forward_pre_hook(lambda m, args: seen.update(x=args[0], top=args[1]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    prefix = f"model.layers.{block_index}.mlp.experts"
    out = {}
    for e in range(experts.gate_up_proj.shape[0]):
        x = seen["x"][(seen["top"] == e).any(-1)].float()
        w = experts.gate_up_proj[e].float()
        h = x @ w if experts.is_transposed else x @ w.t()
        if experts.has_bias:
            h = h + experts.gate_up_proj_bias[e].float()
        h = experts._apply_gate(h)
        out[f"{prefix}.gate_up_proj[{e}]"] = (x.t() @ x, x.shape[0])
        out[f"{prefix}.down_proj[{e}]"] = (h.t() @ h, x.shape[0])
    return out


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_each_expert_gets_the_statistics_of_the_tokens_routed_to_it(model_type, tmp_path):
    model = tiny_model(model_type)
    implementation = model.config._experts_implementation
    blocks = find_blocks(model)
    experts = block_experts(blocks.layers[1], "model.layers.1")
    assert len(experts) == 2 * 4 and all(isinstance(e, ExpertWeight) for e in experts.values())
    assert experts["model.layers.1.mlp.experts.down_proj[2]"].weight.shape == (64, 128)   # [out, in] either layout
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(0))
    with collect_input_stats({**block_linears(blocks.layers[1], "model.layers.1"), **experts}, gram=True) as stats, \
            torch.no_grad():
        model(ids)
    assert model.config._experts_implementation == implementation   # the eager forward was for collecting only
    want = _routed_reference(model, 1, ids)
    assert sum(stats[n].tokens for n in want if "gate_up" in n) == 3 * 12 * 2   # top-2 of every token
    for name, (gram, tokens) in want.items():
        assert stats[name].tokens == tokens, name
        torch.testing.assert_close(stats[name].gram, gram, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stats[name].sq_norm.float(), gram.diagonal(), rtol=1e-4, atol=1e-4)
    assert stats["model.layers.1.self_attn.q_proj"].tokens == 3 * 12
    save_norms(stats, tmp_path / "norms.safetensors")   # the dense statistics' file keeps each expert's count
    assert {n: s.tokens for n, s in load_norms(tmp_path / "norms.safetensors").items()} == \
        {n: s.tokens for n, s in stats.items()}


def test_moe_experts_are_pruned_in_place_with_their_routed_tokens(text_file, tmp_path):
    """Wanda on a Mixtral: every expert's matrices are 2:4 in the fused tensors of a checkpoint plain
    transformers loads, with the mask Wanda gives on that expert's routed tokens (block 0 sees the
    dense model's inputs); no weights are reported as left dense."""
    src = tmp_path / "moe"
    tiny_model("mixtral").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    cfg = flat_config(model=str(src), calib=str(text_file), eval_text=None, nsamples=6, seqlen=32, batch_size=4,
                      method="wanda", pattern="2:4")
    from shuffleprune.calib import calibration_windows, get_source

    dense = AutoModelForCausalLM.from_pretrained(src).eval()
    tokens = calibration_windows(get_source(str(text_file)), make_tokenizer(), 6, 32, 0)
    with collect_input_stats(block_experts(dense.model.layers[0], "model.layers.0"), gram=False) as want, \
            torch.no_grad():
        dense(tokens)
    result = prune(cfg, out=tmp_path / "out", progress=False)
    report = result.report
    assert report["nm_ok"] is True and report["outside_linears"]["share"] < 0.01
    rows = {l["name"]: l for l in report["layers"] if l.get("expert")}
    assert len(rows) == 3 * 2 * 4
    assert sum(rows[f"model.layers.0.mlp.experts.gate_up_proj[{e}]"]["routed_tokens"] for e in range(4)) == 6 * 32 * 2
    assert "MoE experts: 24 expert matrices pruned on the calibration tokens routed to each." in \
        (tmp_path / "out" / "README.md").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    pattern = Pattern(2, 4)
    for i, layer in enumerate(reloaded.model.layers):
        for param in ("gate_up_proj", "down_proj"):
            fused = getattr(layer.mlp.experts, param)
            assert all(satisfies_nm(fused[e], 2, 4) for e in range(4)), (i, param)
    for name, stats in want.items():
        dense_w = block_experts(dense.model.layers[0], "model.layers.0")[name].weight
        pruned_w = block_experts(reloaded.model.layers[0], "model.layers.0")[name].weight
        expected = wanda(dense_w.float(), stats, pattern)
        assert torch.equal(pruned_w != 0, expected != 0), name
        assert not torch.equal(expected != 0, magnitude(dense_w.float(), None, pattern) != 0), name


def test_an_expert_no_token_reached_gets_a_magnitude_mask_and_no_update():
    model = tiny_model("mixtral")
    block = model.model.layers[0]
    experts = block_experts(block, "model.layers.0", only=["*experts.down_proj?[13]]"])
    assert sorted(experts) == ["model.layers.0.mlp.experts.down_proj[1]", "model.layers.0.mlp.experts.down_proj[3]"]
    reached = InputStats(128, gram=True, device=torch.device("cpu"))
    reached.add(torch.randn(40, 128, generator=torch.Generator().manual_seed(0)))
    unreached = InputStats(128, gram=True, device=torch.device("cpu"))
    names = list(experts)
    work = BlockWork(index=0, prefix="model.layers.0", block=block, linears={}, hidden=torch.zeros(1),
                     experts=experts, stats={names[0]: reached, names[1]: unreached},
                     expert_groups=[[names[0]], [names[1]]])
    dense = {n: e.weight.float().clone() for n, e in experts.items()}
    work.dense = dense
    pattern = Pattern(2, 4)
    run = type("R", (), {"pattern": pattern})()
    Wanda().apply(run, work)
    assert work.report == {"experts_pruned_by_magnitude": [names[1]]}
    assert torch.equal(experts[names[1]].weight, magnitude(dense[names[1]], None, pattern).to(torch.float32))
    assert torch.equal(experts[names[0]].weight, wanda(dense[names[0]], reached, pattern))
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj[1], wanda(dense[names[0]], reached, pattern))
    untouched = experts[names[1]].weight.clone()
    LeastSquares(precision="float32").apply(run, work)
    assert torch.equal(experts[names[1]].weight, untouched)        # nothing to fit without tokens
    assert not torch.equal(experts[names[0]].weight, wanda(dense[names[0]], reached, pattern))
    assert satisfies_nm(experts[names[0]].weight, 2, 4)
    # the swap search scores each expert the way it is pruned: by Wanda's score, or by magnitude unrouted
    from shuffleprune.perm.search import swap_search
    from shuffleprune.prune.stages.permutation import Search
    run = type("R", (), {"pattern": pattern, "seed": 0, "device": torch.device("cpu"), "captured": None, "model": model})()
    for n in names:
        experts[n].weight.copy_(dense[n])
    Search(block=16).apply(run, work)
    by_magnitude = swap_search(dense[names[1]].abs(), 2, 4, 16, max_rounds=200)
    assert torch.equal(work.perms[names[1]], by_magnitude) and not torch.equal(by_magnitude, torch.arange(128))
    assert torch.equal(work.perms[names[0]], swap_search(dense[names[0]].abs() * reached.col_norm, 2, 4, 16,
                                                         max_rounds=200))


def test_experts_whose_forward_cannot_be_followed_are_refused(monkeypatch):
    """An experts forward that never applies one expert's slice (here: the whole fused tensor at once)
    would leave every expert without statistics: refused with the --skip that leaves them dense."""
    from shuffleprune.errors import UserError

    model = tiny_model("mixtral")
    experts_cls = type(model.model.layers[0].mlp.experts)

    def whole_tensor_forward(self, hidden_states, top_k_index, top_k_weights):
        gate_up = torch.einsum("th,eoh->teo", hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", self.act_fn(gate) * up, self.down_proj)
        chosen = torch.zeros(out.shape[:2]).scatter(1, top_k_index, top_k_weights)
        return (out * chosen[..., None]).sum(1)

    monkeypatch.setattr(experts_cls, "forward", whole_tensor_forward)
    block = model.model.layers[0]
    selected = {**block_linears(block, "model.layers.0"), **block_experts(block, "model.layers.0")}
    with pytest.raises(UserError, match=r"experts of 'model\.layers\.0\.mlp\.experts'.*--skip 'model\.layers\.0\.mlp\.experts\.\*'"):
        with collect_input_stats(selected, gram=False), torch.no_grad():
            model(torch.randint(0, 128, (1, 8)))


def test_searched_maps_reach_the_experts_and_their_export(text_file, tmp_path):
    """With the swap search, each expert gets its own index map from its routed tokens' norms: it keeps at
    least the Wanda score the identity keeps (more for some), the expert is N:M in that order, the
    checkpoint keeps the expert in its own column order (so it computes the pruned model as stored),
    and the export compresses it in the map's order and reads its input through the map."""
    import shuffleprune
    from shuffleprune.deploy.export import SPARSE_FILE, export_checkpoint
    from shuffleprune.deploy.sparse_experts import set_experts_mode
    from shuffleprune.models import load_model
    from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps
    from shuffleprune.perm.search import kept_score
    from shuffleprune.prune.methods import wanda_score
    from safetensors.torch import load_file

    src = tmp_path / "moe"
    tiny_model("mixtral").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    dense = AutoModelForCausalLM.from_pretrained(src).eval()
    cfg = flat_config(model=str(src), calib=str(text_file), eval_text=None, nsamples=6, seqlen=32, batch_size=4,
                      method="wanda", pattern="2:4", perm="search", perm_block=16)
    from shuffleprune.calib import calibration_windows, get_source

    tokens = calibration_windows(get_source(str(text_file)), make_tokenizer(), 6, 32, 0)
    dense_experts = block_experts(dense.model.layers[0], "model.layers.0")
    with collect_input_stats(dense_experts, gram=False) as routed, torch.no_grad():
        dense(tokens)
    result = prune(cfg, out=tmp_path / "pruned", progress=False)
    maps = load_index_maps(tmp_path / "pruned" / INDEX_MAPS)
    assert "24 with their own index map" in (tmp_path / "pruned" / "README.md").read_text()
    rows = {l["name"]: l for l in result.report["layers"]}
    gains = []
    for name, expert in dense_experts.items():
        perm = maps[name].long()
        score = wanda_score(expert.weight.float(), routed[name])
        kept, identity = kept_score(score, perm, 2, 4), kept_score(score, torch.arange(perm.numel()), 2, 4)
        assert kept >= identity - 1e-6, name
        gains.append(kept - identity)
        assert rows[name]["nm_ok"] and "perm_strength" in rows[name]
        pruned_w = block_experts(result.model.model.layers[0], "model.layers.0")[name].weight
        assert satisfies_nm(pruned_w[:, perm], 2, 4) and not satisfies_nm(pruned_w, 2, 4), name
    assert max(gains) > 0
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = result.model(ids).logits
        torch.testing.assert_close(load_model(str(tmp_path / "pruned")).model(ids).logits, want, rtol=1e-5, atol=1e-5)
        fmt = export_checkpoint(tmp_path / "pruned", tmp_path / "exported")
        assert fmt["experts"]["model.layers.1.mlp.experts.down_proj"]["perm"] is True
        assert "model.layers.1.mlp.experts.down_proj[2].perm" in load_file(str(tmp_path / "exported" / SPARSE_FILE))
        exported = shuffleprune.load(str(tmp_path / "exported"))
        torch.testing.assert_close(exported(ids).logits, want, rtol=1e-5, atol=1e-5)
        assert set_experts_mode(exported, "grouped") == 6   # every expert's map read by the grouped kernel
        torch.testing.assert_close(exported(ids).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_weight_params_run_the_model_with_new_linear_and_expert_weights(model_type):
    """``weight_params`` puts [out, in] weights of linears and single experts (either fused layout) where
    functional_call reads them: the model computes what it computes with those weights written in, the
    gradient reaches each given expert's matrix, and the model's own tensors are not touched."""
    import copy

    from torch.func import functional_call

    from shuffleprune.blocks import weight_params

    model = tiny_model(model_type)
    block = model.model.layers[1]
    layers = {**block_linears(block, "model.layers.1"), **block_experts(block, "model.layers.1")}
    gen = torch.Generator().manual_seed(1)
    names = ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.experts.gate_up_proj[1]",
             "model.layers.1.mlp.experts.down_proj[2]"]
    new = {n: torch.randn(layers[n].weight.shape, generator=gen).mul(0.1).requires_grad_() for n in names}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (2, 16), generator=gen)
    got = functional_call(model, weight_params(model, layers)(new), (ids,)).logits
    written = copy.deepcopy(model)
    written_layers = {**block_linears(written.model.layers[1], "model.layers.1"),
                      **block_experts(written.model.layers[1], "model.layers.1")}
    with torch.no_grad():
        for n, w in new.items():
            written_layers[n].weight.copy_(w)
        want = written(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, model(ids).logits)
    got.square().sum().backward()
    assert all(new[n].grad is not None and new[n].grad.abs().sum() > 0 for n in names)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("recon", ["block", "model"])
def test_learned_maps_reach_the_experts(recon, text_file, tmp_path):
    """--perm learned trains a soft permutation per expert matrix through its slice of the fused tensor
    (the block's or the model's forward): every expert gets a learned map (its penalty curve in the
    report; some moved off the identity), is N:M in that order, and the checkpoint computes the pruned model."""
    from shuffleprune.models import load_model
    from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps

    src = tmp_path / "moe"
    tiny_model("mixtral").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    cfg = flat_config(model=str(src), calib=str(text_file), eval_text=None, nsamples=6, seqlen=32, batch_size=3,
                      method="wanda", pattern="2:4", perm="learned", recon=recon, perm_block=16, perm_steps=8)
    result = prune(cfg, out=tmp_path / "pruned", progress=False)
    maps = load_index_maps(tmp_path / "pruned" / INDEX_MAPS)
    infos = {k: v for block in result.report["perm"]["blocks"] for k, v in block["perms"].items()}
    experts = {}
    for i, layer in enumerate(result.model.model.layers):
        experts.update(block_experts(layer, f"model.layers.{i}"))
    assert len(experts) == 3 * 2 * 4
    for name, expert in experts.items():
        assert len(infos[name]["penalty_curve"]) == 8, name    # its own unit, trained
        assert satisfies_nm(expert.weight[:, maps[name].long()], 2, 4), name
    assert max(infos[n]["strength"] for n in experts) > 0
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(tmp_path / "pruned")).model(ids).logits, result.model(ids).logits,
                                   rtol=1e-5, atol=1e-5)


class _Crash(Exception):
    pass


def test_a_killed_moe_run_resumes_to_the_same_experts_maps_and_report(text_file, tmp_path):
    """Experts through --resume: the dense statistics' per-expert token counts, the experts' searched maps
    and their pruned weights come back from the resume directory bit for bit."""
    from safetensors.torch import load_file

    from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps

    src = tmp_path / "moe"
    tiny_model("mixtral").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    cfg = flat_config(model=str(src), calib=str(text_file), eval_text=None, nsamples=6, seqlen=32, batch_size=4,
                      method="wanda", pattern="2:4", perm="search", perm_block=16, mask_stats="dense")
    full = prune(cfg, out=tmp_path / "full", progress=False)

    def crash_after_block_0(i):
        if i == 0:
            raise _Crash

    with pytest.raises(_Crash):
        prune(cfg, out=tmp_path / "part", progress=False, on_block_done=crash_after_block_0)
    resumed = prune(cfg, out=tmp_path / "part", resume=True, progress=False)
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("full", "part"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    maps = [load_index_maps(tmp_path / d / INDEX_MAPS) for d in ("full", "part")]
    assert maps[0].keys() == maps[1].keys() and all(torch.equal(maps[0][k], maps[1][k]) for k in maps[0])
    assert sum(name.endswith("]") for name in maps[0]) == 3 * 2 * 4
    rows = [[(l["name"], l.get("routed_tokens")) for l in r.report["layers"]] for r in (full, resumed)]
    assert rows[0] == rows[1]


@pytest.mark.parametrize("target", ["model", "block"])
def test_blockrecon_fits_whole_fused_expert_tensors_under_their_masks(target, text_file, tmp_path):
    """blockrecon after the same masks (block 0 sees the same inputs either way): a fused experts tensor
    whose every expert was pruned has its kept weights fitted with its zeros kept; one with an expert left
    out by --skip is not fitted at all (the left-out expert must not change)."""
    from shuffleprune.prune import PruneConfig

    src = tmp_path / "moe"
    tiny_model("mixtral").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    kw = dict(model=str(src), calib=str(text_file), eval_text=None, nsamples=6, seqlen=32, batch_size=3,
              pattern="2:4", skip=["*down_proj?3]"])
    with pytest.warns(UserWarning, match="stay dense"):
        masked = prune(PruneConfig.build("balanced", **kw), progress=False).model.model.layers[0].mlp.experts
    with pytest.warns(UserWarning, match="stay dense"):
        fitted = prune(PruneConfig.build("best", overrides=[f"update.target={target}", "update.steps=20"], **kw),
                       progress=False)
    experts = fitted.model.model.layers[0].mlp.experts
    rec = fitted.report["stage_blocks"][0]["blockrecon"]
    assert rec["held_out_after"] < rec["held_out_before"]
    assert torch.equal(experts.gate_up_proj != 0, masked.gate_up_proj != 0)
    assert not torch.equal(experts.gate_up_proj, masked.gate_up_proj)
    assert fitted.report["nm_ok"] is True   # in each expert's searched order, as before the fit
    assert torch.equal(experts.down_proj, masked.down_proj)


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that make the host wait for the device (a value read back, or an output whose
    size depends on values): what a CUDA graph capture cannot hold."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount", "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in self.SYNCING):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_grouped_experts_forward_matches_the_eager_experts_and_never_waits_on_the_host(model_type, monkeypatch):
    """An experts layer whose every expert is 2:4 and compressed as an export holds it: the grouped forward
    (two launches over all (token, slot) pairs) and the per-expert loop both give transformers' eager
    experts forward on the same weights — gpt-oss's transposed experts, biases and clamped gate included,
    and with an expert-parallel sentinel id among the choices — and the grouped one reads nothing back
    to the host (so a decode step captures into a CUDA graph), where the loop does; no tokens give an
    empty output. ``auto`` measures which is faster once per kind of layer and token bucket (never on
    no tokens), and never takes a grouped kernel whose output disagrees with the loop's."""
    import copy

    from shuffleprune.deploy.format import compress
    from unittest.mock import patch

    from shuffleprune.deploy import sparse_experts
    from shuffleprune.deploy.experts_load import attach_sparse_experts
    from shuffleprune.deploy.sparse_experts import (experts_mode, grouped_experts_forward, loop_experts_forward,
                                                    nm_experts_forward, release_mode_choices, set_experts_mode)
    from shuffleprune.masks import nm_keep_mask

    dense = torch.nn.Module()
    dense.experts = tiny_model(model_type).model.layers[0].mlp.experts
    dense.experts.config._experts_implementation = "eager"
    tensors, entries = {}, {}
    with torch.no_grad():
        for name, expert in block_experts(dense, "").items():   # every expert 2:4, compressed as export does
            expert.weight.mul_(nm_keep_mask(expert.weight.abs(), 2, 4))
            tensors[f"{name}.values"], tensors[f"{name}.meta"] = compress(expert.weight, 2, 4)
            entries[f"experts.{expert.param}"] = {"experts": dense.experts.num_experts,
                                                  "shape": list(expert.weight.shape),
                                                  "transposed": dense.experts.is_transposed, "perm": False}
    holder = copy.deepcopy(dense)
    holder.experts.config = copy.deepcopy(dense.experts.config)
    attach_sparse_experts(holder, tensors, {"n": 2, "m": 4, "experts": entries})
    experts, sparse = dense.experts, holder.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, experts.config.hidden_size, generator=g)
    top = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(6)])
    top[2, 1] = experts.num_experts   # a pair routed to no local expert
    weights = torch.softmax(torch.randn(6, 2, generator=g), -1)
    with torch.no_grad():   # the reference drops that pair by its weight (gpt-oss's eager forward takes no sentinel)
        want = experts(x, top.clamp(max=experts.num_experts - 1), weights * (top < experts.num_experts))
        for mode in ("grouped", "loop"):
            set_experts_mode(holder, mode)
            with _HostSyncs() as syncs:
                got = nm_experts_forward(sparse, x, top, weights)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert (syncs.seen == []) == (mode == "grouped"), (mode, syncs.seen)
            assert nm_experts_forward(sparse, x[:0], top[:0], weights[:0]).shape == (0, x.shape[1])   # no tokens
    # auto: the loop on the CPU and without a routing to measure with; where the grouped kernel runs, what
    # was measured faster (once per kind of layer and token bucket), the grouped one in a graph capture
    set_experts_mode(holder, "auto")
    release_mode_choices()
    assert experts_mode(sparse, x, top, weights) == "loop"
    speed = {grouped_experts_forward: 1.0, loop_experts_forward: 2.0}
    timed = []

    def fake_ms(calls, reps):
        fn = calls[0]
        with patch.object(sparse_experts, "grouped_experts_forward", lambda *a: timed.append("grouped") or want), \
                patch.object(sparse_experts, "loop_experts_forward", lambda *a: timed.append("loop") or want):
            fn()
        return speed[grouped_experts_forward if timed[-1] == "grouped" else loop_experts_forward]

    monkeypatch.setattr(sparse_experts, "grouped_runs_on", lambda x: True)
    monkeypatch.setattr(sparse_experts, "eager_ms", fake_ms)
    measured_aside = []   # each measurement outside any CUDA graph pool (a compiled model's keeps nothing)
    monkeypatch.setattr(sparse_experts, "outside_graph_pools", lambda fn, x: measured_aside.append(x) or fn())
    assert experts_mode(sparse, x, top, weights) == "grouped" and timed == ["grouped", "loop"]
    speed[grouped_experts_forward] = 3.0
    assert experts_mode(sparse, x[:5], top[:5], weights[:5]) == "grouped" and len(timed) == 2   # same bucket
    assert experts_mode(sparse, x[:2], top[:2], weights[:2]) == "loop" and len(timed) == 4     # bucket 2: measured
    assert len(measured_aside) == 2
    assert experts_mode(sparse, x[:2]) == "loop"
    assert experts_mode(sparse, x[:0], top[:0], weights[:0]) == "loop" and len(timed) == 4   # no tokens: not measured
    monkeypatch.setattr(sparse_experts, "grouped_experts_forward", lambda *a: want + 0.1 * want.abs().max())
    release_mode_choices()
    with pytest.warns(RuntimeWarning, match="grouped experts kernel is off by 0.1"):
        assert experts_mode(sparse, x, top, weights) == "loop"   # disagrees with the loop: not used, even if faster
    from triton.runtime.errors import OutOfResources

    from shuffleprune.runtime.faults import DeviceFault

    def cannot_run(*a):   # a kernel this GPU refuses (as Triton's loader refuses one over its shared memory)
        raise OutOfResources(120_000, 101_376, "shared memory")

    monkeypatch.setattr(sparse_experts, "grouped_experts_forward", cannot_run)
    release_mode_choices()
    with pytest.warns(RuntimeWarning, match="grouped experts kernel cannot run on this device.*OutOfResources"):
        assert experts_mode(sparse, x, top, weights) == "loop"   # the loop runs the model instead of the error

    def faults(*a):   # an error after which no kernel runs in this process: named, not skipped
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sparse_experts, "grouped_experts_forward", faults)
    release_mode_choices()
    with pytest.raises(DeviceFault, match="grouped experts kernel.*set_experts_mode"):
        experts_mode(sparse, x, top, weights)
    release_mode_choices()
    sparse.nm_experts["down_proj"].mode = "loop"   # one projection's choice holds for the layer
    assert experts_mode(sparse, x, top, weights) == "loop"
    sparse.nm_experts["gate_up_proj" if sparse.has_gate else "up_proj"].mode = "grouped"
    with pytest.raises(ValueError, match="different modes"):
        experts_mode(sparse, x)
