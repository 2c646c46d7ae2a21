"""Learned / random input permutations in the pruning pipeline."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from shuffleprune.calib import calibration_windows, get_source
from shuffleprune.errors import UserError
from shuffleprune.masks import Pattern, satisfies_nm
from shuffleprune.prune.methods import sparsegpt, wanda, wanda_score
from shuffleprune.perm.search import swap_search
from shuffleprune.perm.learning import cosine_loss, hard_masked_weight, learn_permutations, masked_weight, soft_nm_mask
from shuffleprune.prune.stages.prune import prune_in_permuted_coordinates
from shuffleprune.perm.core import PermSchedule, SoftPermutation, block_sizes, perm_to_blocks, random_block_perm
from shuffleprune.models import load_model
from shuffleprune.perm.linear import PermutedLinear, apply_index_maps, load_index_maps, weights_stored_permuted
from shuffleprune.perm.linear import INDEX_MAPS
from shuffleprune.prune import prune
from conftest import flat_config
from shuffleprune.prune.input_stats import InputStats, collect_input_stats, input_groups, load_norms, save_norms


def test_soft_mask_is_the_group_softmax_and_hard_weight_matches_the_matrix_form():
    gen = torch.Generator().manual_seed(3)
    score = torch.rand(8, 136, generator=gen) * 5
    soft = soft_nm_mask(score, 2, 4, tau=0.5)
    g = score.reshape(8, 34, 4)
    ref = 2 * torch.softmax(g / (0.5 * g.mean(-1, keepdim=True)), dim=-1)
    assert torch.allclose(soft, ref.reshape(8, 136), atol=1e-6)
    assert torch.allclose(soft.reshape(8, 34, 4).sum(-1), torch.full((8, 34), 2.0), atol=1e-5)
    weight = torch.randn(8, 136, generator=gen)
    perm = random_block_perm(136, 64, gen)   # blocks 64, 64 and a tail of 8
    by_index = hard_masked_weight(weight, score, perm, 2, 4)
    by_matrix = masked_weight(weight, score, perm_to_blocks(perm, block_sizes(136, 64)), 2, 4)
    assert torch.equal(by_index, by_matrix)
    assert satisfies_nm(by_index[:, perm], 2, 4) and not satisfies_nm(by_index, 2, 4)


def _shuffled_two_four_layer(seed: int = 0):
    """Columns secretly shuffled (inside 64-blocks) out of a 2:4-friendly layout: in every group of
    four, two strong and two weak columns."""
    gen = torch.Generator().manual_seed(seed)
    cols, block = 128, 64
    strong = torch.zeros(cols)
    for g in range(cols // 4):
        strong[g * 4 + torch.randperm(4, generator=gen)[:2]] = 1
    hidden = torch.randn(64, cols, generator=gen) * torch.where(strong > 0, 1.0, 0.1)
    secret = random_block_perm(cols, block, gen)
    weight = torch.empty_like(hidden)
    weight[:, secret] = hidden
    return weight, torch.randn(512, cols, generator=gen), secret


def test_learning_recovers_a_permutation_far_better_than_wanda():
    weight, x, secret = _shuffled_two_four_layer()
    score, target = weight.abs() * x.norm(dim=0), x @ weight.T
    sizes = block_sizes(128, 64)

    def loss_of(perm: torch.Tensor) -> float:
        return float(cosine_loss(target, x @ masked_weight(weight, score, perm_to_blocks(perm, sizes), 2, 4).T))

    wanda_loss, oracle_loss = loss_of(torch.arange(128)), loss_of(secret)
    assert oracle_loss < 0.5 * wanda_loss  # the construction really hides a 2:4-friendly order
    sp = SoftPermutation(128, 64)
    res = learn_permutations({"w": sp}, lambda mb, _t: cosine_loss(target, x @ masked_weight(weight, score, mb["w"], 2, 4).T),
                             PermSchedule(steps=300), lr=3e-2)
    learned = min(loss_of(res.perms["w"]), loss_of(res.best_perms["w"]))
    assert learned < 0.75 * wanda_loss, (learned, wanda_loss, oracle_loss)
    assert all(torch.equal(p.sort().values, torch.arange(128)) for p in (res.perms["w"], res.best_perms["w"]))


def test_cosine_lr_decay_brings_the_soft_permutation_to_rest():
    """With ``lr_decay="cosine"`` the last step barely moves ``M``; at a constant rate it keeps moving."""
    weight, x, _ = _shuffled_two_four_layer()
    score, target = weight.abs() * x.norm(dim=0), x @ weight.T

    def last_move(decay: str) -> float:
        sp, snaps = SoftPermutation(128, 64), []
        learn_permutations({"w": sp}, lambda mb, _t: cosine_loss(target, x @ masked_weight(weight, score, mb["w"], 2, 4).T),
                           PermSchedule(steps=20, lr_decay=decay), lr=3e-2,
                           on_step=lambda *_: snaps.append([p.detach().clone() for p in sp.parameters()]))
        return max(float((a - b).abs().max()) for a, b in zip(snaps[-1], snaps[-2]))

    constant, cosine = last_move("constant"), last_move("cosine")
    assert constant > 1e-3 and cosine < 0.05 * constant, (constant, cosine)


@pytest.mark.parametrize("method", [wanda, sparsegpt])
def test_pruning_in_permuted_coordinates_is_nm_in_memory_order(method):
    torch.manual_seed(0)
    w, x = torch.randn(16, 32), torch.randn(256, 32)
    stats = InputStats(32, gram=True, device=torch.device("cpu"))
    stats.add(x)
    perm = torch.randperm(32)
    pruned = prune_in_permuted_coordinates(method, w, stats, Pattern(2, 4), perm)
    assert satisfies_nm(pruned[:, perm], 2, 4)
    # equals pruning the explicitly permuted problem
    xp = x[:, perm]
    stats_p = InputStats(32, gram=True, device=torch.device("cpu"))
    stats_p.add(xp)
    assert torch.allclose(pruned[:, perm], method(w[:, perm], stats_p, Pattern(2, 4)), atol=1e-5)


def test_prune_with_learned_perm_writes_index_maps_that_reload_to_the_same_logits(tiny_dir, text_file, eval_file, tmp_path):
    out = tmp_path / "perm"
    cfg = flat_config(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                      eval_text=str(eval_file), perm="learned", perm_block=16, perm_steps=10)
    prune(cfg, out=out, progress=False)
    report = json.loads((out / "prune_report.json").read_text())
    assert report["nm_ok"] and report["perm"]["perm"] == "learned" and report["perm"]["index_maps"] == INDEX_MAPS
    maps = load_index_maps(out / INDEX_MAPS)
    assert len(maps) == 21 and all(m.numel() in (64, 128) for m in maps.values())
    assert [b["block"] for b in report["perm"]["blocks"]] == [0, 1, 2]
    for b in report["perm"]["blocks"]:
        assert len(b["loss_curve"]) == 10 and b["recon_after"] <= b["recon_before"]
        for p in b["perms"].values():
            assert len(p["penalty_curve"]) == 10 and 0 <= p["strength"] <= 1
    ids = torch.randint(0, 128, (2, 24))
    result_model = prune(cfg, progress=False).model  # same run in memory (original column order)
    with torch.no_grad():
        ref = result_model(ids).logits
        stored = load_file(str(out / "model.safetensors"))
        for name, perm in maps.items():  # shared inputs share one map; block-diagonal with B=16
            assert torch.equal(perm.sort().values, torch.arange(perm.numel()))
            assert ((perm // 16) == (torch.arange(perm.numel()) // 16)).all()
            w = stored[f"{name}.weight"]  # the checkpoint holds W in input order: exactly 2:4 in the map's order
            assert torch.equal(w, result_model.get_submodule(name).weight)
            assert satisfies_nm(w[:, perm], 2, 4)
        assert any(not satisfies_nm(stored[f"{n}.weight"], 2, 4) for n in maps)  # not in memory order
        assert not weights_stored_permuted(out / INDEX_MAPS)
        loaded = load_model(str(out)).model  # the plain model: what any client loads
        assert not any(isinstance(m, PermutedLinear) for m in loaded.modules())
        assert torch.equal(loaded(ids).logits, ref)
        plain = AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.equal(plain(ids).logits, ref)
        mapped = apply_index_maps(plain, maps)  # what export compresses: W[:, perm] reading x[perm]
        first = mapped.get_submodule(next(iter(maps)))
        assert isinstance(first, PermutedLinear) and satisfies_nm(first.weight, 2, 4)  # N:M in memory order
        assert torch.allclose(mapped(ids).logits, ref, atol=1e-5)
        # a checkpoint of the older layout (mapped weights stored as W[:, perm], maps without metadata)
        legacy = tmp_path / "legacy"
        shutil.copytree(out, legacy)
        save_file({k: (v[:, maps[k[:-len(".weight")]]] if k[:-len(".weight")] in maps else v).contiguous()
                   for k, v in stored.items()}, str(legacy / "model.safetensors"), metadata={"format": "pt"})
        save_file({k: v.int() for k, v in maps.items()}, str(legacy / INDEX_MAPS))
        assert weights_stored_permuted(legacy / INDEX_MAPS)
        assert torch.equal(load_model(str(legacy)).model(ids).logits, ref)  # weights put back in input order
    from shuffleprune.plots import plot_perm_report

    pngs = plot_perm_report(report, tmp_path / "plots")
    assert [p.name for p in pngs] == ["perm_strength.png", "perm_penalty.png", "perm_loss.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_perm_options_are_checked(tiny_dir, text_file):
    for kwargs, needle in (({"perm": "sorted"}, "unknown permutation stage 'sorted'"), ({"perm": "learned", "pattern": None, "sparsity": 0.5}, "N:M"),
                           ({"perm": "learned", "perm_block": 6}, "multiple of M=4: set --perm-block 8 "),
                           ({"perm": "search", "pattern": "2:3"}, "multiple of M=3: set --perm-block 63 "),
                           ({"perm": "learned", "perm_block": 0}, "positive multiple of M"),
                           ({"perm": "learned", "relax": "x"}, "--relax"),
                           ({"perm": "learned", "perm_holdout": 1.0}, "--perm-holdout"),
                           ({"perm": "learned", "perm_lr_decay": "linear"}, "--perm-lr-decay"),
                           ({"perm": "learned", "perm_holdout": 0.25, "nsamples": 1}, "raise --nsamples")):
        with pytest.raises(UserError, match=needle):
            prune(flat_config(model=str(tiny_dir), calib=str(text_file), **{"pattern": "2:4", **kwargs}), progress=False)


def test_search_perm_and_learning_started_from_it(tiny_dir, text_file, eval_file, tmp_path):
    base = dict(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                eval_text=str(eval_file), perm_block=16)
    searched = prune(flat_config(**base, perm="search"), out=tmp_path / "s", progress=False).report
    assert searched["nm_ok"] and searched["perm"]["index_maps"] == INDEX_MAPS
    assert load_index_maps(tmp_path / "s" / INDEX_MAPS)
    learned = prune(flat_config(**base, perm="learned", perm_init="search", perm_steps=5), progress=False).report
    for b in learned["perm"]["blocks"]:
        assert b["chosen"] in ("final", "best_step", "search", "identity")
        assert b["recon_after"] <= min(b["recon_before"], b["recon_search"])


def test_model_level_recon_learns_all_permutations_jointly(tiny_dir, text_file, eval_file, tmp_path):
    cfg = flat_config(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                      eval_text=str(eval_file), perm="learned", recon="model", perm_block=16, perm_steps=6)
    out = tmp_path / "m"
    result = prune(cfg, out=out, progress=False)
    report = result.report
    summary = report["perm"]["model"]
    assert report["nm_ok"] and len(summary["loss_curve"]) == 6 and summary["recon_after"] <= summary["recon_before"]
    assert len(report["perm"]["blocks"]) == 3 and all(len(b["perms"]) == 4 for b in report["perm"]["blocks"])
    assert all(len(p["penalty_curve"]) == 6 for b in report["perm"]["blocks"] for p in b["perms"].values())
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        assert torch.allclose(load_model(str(out)).model(ids).logits, result.model(ids).logits, atol=1e-5)
    # Wanda's masks come from the dense statistics the permutations were chosen under, so the pruned
    # model's loss on the calibration windows is exactly the reported one (sequential statistics,
    # the block loop's own, would give other masks in the later blocks and another loss)
    assert report["mask_stats"] == "dense"
    dense = load_model(str(tiny_dir))
    tokens = calibration_windows(get_source(str(text_file)), dense.tokenizer, 8, 32, 0)
    with torch.no_grad():
        loss = cosine_loss(dense.model.base_model(input_ids=tokens).last_hidden_state,
                           result.model.base_model(input_ids=tokens).last_hidden_state)
    assert float(loss) == pytest.approx(summary["recon_after"], abs=2e-6)
    from shuffleprune.plots import plot_perm_report

    assert [p.name for p in plot_perm_report(report, tmp_path / "plots")] == ["perm_strength.png", "perm_penalty.png",
                                                                             "perm_loss.png"]


def test_model_level_recon_resumes_with_its_saved_permutations_and_statistics(tiny_dir, text_file, tmp_path):
    cfg = flat_config(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                      eval_text=None, perm="learned", recon="model", perm_block=16, perm_steps=3)
    prune(cfg, out=tmp_path / "full", progress=False)

    def crash_after_block_0(i):
        if i == 0:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        prune(cfg, out=tmp_path / "part", progress=False, on_block_done=crash_after_block_0)
    work = tmp_path / "part" / ".resume"
    assert (work / "model_perms.safetensors").is_file() and (work / "dense_stats.safetensors").is_file()
    prune(cfg, out=tmp_path / "part", resume=True, progress=False)
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "part" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (work := tmp_path / "old").mkdir()
    with pytest.raises(RuntimeError, match="killed"):
        prune(cfg, out=work, progress=False, on_block_done=crash_after_block_0)
    (work / ".resume" / "dense_stats.safetensors").unlink()  # as an older shuffleprune left it
    with pytest.raises(UserError, match="older shuffleprune; rerun with --overwrite"):
        prune(cfg, out=work, resume=True, progress=False)


def test_mask_stats_choose_dense_or_sequential_wanda_statistics(tiny_dir, text_file, tmp_path):
    base = dict(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                eval_text=None)
    for kwargs, needle in (({"mask_stats": "x"}, "unknown statistics stage 'x'"),
                           ({"mask_stats": "dense", "method": "sparsegpt"}, r"sparsegpt needs each block's real inputs")):
        with pytest.raises(UserError, match=needle):
            prune(flat_config(**{**base, **kwargs}), progress=False)
    dense = load_model(str(tiny_dir)).model
    linears = {n: m for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}
    tokens = calibration_windows(get_source(str(text_file)), load_model(str(tiny_dir)).tokenizer, 8, 32, 0)
    with collect_input_stats(linears, gram=False) as stats, torch.no_grad():
        dense.base_model(input_ids=tokens)
    saved = tmp_path / "norms.safetensors"
    save_norms(stats, saved)
    loaded = load_norms(saved)  # the groups (q/k/v, gate/up share one input) survive the round trip
    assert input_groups(loaded) == input_groups(stats) and len(input_groups(stats)) < len(stats)
    assert all(torch.equal(loaded[n].col_norm, stats[n].col_norm) for n in stats)
    pruned = {mode: prune(flat_config(**base, mask_stats=mode), progress=False) for mode in ("dense", "sequential")}
    assert pruned["dense"].report["perm"] is None and pruned["dense"].report["mask_stats"] == "dense"
    for name, lin in linears.items():  # dense: Wanda of the unpruned model's statistics, in every block
        assert torch.equal(pruned["dense"].model.get_submodule(name).weight, wanda(lin.weight, stats[name], Pattern(2, 4)))
    later = [n for n in linears if ".layers.0." not in n]  # sequential: later blocks see pruned inputs
    assert any(not torch.equal(pruned["sequential"].model.get_submodule(n).weight,
                               pruned["dense"].model.get_submodule(n).weight) for n in later)
    auto = prune(flat_config(**base, perm="learned", recon="model", perm_block=16, perm_steps=2), progress=False)
    seq = prune(flat_config(**base, perm="learned", recon="model", perm_block=16, perm_steps=2, mask_stats="sequential"),
                progress=False)
    assert auto.report["mask_stats"] == "dense" and seq.report["mask_stats"] == "sequential"
    assert auto.report["perm"]["model"]["recon_after"] == seq.report["perm"]["model"]["recon_after"]  # same perms
    searched = prune(flat_config(**base, perm="search", perm_block=16, mask_stats="dense"), out=tmp_path / "s",
                     progress=False)  # --recon block paths score their permutations with the masks' statistics
    q, k, v = (f"model.layers.2.self_attn.{x}_proj" for x in "qkv")
    expected = swap_search(torch.cat([wanda_score(linears[x].weight, stats[x]) for x in (q, k, v)]), 2, 4, 16)
    assert searched.report["mask_stats"] == "dense" and torch.equal(load_index_maps(tmp_path / "s" / INDEX_MAPS)[q], expected.int())


def test_kl_loss_is_zero_on_equal_logits_and_model_recon_learns_with_it(tiny_dir, text_file, tmp_path):
    from shuffleprune.perm.learning import kl_loss

    logits = torch.randn(2, 5, 11)
    assert float(kl_loss(logits, logits)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_loss(logits, logits + 3.0)) == pytest.approx(0.0, abs=1e-6)  # a shift is the same distribution
    p, q = torch.log_softmax(logits, -1), torch.log_softmax(logits.flip(-1), -1)
    assert float(kl_loss(logits, logits.flip(-1))) == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-5)
    kw = dict(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
              eval_text=None, perm="learned", recon="model", perm_loss="kl", perm_block=16, perm_steps=4)
    cfg = flat_config(**kw)
    report = prune(cfg, out=tmp_path / "kl", progress=False).report
    summary = report["perm"]["model"]
    assert report["nm_ok"] and report["perm"]["loss"] == "kl"
    assert summary["recon_before"] > 0 and summary["recon_after"] <= summary["recon_before"]
    with pytest.raises(UserError, match="--perm-loss kl needs --perm learned --recon model"):
        prune(flat_config(**{**kw, "recon": "block"}), progress=False)


def test_perm_from_reuses_index_maps_with_another_base(tiny_dir, text_file, tmp_path):
    base = dict(model=str(tiny_dir), pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32, eval_text=None, perm_block=16)
    prune(flat_config(**base, method="wanda", perm="random"), out=tmp_path / "w", progress=False)
    maps = load_index_maps(tmp_path / "w" / INDEX_MAPS)
    with pytest.raises(UserError, match="--perm-block does not apply to permutation 'from'"):
        flat_config(**base, method="sparsegpt", perm_from=str(tmp_path / "w"))
    base.pop("perm_block")  # the maps are given: no block size to choose
    out = tmp_path / "sg"
    report = prune(flat_config(**base, method="sparsegpt", perm_from=str(tmp_path / "w")), out=out, progress=False).report
    assert report["nm_ok"] and report["perm"]["from"] == str(tmp_path / "w")
    again = load_index_maps(out / INDEX_MAPS)
    assert again.keys() == maps.keys() and all(torch.equal(again[k], maps[k]) for k in maps)
    with pytest.raises(UserError, match="--perm-from replaces"):
        prune(flat_config(**base, method="sparsegpt", perm="random", perm_from=str(tmp_path / "w")), progress=False)
    with pytest.raises(UserError, match="no index maps"):
        prune(flat_config(**base, method="sparsegpt", perm_from=str(tmp_path)), progress=False)


def test_a_run_failing_before_its_first_checkpoint_leaves_no_output(tiny_dir, text_file, tmp_path):
    """Maps that do not fit the model are found once it is loaded, after the run made its resume
    dir: the failed run removes what it wrote (and the --out it created); a corrupt maps file
    fails before anything is written."""
    from shuffleprune.perm.linear import save_index_maps

    base = dict(model=str(tiny_dir), pattern="2:4", calib=str(text_file), nsamples=4, seqlen=32, eval_text=None,
                method="wanda")
    save_index_maps({"model.layers.0.mlp.no_such_linear": torch.arange(64)}, tmp_path / "maps.safetensors")
    for out, existed in ((tmp_path / "new", False), (tmp_path / "mine", True)):
        if existed:
            out.mkdir()
        with pytest.raises(UserError, match="not a selected linear"):
            prune(flat_config(**base, perm_from=str(tmp_path / "maps.safetensors")), out=out, progress=False)
        assert out.exists() == existed and (not existed or not any(out.iterdir()))
    (tmp_path / "bad.safetensors").write_bytes((tmp_path / "maps.safetensors").read_bytes()[:40])
    with pytest.raises(UserError, match="truncated or corrupt"):
        prune(flat_config(**base, perm_from=str(tmp_path / "bad.safetensors")), out=tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()


def test_holdout_windows_are_never_learned_on_and_decide_the_choice():
    """``--perm-holdout``: learning samples only the learn windows; the final choice evaluates only
    the held-out ones, and picks the candidate with the lowest held-out loss."""
    from shuffleprune.perm.pruning import PermOptions, _learn_and_choose, _problem, split_windows

    learn, judge = split_windows(20, 0.25, torch.Generator().manual_seed(0))
    assert len(judge) == 5 and len(learn) == 15 and sorted(torch.cat([learn, judge]).tolist()) == list(range(20))
    every = split_windows(7, 0.0, torch.Generator())
    assert torch.equal(every[0], torch.arange(7)) and torch.equal(every[1], torch.arange(7))
    with pytest.raises(UserError, match="--nsamples"):
        split_windows(1, 0.5, torch.Generator())

    weight, x, _ = _shuffled_two_four_layer()
    lin = torch.nn.Linear(128, 64, bias=False)
    lin.weight.data.copy_(weight)
    windows = x.view(16, 32, 128)
    seen = {"learn": set(), "judge": set()}

    def recon(eff: dict, rows: torch.Tensor) -> torch.Tensor:
        seen["learn" if torch.is_grad_enabled() else "judge"].update(rows.tolist())
        out = windows[rows] @ eff["w"].T
        return cosine_loss(windows[rows] @ weight.T, out)

    opts = PermOptions(perm="learned", block=64, steps=20, holdout=0.25)
    score = weight.abs() * x.norm(dim=0)
    problem = _problem({"w": lin}, {"w": x.norm(dim=0)}, [["w"]], Pattern(2, 4), opts)
    assert torch.equal(problem.scores["w"], score) and problem.searched == {}
    perms, info = _learn_and_choose(problem, recon, 16, torch.device("cpu"), torch.Generator().manual_seed(1), None)
    s = info["summary"]
    assert s["judged_on"] == "held-out" and (s["windows_learned"], s["windows_judged"]) == (12, 4)
    assert len(seen["judge"]) == 4 and not seen["judge"] & seen["learn"]
    held = sorted(seen["judge"])
    with torch.no_grad():
        def held_loss(p: torch.Tensor) -> float:
            w = masked_weight(weight, score, perm_to_blocks(p, block_sizes(128, 64)), 2, 4)
            return float(cosine_loss(windows[held] @ weight.T, windows[held] @ w.T))
        assert held_loss(perms["w"]) == pytest.approx(s["recon_after"], rel=1e-5)
        assert s["recon_after"] == min(s["recon_final"], s["recon_best_step"], s["recon_before"])


def _saved_per_weight(model, on_gpu: bool) -> float:
    """Bytes one --recon model step keeps for its backward per learned weight of ``model``'s block: its
    effective weights (a soft map over every linear, the learning's own path), each used by its layer
    on an input that needs a gradient (as every layer's does behind a learned one)."""
    from contextlib import nullcontext

    from torch.func import functional_call

    from fake_cuda import fake_cuda
    from shuffleprune.blocks import block_linears, find_blocks
    from shuffleprune.perm.pruning import PermOptions, _problem

    with fake_cuda() if on_gpu else nullcontext():
        device = "cuda" if on_gpu else "cpu"
        model.to(device)
        linears = block_linears(find_blocks(model).layers[0], "b")
        problem = _problem(linears, {n: None for n in linears}, [[n] for n in linears], Pattern(2, 4),
                           PermOptions(perm="learned"))
        soft = {u[0]: SoftPermutation(problem.width(u[0]), 16).to(device) for u in problem.units}
        frozen = {t.untyped_storage().data_ptr() for t in (*problem.weights.values(), *problem.scores.values())}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        dtype = next(model.parameters()).dtype
        x = {n: torch.randn(1, lin.in_features, dtype=dtype).to(device).requires_grad_() for n, lin in linears.items()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            eff = problem.effective({k: sp.soft() for k, sp in soft.items()}, masked_weight)
            for n, lin in linears.items():
                functional_call(lin, {"weight": eff[n]}, (x[n],))
        inputs = {t.untyped_storage().data_ptr() for t in x.values()}
        model.to("cpu")
    return sum(b for p, b in saved.items() if p not in frozen | inputs) / sum(l.weight.numel() for l in linears.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_recon_keeps_one_effective_weight_a_layer_on_a_gpu_and_its_bound_counts_it(dtype):
    """On a GPU a --recon model step keeps, per learned weight, only its layer's effective weight
    for the backward (the masked weight's float32 intermediates are recomputed: ~20 bytes a weight
    on the CPU, which keeps them), and ``recon_learning_bytes`` (the GPU pre-flight) counts exactly that."""
    from conftest import tiny_model
    from shuffleprune.blocks import block_linears, find_blocks
    from shuffleprune.perm.pruning import recon_learning_bytes

    model = tiny_model("llama", layers=1).to(dtype)
    size = torch.finfo(dtype).bits // 8
    assert _saved_per_weight(model, on_gpu=False) > size + 18   # the CPU keeps the intermediates
    on_gpu = _saved_per_weight(model, on_gpu=True)
    assert size <= on_gpu <= size + 0.5, on_gpu
    linears = block_linears(find_blocks(model).layers[0], "b")
    learned = sum(l.weight.numel() for l in linears.values())
    copies = 4 if dtype != torch.float32 else 0   # a float32 model's weights are its frozen copies
    assert recon_learning_bytes(linears) == learned * (copies + 4 + size)
