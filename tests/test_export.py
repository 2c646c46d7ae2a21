"""Compressed N:M format, the Triton gather kernel (interpreted on CPU), SparseLinear, export/load."""
from __future__ import annotations

import json

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import shuffleprune
from shuffleprune.cli import app
from shuffleprune.errors import UserError
from shuffleprune.deploy.export import SPARSE_FILE, export_checkpoint
from shuffleprune.masks import nm_keep_mask, satisfies_nm
from shuffleprune.models import load_model
from shuffleprune.prune import prune
from conftest import flat_config
from shuffleprune.deploy.format import check_compressed, compress, decompress, meta_bits, pack_positions, unpack_positions
from shuffleprune.deploy.sparse_linear import SparseLinear


def _nm_weight(rows: int, cols: int, n: int, m: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w = w * nm_keep_mask(w.abs(), n, m)
    w[0, :m] = 0  # a group with fewer than N non-zeros
    return w


@pytest.mark.parametrize("n,m,rows,cols", [(2, 4, 5, 24), (2, 4, 3, 12), (1, 4, 4, 20), (4, 8, 6, 40), (1, 2, 2, 6)])
def test_compress_round_trip_and_packing(n, m, rows, cols):
    w = _nm_weight(rows, cols, n, m)
    values, meta = compress(w, n, m)
    assert values.shape == (rows, cols // m * n) and meta.dtype == torch.uint8
    bits = meta_bits(m)
    assert meta.shape == (rows, -(-(cols // m * n) * bits // 8))
    assert torch.equal(decompress(values, meta, n, m, cols), w)
    check_compressed("w", values, meta, (rows, cols), n, m)
    pos = torch.randint(0, m, (rows, cols // m * n))
    assert torch.equal(unpack_positions(pack_positions(pos, m), m)[:, :pos.shape[1]], pos)
    if (n, m) == (2, 4):  # documented layout: value k's position in bits 2(k mod 4) of byte k // 4
        assert int(meta[1, 0]) == sum(int(p) << (2 * k) for k, p in enumerate(unpack_positions(meta, 4)[1, :4]))


def test_compress_and_check_refuse_bad_input():
    with pytest.raises(UserError, match="not 2:4"):
        compress(torch.ones(2, 8), 2, 4, "layer.x")
    values, meta = compress(_nm_weight(4, 16, 2, 4), 2, 4)
    with pytest.raises(UserError, match="corrupt sparse tensor 'w'.*values"):
        check_compressed("w", values[:, :-1], meta, (4, 16), 2, 4)
    bad = meta.clone()
    bad[0, 0] = 0  # both slots of group 0 at position 0
    with pytest.raises(UserError, match="positions"):
        check_compressed("w", values, bad, (4, 16), 2, 4)


@pytest.mark.parametrize("rows,cols,tokens,n,m,perm,bias,dtype", [
    (48, 64, 1, 2, 4, True, False, torch.float32),
    (37, 72, 5, 2, 4, True, True, torch.float32),     # ragged rows and K
    (64, 136, 16, 2, 4, False, True, torch.float16),
    (33, 128, 17, 4, 8, True, False, torch.float32),  # two token blocks, 4:8 with 4-bit positions
    (40, 96, 20, 2, 4, True, True, torch.float16),    # group variant with tl.dot (16×16 tiles), ragged
])
@pytest.mark.parametrize("variant", ["gather", "group"])
def test_triton_kernel_matches_float64_reference(rows, cols, tokens, n, m, perm, bias, dtype, variant):
    from shuffleprune.kernels.nm_matmul import nm_gather_matmul

    g = torch.Generator().manual_seed(rows + cols + tokens)
    w = _nm_weight(rows, cols, n, m, seed=tokens).to(dtype)
    values, meta = compress(w, n, m)
    p = torch.randperm(cols, generator=g) if perm else None
    b = torch.randn(rows, generator=g).to(dtype) if bias else None
    x = torch.randn(2, tokens, cols, generator=g).to(dtype)[:, :, :]
    tile = {"block_r": 16, "block_k": 32} if variant == "group" and tokens >= 16 else {}
    y = nm_gather_matmul(x, values, meta, n, m, meta_bits(m), None if p is None else p.to(torch.int32), b,
                         variant=variant, **tile)
    xr = x.double() if p is None else x.double()[..., p]
    ref = xr @ w.double().t() + (0 if b is None else b.double())
    assert y.shape == (2, tokens, rows) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), ref, atol=tol * max(1.0, ref.abs().max().item()), rtol=0)


def test_sparse_linear_cpu_path_and_weight_view():
    w = _nm_weight(12, 32, 2, 4)
    perm = torch.randperm(32)
    values, meta = compress(w, 2, 4)
    lin = SparseLinear(values, meta, 32, 2, 4, perm=perm, bias=torch.randn(12))
    x = torch.randn(3, 32)
    ref = x.double()[:, perm] @ w.double().t() + lin.bias.double()
    assert torch.allclose(lin(x).double(), ref, atol=1e-5)
    orig = lin.weight  # original input order: y = W x
    assert torch.allclose((x.double() @ orig.double().t()) + lin.bias.double(), ref, atol=1e-5)


def test_sparse_linear_holds_only_the_compressed_weight_and_shares_one_scratch():
    from shuffleprune.deploy.sparse_linear import release_scratch, scratch_buffer

    release_scratch()
    layers = [SparseLinear(*compress(_nm_weight(r, c, 2, 4, seed=r), 2, 4), c, 2, 4, perm=torch.randperm(c))
              for r, c in ((12, 32), (20, 48))]
    x = torch.randn(3, 32)
    for lin, inp in zip(layers, (x, torch.randn(3, 48))):
        ref = inp.double()[:, lin.perm.long()] @ lin.dense_permuted().double().t()
        assert torch.allclose(lin(inp).double(), ref, atol=1e-5)
        held = sum(t.numel() * t.element_size() for t in list(lin.buffers()) + list(lin.parameters()))
        dense_bytes = lin.out_features * lin.in_features * lin.values.element_size()
        assert held < 0.75 * dense_bytes  # values (½) + positions (1/16) + the index map: no dense copy
        assert not any(isinstance(v, torch.Tensor) and v.numel() >= lin.out_features * lin.in_features
                       for v in vars(lin).values())
    # both layers wrote their dense form into the same buffer, sized for the larger one
    buf = scratch_buffer(1, torch.device("cpu"), torch.float32)
    assert buf.numel() == 20 * 48
    with pytest.raises(ValueError, match="unknown SparseLinear policy"):
        SparseLinear(*compress(_nm_weight(4, 8, 2, 4), 2, 4), 8, 2, 4, policy="fastest")


def test_cslt_policy_multiplies_the_gathered_input_and_searches_once_per_token_count(monkeypatch):
    """cuSPARSELt runs only on CUDA: its three calls are stood in by dense float64 arithmetic with the
    library's contract (A compressed [R, C] from the left, B [C, T], transpose_result → [T, R]). The
    tokens reach it padded with zeros to a multiple of 8 (as PyTorch's 2:4 tensors pad them for it), and
    the padded rows never reach the output: 6 and 10 tokens search at 8 and 16, 1 and 7 reuse 8's."""
    searched = []
    monkeypatch.setattr(torch, "_cslt_compress", lambda dense: dense.double())
    monkeypatch.setattr(torch._C, "_cusparselt", SimpleNamespace(
        mm_search=lambda a, b, bias, alpha, out_dtype, transpose_result:
            searched.append(b.shape[1]) or (7, 2, 1, 9)), raising=False)

    def sparse_mm(a, b, bias, alpha, out_dtype, transpose_result, alg_id, split_k, split_k_mode):
        assert transpose_result and (alg_id, split_k, split_k_mode) == (7, 2, 1)   # the searched configuration
        assert b.shape[1] % 8 == 0, b.shape
        y = a @ b.double() + (0 if bias is None else bias.double()[:, None])
        return y.t()

    monkeypatch.setattr(torch, "_cslt_sparse_mm", sparse_mm)
    w, perm = _nm_weight(12, 32, 2, 4), torch.randperm(32)
    lin = SparseLinear(*compress(w, 2, 4), 32, 2, 4, perm=perm, bias=torch.randn(12), policy="cslt")
    for shape in ((2, 3), (2, 5), (2, 3), (1, 1), (7,), (1, 16)):
        x = torch.randn(*shape, 32)
        ref = x.double()[..., perm] @ w.double().t() + lin.bias.double()
        y = lin(x)
        assert y.shape == (*shape, 12) and torch.allclose(y.double(), ref, atol=1e-5)
    assert searched == [8, 16]   # one search per padded token count (6 → 8, 10 → 16; 1 and 7 → 8; 16 as it is)


@pytest.fixture
def pruned_perm_dir(tiny_dir, text_file, tmp_path):
    out = tmp_path / "pruned"
    cfg = flat_config(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                      eval_text=None, perm="random", perm_block=16)
    prune(cfg, out=out, progress=False)
    return out


def test_hub_ids_of_exports_and_perm_checkpoints_load_from_their_snapshots(pruned_perm_dir, tiny_dir, text_file, tmp_path,
                                                                          local_hub):
    """A repo id whose repo shuffleprune wrote resolves to its downloaded snapshot (here: a local hub
    cache, offline): an export loads with its compressed layers (by id, transformers alone would leave
    them uninitialised), a --perm checkpoint exports from its id and lends its maps to --perm-from;
    a plain repo stays an id."""
    from shuffleprune.models import hub_snapshot

    publish = local_hub
    export_checkpoint(pruned_perm_dir, tmp_path / "deployed")
    publish("me/tiny-2of4", tmp_path / "deployed")
    snapshot = publish("me/tiny-pruned", pruned_perm_dir)
    publish("me/tiny-dense", tiny_dir)
    assert hub_snapshot("me/tiny-dense") is None and hub_snapshot("me/absent") is None
    assert hub_snapshot("me/tiny-pruned") == str(snapshot)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = load_model(str(pruned_perm_dir)).model(ids).logits
        by_id = shuffleprune.load("me/tiny-2of4")
        assert any(isinstance(m, SparseLinear) for m in by_id.modules())
        assert torch.allclose(by_id(ids).logits, ref, atol=1e-5)
        shuffleprune.export("me/tiny-pruned", tmp_path / "again")  # the Python API, from a hub id
        assert torch.allclose(shuffleprune.load(str(tmp_path / "again"))(ids).logits, ref, atol=1e-5)
    with pytest.raises(UserError, match="cannot load pruned checkpoint 'me/absent': no local directory"):
        export_checkpoint("me/absent", tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()
    from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps

    cfg = flat_config(model=str(tiny_dir), method="sparsegpt", pattern="2:4", calib=str(text_file), nsamples=4,
                      seqlen=32, eval_text=None, perm_from="me/tiny-pruned")
    prune(cfg, out=tmp_path / "from-hub", progress=False)
    maps, reused = load_index_maps(pruned_perm_dir / INDEX_MAPS), load_index_maps(tmp_path / "from-hub" / INDEX_MAPS)
    assert reused.keys() == maps.keys() and all(torch.equal(reused[k], maps[k]) for k in maps)
    with pytest.raises(UserError, match="locally or as a hub repo"):
        flat_config(model=str(tiny_dir), pattern="2:4", perm_from="me/tiny-dense").spec()


def test_export_round_trip_folds_and_generates(pruned_perm_dir, tmp_path):
    out = tmp_path / "exported"
    fmt = export_checkpoint(pruned_perm_dir, out)
    ref_model = load_model(str(pruned_perm_dir)).model
    model = shuffleprune.load(str(out))
    names = [n for n, mod in model.named_modules() if isinstance(mod, SparseLinear)]
    assert len(names) == 21 and set(names) == set(fmt["layers"])
    # down_proj reads act(gate)·up: its map folds into gate/up rows; o_proj's cannot (rotary attention)
    assert all(k.endswith("mlp.down_proj") and sorted(v) == [k.replace("down_proj", "gate_proj"), k.replace("down_proj", "up_proj")]
               for k, v in fmt["folded"].items()) and len(fmt["folded"]) == 3
    assert not any(fmt["layers"][k]["perm"] for k in fmt["folded"])
    assert all(fmt["layers"][n]["perm"] for n in fmt["layers"] if n.endswith(("q_proj", "o_proj", "gate_proj")))
    stored = load_file(str(out / SPARSE_FILE))
    assert all(satisfies_nm(decompress(stored[f"{n}.values"], stored[f"{n}.meta"], 2, 4, info["shape"][1]), 2, 4)
               for n, info in fmt["layers"].items())
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref_model(ids).logits, atol=1e-5)
    gen_ref = ref_model.generate(ids[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=1)
    assert torch.equal(model.generate(ids[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=1), gen_ref)
    from transformers import AutoModelForCausalLM

    via_hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)  # the transformers path
    assert isinstance(via_hf.get_submodule(names[0]), SparseLinear)
    # one device, named by `device` (transformers: `device_map`), chosen before the serving layout is
    assert {p.device.type for p in shuffleprune.load(str(out), device="cpu").parameters()} == {"cpu"}
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            shuffleprune.load(str(out), device="cuda")
        with pytest.raises(UserError, match="no CUDA GPU"):
            AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, device_map="cuda")
    with pytest.raises(UserError, match="unknown --device 'tpu'"):
        shuffleprune.load(str(out), device="tpu")
    with pytest.raises(ValueError, match="one device"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, device_map={"model": "cpu", "lm_head": "disk"})
    for device_map in ("cpu", {"": "cpu"}):   # the second as lm-eval's HFLM passes it
        on_cpu = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, device_map=device_map)
        assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}
        assert isinstance(on_cpu.get_submodule(names[0]), SparseLinear)
    with torch.no_grad():
        assert torch.allclose(via_hf(ids).logits, ref_model(ids).logits, atol=1e-5)
    exported_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert exported_bytes < (pruned_perm_dir / "model.safetensors").stat().st_size
    card = (out / "README.md").read_text()  # a model card for the hub: what it holds, how to load it
    assert "sparsity-2:4" in card and "21 linear layers" in card and f"({len(fmt['runtime_gathers'])} layers;" in card
    assert "trust_remote_code=True" in card and 'shuffleprune.load("PATH", device="cuda")' in card
    assert "lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True" in card   # (HFLM loads it: below)


def test_warm_up_runs_every_sparse_layer_at_each_token_bucket(pruned_perm_dir, tmp_path):
    """``warm_up`` calls the model once per token bucket up to its limit (powers of two, and the limit
    itself), so every sparse layer — stacked ones included — meets each bucket before a user's request,
    on distinct token ids within the vocabulary (one repeated id would route an MoE model's tokens all
    to the same experts, and the experts' mode measured on that would be stored); the model's mode and
    outputs stay as they were; a limit that is no positive count is refused."""
    from shuffleprune.deploy.serving import warm_up

    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    model = shuffleprune.load(str(tmp_path / "exported"))
    seen: dict[str, set[int]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, SparseLinear):
            mod.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, set()).add(
                args[0].numel() // args[0].shape[-1]))
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        before = model(ids).logits
    seen.clear()
    fed = []   # the token ids: spread over the vocabulary (an MoE model routes them to many experts)
    model.get_input_embeddings().register_forward_pre_hook(lambda m, args: fed.append(args[0]))
    assert warm_up(model, 6) == [1, 2, 4, 6] and warm_up(model, 8)[-2:] == [4, 8] and warm_up(model, 1) == [1]
    assert len(seen) == 21 and all(tokens == {1, 2, 4, 6, 8} for tokens in seen.values())
    assert fed[3].shape == (1, 6) and len(set(fed[3].tolist()[0])) == 6 and int(fed[3].max()) < 128
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    for bad in (0, -3, 2.5, True, "512"):
        with pytest.raises(UserError, match="max_tokens must be a positive whole number"):
            warm_up(model, bad)


def test_export_without_folding_keeps_every_map_as_a_gather_and_the_same_logits(pruned_perm_dir, tmp_path):
    fmt = shuffleprune.export(pruned_perm_dir, tmp_path / "unfolded", fold=False, progress=False)
    assert fmt["folded"] == {} and fmt["runtime_gathers"] == sorted(fmt["layers"])  # random maps on every layer
    res = CliRunner().invoke(app, ["export", str(pruned_perm_dir), str(tmp_path / "unfolded-cli"), "--no-fold", "--quiet"])
    assert res.exit_code == 0 and "0 permutations folded" in res.output, res.output
    ref_model = load_model(str(pruned_perm_dir)).model
    model = shuffleprune.load(str(tmp_path / "unfolded"), maps="kernel")
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref_model(ids).logits, atol=1e-5)


def test_eval_scores_the_exported_model(pruned_perm_dir, tmp_path, eval_file):
    from shuffleprune.evaluation.config import EvalConfig
    from shuffleprune.evaluation.evaluate import evaluate_models

    out = tmp_path / "exported"
    export_checkpoint(pruned_perm_dir, out)
    res = evaluate_models(EvalConfig(models=[str(pruned_perm_dir), str(out)], tasks=["ppl"], ppl_text=str(eval_file),
                                     ppl_ctx=32, offline=True), progress=False)
    a, b = res["models"]
    assert abs(a["ppl"] - b["ppl"]) < 1e-3 * a["ppl"] and abs(b["sparsity"] - 0.5) < 1e-6


def test_corrupt_or_truncated_exports_are_refused(pruned_perm_dir, tmp_path):
    out = tmp_path / "exported"
    export_checkpoint(pruned_perm_dir, out)
    tensors = load_file(str(out / SPARSE_FILE))
    name = "model.layers.1.self_attn.q_proj.meta"
    bad = dict(tensors)
    bad[name] = torch.zeros_like(tensors[name])
    save_file(bad, str(out / SPARSE_FILE))
    with pytest.raises(UserError, match="model.layers.1.self_attn.q_proj"):
        shuffleprune.load(str(out))
    data = (pruned_perm_dir / "model.safetensors").read_bytes()
    (out / SPARSE_FILE).write_bytes(data[: len(data) // 3])
    with pytest.raises(UserError, match="truncated or corrupt"):
        shuffleprune.load(str(out))
    fmt = json.loads((out / "shuffleprune_format.json").read_text())
    (out / "shuffleprune_format.json").write_text(json.dumps({**fmt, "version": 99}))
    with pytest.raises(UserError, match="v99"):
        shuffleprune.load(str(out))


def test_export_cli_errors_leave_nothing(pruned_perm_dir, tmp_path, tiny_dir):
    runner = CliRunner()
    r = runner.invoke(app, ["export", str(tmp_path / "missing"), str(tmp_path / "e1")])
    assert r.exit_code == 2 and "not a pruned checkpoint" in r.output and not (tmp_path / "e1").exists()
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(64))   # what prune reads, not what export does
    r = runner.invoke(app, ["export", str(tmp_path / "model.gguf"), str(tmp_path / "e1")])
    assert r.exit_code == 2 and " ".join(r.output.split()).endswith(
        "is not a pruned checkpoint directory (no config.json) (give the directory `prune --out` wrote)"), r.output
    r = runner.invoke(app, ["export", str(tiny_dir), str(tmp_path / "e2")])  # dense: no report, no pattern
    assert r.exit_code == 2 and "--pattern" in r.output and not (tmp_path / "e2").exists()
    r = runner.invoke(app, ["export", str(tiny_dir), str(tmp_path / "e3"), "--pattern", "2:4"])
    assert r.exit_code == 2 and "no sparse nn.Linear layers" in r.output and not (tmp_path / "e3").exists()
    # a 2:4 run given another pattern (4:8 holds too, but would lose the 2:4 kernels) is refused
    r = runner.invoke(app, ["export", str(pruned_perm_dir), str(tmp_path / "e4"), "--pattern", "4:8"])
    assert r.exit_code == 2 and "was pruned 2:4 (its report says so): leave out --pattern" in r.output, r.output
    assert not (tmp_path / "e4").exists()
    r = runner.invoke(app, ["export", str(pruned_perm_dir), str(tmp_path / "e4"), "--pattern", "2:4"])
    assert r.exit_code == 0, r.output
    assert "permutations folded" in r.output
    r = runner.invoke(app, ["export", str(tmp_path / "e4"), str(tmp_path / "e5")])  # an export given again
    assert r.exit_code == 2 and "is an export already" in r.output and not (tmp_path / "e5").exists()
    # --out, as prune, eval and dst take it, names the same place as the positional OUT; exactly one of them
    r = runner.invoke(app, ["export", str(pruned_perm_dir), "--out", str(tmp_path / "e6"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "e6").iterdir()) == sorted(p.name for p in (tmp_path / "e4").iterdir())
    for where in ([], [str(tmp_path / "e7"), "--out", str(tmp_path / "e8")]):
        r = runner.invoke(app, ["export", str(pruned_perm_dir), *where])
        assert r.exit_code == 2 and "give where to write the checkpoint once" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "e7").exists() and not (tmp_path / "e8").exists()


def test_o_proj_map_folds_into_v_proj_without_gqa(tmp_path, text_file):
    """Multi-head attention (no GQA) with permutation blocks inside heads: o_proj's map folds into v_proj's rows."""
    from conftest import make_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")  # 4 heads of 16 dims
    cfg.num_key_value_heads = cfg.num_attention_heads  # no GQA
    path = tmp_path / "mha"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    out = tmp_path / "pruned"
    prune(flat_config(model=str(path), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                      eval_text=None, perm="random", perm_block=16), out=out, progress=False)
    fmt = export_checkpoint(out, tmp_path / "exported")
    o_folds = {k: v for k, v in fmt["folded"].items() if k.endswith("o_proj")}
    assert len(o_folds) == 3 and all(v == [k.replace("o_proj", "v_proj")] for k, v in o_folds.items())
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert torch.allclose(shuffleprune.load(str(tmp_path / "exported"))(ids).logits,
                              load_model(str(out)).model(ids).logits, atol=1e-5)


def test_prune_cli_with_export(tiny_dir, text_file, tmp_path):
    out, dep = tmp_path / "p", tmp_path / "d"
    r = CliRunner().invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), "--nsamples", "4", "--seqlen", "32",
                                 "--eval-text", "none", "--perm", "search", "--perm-block", "16", "--out", str(out),
                                 "--export", str(dep), "--quiet"])
    assert r.exit_code == 0, r.output
    assert (dep / "shuffleprune_format.json").is_file() and (out / "index_maps.safetensors").is_file()
    r = CliRunner().invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), "--export", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--export needs --out" in r.output and not (tmp_path / "x").exists()


def test_layers_sharing_a_map_gather_once(pruned_perm_dir, tmp_path):
    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    model = shuffleprune.load(str(tmp_path / "exported"), maps="kernel")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.shared_gather is attn.k_proj.shared_gather is attn.v_proj.shared_gather is not None
    assert attn.o_proj.shared_gather is not attn.q_proj.shared_gather
    calls = []
    original = torch.Tensor.index_select
    x = torch.randn(2, 5, 64)
    try:
        torch.Tensor.index_select = lambda self, *a: calls.append(1) or original(self, *a)
        q, k = attn.q_proj(x), attn.k_proj(x)
        assert len(calls) == 1  # k reused q's gathered input
        x.mul_(2)  # modified in place: gathered again
        assert torch.allclose(attn.q_proj(x), 2 * q, atol=1e-5) and len(calls) == 2
        attn.k_proj(x.clone())
        assert len(calls) == 3  # a different tensor: gathered again
    finally:
        torch.Tensor.index_select = original
    assert torch.allclose(k, x.div(2)[..., attn.k_proj.perm.long()] @ attn.k_proj.dense_permuted().t(), atol=1e-5)


def test_a_shared_gather_lets_go_of_its_input_once_every_member_read_it(pruned_perm_dir, tmp_path):
    """Unstacked q/k/v with one map: their gather counts three members; it holds the gathered input
    while some have yet to read it and lets go of both tensors once all three have."""
    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    attn = shuffleprune.load(str(tmp_path / "exported"), maps="kernel", fuse=False).model.layers[0].self_attn
    gather = attn.q_proj.shared_gather
    assert gather is attn.v_proj.shared_gather and gather.members == 3
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        q, k = attn.q_proj(x), attn.k_proj(x)
        assert gather._source is x and gather._value is not None
        v = attn.v_proj(x)
    assert gather._source is None and gather._value is None
    for lin, y in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)):
        assert torch.allclose(y, x[..., lin.perm.long()] @ lin.dense_permuted().t(), atol=1e-5)


def test_bf16_export_keeps_dtype_and_logits(tiny_dir, text_file, tmp_path):
    out = tmp_path / "bf16"
    prune(flat_config(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=4, seqlen=32,
                      eval_text=None, perm="random", perm_block=16, dtype="bfloat16"), out=out, progress=False)
    fmt = export_checkpoint(out, tmp_path / "exported")
    assert fmt["dtype"] == "bfloat16"
    stored = load_file(str(tmp_path / "exported" / SPARSE_FILE))
    assert all(v.dtype == torch.bfloat16 for k, v in stored.items() if k.endswith(".values"))
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():  # same bf16 values, same gathered inputs, same matmul: identical on CPU
        a = load_model(str(out), "bfloat16").model(ids).logits
        b = shuffleprune.load(str(tmp_path / "exported"), "bfloat16")(ids).logits
    assert b.dtype == torch.bfloat16 and torch.equal(a, b)


def test_load_holds_cslt_buffers_by_default_only_where_cslt_by_default_says(pruned_perm_dir, tmp_path, monkeypatch):
    """``load``'s ``cslt=None`` asks :func:`cslt_by_default` about the model's device: False on the CPU
    (the export's layout stays), and where it says True (a Hopper GPU with cuSPARSELt) the layers
    that can take it hold cuSPARSELt's buffer unasked. A wrong ``maps`` is refused."""
    from shuffleprune.deploy import serving

    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    assert not serving.cslt_by_default(torch.device("cpu"))
    default = shuffleprune.load(str(tmp_path / "exported"), "bfloat16")
    assert not any(m.tiled for m in default.modules() if isinstance(m, SparseLinear))
    asked = []
    monkeypatch.setattr(serving, "cslt_by_default", lambda device: asked.append(device) or True)
    hopper = shuffleprune.load(str(tmp_path / "exported"), "bfloat16")
    assert asked == [torch.device("cpu")] and any(m.tiled for m in hopper.modules() if isinstance(m, SparseLinear))
    assert not any(m.tiled for m in shuffleprune.load(str(tmp_path / "exported"), "bfloat16", cslt=False).modules()
                   if isinstance(m, SparseLinear))
    with pytest.raises(UserError, match="maps must be"):
        serving.arrange_for_serving(default, maps="layers")


def test_gqa_o_proj_folds_into_v_proj_only_when_heads_sharing_a_kv_head_agree():
    from conftest import tiny_model

    from shuffleprune.deploy.fold import fold_permutations
    from shuffleprune.perm.linear import PermutedLinear

    gen = torch.Generator().manual_seed(0)
    for consistent in (True, False):
        model = tiny_model("llama")  # 4 query heads × 16 dims, 2 KV heads: heads (0,1) share KV 0, (2,3) KV 1
        ids = torch.randint(0, 128, (1, 12), generator=gen)
        with torch.no_grad():
            ref = model(ids).logits
        attn = model.model.layers[1].self_attn
        kv_local = [torch.randperm(16, generator=gen) for _ in range(2)]
        heads = [kv_local[h // 2] if consistent or h % 2 == 0 else torch.randperm(16, generator=gen) for h in range(4)]
        perm = torch.cat([p + 16 * h for h, p in enumerate(heads)])
        attn.o_proj = PermutedLinear.from_linear(attn.o_proj, perm)
        folded = fold_permutations(model)
        key = "model.layers.1.self_attn.o_proj"
        assert (folded.get(key) == ["model.layers.1.self_attn.v_proj"]) is consistent
        assert isinstance(model.model.layers[1].self_attn.o_proj, PermutedLinear) is not consistent
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, ref, atol=1e-5)


@pytest.mark.parametrize("spread", [0.5, 1e-3])
def test_a_map_folds_through_a_norm_between_two_linears_exactly(spread):
    """MLA's q_b_proj reads q_a_layernorm(q_a_proj(h)): its map folds into q_a_proj's rows with the
    norm's weight permuted alike, so the block computes what it did to float rounding. Norm weights
    far from 1 (a pretrained model's): the fold was refused before (a gather stayed); weights within
    1e-3 of 1 (a short dst run's): a fold leaving the norm's weight behind passed the probe check and
    changed the model by ~1e-5."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shuffleprune.deploy.fold import fold_permutations
    from shuffleprune.perm.linear import PermutedLinear

    config = AutoConfig.for_model("deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                  kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=16, first_k_dense_replace=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.q_a_layernorm.weight.copy_(1 + spread * torch.randn(32))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.double()
    attn.q_b_proj = PermutedLinear.from_linear(attn.q_b_proj, torch.randperm(32, generator=torch.Generator().manual_seed(2)))
    folded = fold_permutations(model)
    assert folded["model.layers.1.self_attn.q_b_proj"] == ["model.layers.1.self_attn.q_a_proj"]
    assert not isinstance(model.model.layers[1].self_attn.q_b_proj, PermutedLinear)
    with torch.no_grad():
        out = model(ids).logits.double()
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-6


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2", "gemma3_text"])
def test_learned_perm_export_reloads_for_other_architectures(arch, text_file, tmp_path):
    """Prune with learned index maps and export on non-LLaMA decoders (Qwen2's q/k/v biases, Gemma's
    sliding windows and extra norms): the exported model gives the pruned model's logits, and the
    MLP maps fold into gate/up (the code never looks at the architecture's name)."""
    from conftest import make_tokenizer, tiny_model

    src = tmp_path / arch
    tiny_model(arch).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    pruned, out = tmp_path / "pruned", tmp_path / "exported"
    cfg = flat_config(model=str(src), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                      eval_text=None, perm="learned", perm_block=16, perm_steps=3)
    prune(cfg, out=pruned, progress=False)
    fmt = export_checkpoint(pruned, out)
    assert fmt["folded"] and all(k.endswith("down_proj") for k in fmt["folded"])
    ref = load_model(str(pruned)).model
    model = shuffleprune.load(str(out), maps="kernel")
    assert sum(isinstance(mod, SparseLinear) for mod in model.modules()) == 21
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-5)
    from shuffleprune.deploy.producer_maps import MappedOutput

    mapped = shuffleprune.load(str(out), maps="producer")  # Gemma's (1 + weight) norms are recognised too
    norms = [mod for mod in mapped.modules() if isinstance(mod, MappedOutput)]
    with_maps = sum(layer.self_attn.q_proj.perm is not None for layer in model.model.layers)  # learned: some stay identity
    assert with_maps and len(norms) == 2 * with_maps and all(mod.scale is not None for mod in norms)
    with torch.no_grad():
        assert torch.allclose(mapped(ids).logits, ref(ids).logits, atol=1e-5)


def _wanda_random_maps_exported(model, text_file, src):
    """``model`` saved to ``src`` with the tests' tokenizer, pruned 2:4 by Wanda with random index maps within
    16-column blocks, and exported beside it; returns the pruned and the exported directories."""
    from conftest import make_tokenizer

    model.save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    pruned, out = src.parent / "pruned", src.parent / "exported"
    cfg = flat_config(model=str(src), method="wanda", pattern="2:4", calib=str(text_file), nsamples=4, seqlen=32,
                      eval_text=None, perm="random", perm_block=16)
    prune(cfg, out=pruned, progress=False)
    export_checkpoint(pruned, out)
    return pruned, out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_export_with_biases_loads_in_another_dtype_and_runs_as_the_pruned_model_in_it(dtype, text_file, tmp_path):
    """Qwen2's q/k/v carry biases, stored in the export's dtype (float32 here): loaded in half precision,
    by ``load`` or by transformers through the export's own class, every tensor of a sparse layer
    must follow the dtype asked for (a float32 bias failed the first matmul)."""
    from conftest import tiny_model
    from transformers import AutoModelForCausalLM

    pruned, out = _wanda_random_maps_exported(tiny_model("qwen2"), text_file, tmp_path / "qwen2")
    torch_dtype = getattr(torch, dtype)
    ref = load_model(str(pruned), dtype).model
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    loaded = {"load": shuffleprune.load(str(out), dtype=dtype),
              "transformers": AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch_dtype)}
    with torch.no_grad():
        want = ref(ids).logits.float()
        for how, model in loaded.items():
            layers = [mod for mod in model.modules() if isinstance(mod, SparseLinear)]
            assert layers and any(mod.bias is not None for mod in layers), how
            assert all(mod.values.dtype == torch_dtype and (mod.bias is None or mod.bias.dtype == torch_dtype)
                       for mod in layers), how
            got = model(ids).logits
            assert got.dtype == torch_dtype, how
            assert (got.float() - want).abs().max() <= 0.02 * want.abs().max(), how


def test_transformers_loads_an_export_with_its_arguments_honoured_or_refused(text_file, tmp_path):
    """``from_pretrained(EXPORT, trust_remote_code=True, **kwargs)`` runs the installed package's
    ``load_for_transformers``: the attention implementation and config overrides reach the model; arguments
    an export cannot honour (another revision, quantization, several devices) are a ValueError naming
    them; one it does not know is a warning, never silently dropped. lm-eval's ``hf`` model and
    transformers' ``pipeline`` load it by path."""
    import warnings

    from conftest import tiny_model
    from transformers import AutoModelForCausalLM

    pruned, out = _wanda_random_maps_exported(tiny_model("llama"), text_file, tmp_path / "llama")
    assert "load_for_transformers(path, *args, **kwargs)" in (out / "shuffleprune_hf.py").read_text()

    def via_hf(**kwargs):
        return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, **kwargs)

    assert via_hf().config._attn_implementation == "sdpa"
    eager = via_hf(attn_implementation="eager", rms_norm_eps=0.5)   # the second: a config override
    assert eager.config._attn_implementation == "eager" and eager.config.rms_norm_eps == 0.5
    assert any(isinstance(mod, SparseLinear) for mod in eager.modules())
    assert shuffleprune.load(str(out), attn_implementation="eager").config._attn_implementation == "eager"
    lm_eval_like = via_hf(revision="main", subfolder="", gguf_file=None, quantization_config=None,
                          dtype=torch.bfloat16, device_map={"": "cpu"})
    assert lm_eval_like.dtype == torch.bfloat16
    from lm_eval.models.huggingface import HFLM   # the client itself: lm_eval --model hf --model_args pretrained=OUT,…

    served = HFLM(pretrained=str(out), trust_remote_code=True, device="cpu", batch_size=1).model
    assert any(isinstance(mod, SparseLinear) for mod in served.modules())
    from transformers import pipeline

    ask = dict(max_new_tokens=6, do_sample=False, pad_token_id=1)
    generated = pipeline("text-generation", model=str(out), trust_remote_code=True)("the cat of", **ask)
    assert generated == pipeline("text-generation", model=str(pruned))("the cat of", **ask)
    for refused, match in [(dict(revision="v2"), "revision: download that revision"),
                           (dict(quantization_config={"load_in_4bit": True}), "quantization_config: load it without"),
                           (dict(device_map={"model": "cpu", "lm_head": "cuda:0"}), "one device"),
                           (dict(device_map="balanced"), "one device")]:
        with pytest.raises(ValueError, match=match):
            via_hf(**refused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        via_hf(not_an_argument=1)
    assert any("ignores these from_pretrained arguments: not_an_argument" in str(w.message) for w in caught)


@pytest.mark.parametrize("arch", ["gemma4_text", "falcon_mamba"])
def test_models_whose_config_varies_per_layer_or_whose_blocks_read_their_norms_export_and_reload(arch, text_file,
                                                                                              tmp_path):
    """Gemma 4's config holds ``head_dim`` per layer (transformers refuses to read one for the whole
    model): the export reads each attention module's own head layout instead. FalconMamba's block
    reads ``norm.weight.dtype``: the module that writes a moved map's order answers with its norm's.
    Both export with index maps and reload to the pruned model's logits, maps in the layers or moved."""
    from conftest import tiny_model

    pruned, out = _wanda_random_maps_exported(tiny_model(arch), text_file, tmp_path / arch)
    ref = load_model(str(pruned)).model
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    from shuffleprune.deploy.producer_maps import MappedOutput

    with torch.no_grad():
        want = ref(ids).logits
        for maps in ("kernel", "producer"):
            model = shuffleprune.load(str(out), maps=maps)
            assert torch.allclose(model(ids).logits, want, atol=1e-4), maps
    moved = [mod for mod in model.modules() if isinstance(mod, MappedOutput)]
    assert moved and all(mod.weight is mod.inner.weight for mod in moved)


@pytest.mark.parametrize("arch,extra", [("cpmant", dict(dim_ff=128, dim_head=16)), ("hrm_text", {})])
def test_models_whose_block_list_sits_below_the_module_that_embeds_the_tokens_export_and_reload(arch, extra, text_file,
                                                                                                 tmp_path):
    """CPM-Ant runs its blocks in an encoder that takes hidden states, HRM in two stacks that do: the decoder
    export's fold check runs as a whole is the module above them that takes ``input_ids``
    (``blocks.decoder_of``; export failed on both with "forward() missing … 'hidden_states'"). Both export
    with index maps and reload to the pruned model's logits, maps in the layers or moved."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shuffleprune.blocks import decoder_of, find_blocks

    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  pad_token_id=0, bos_token_id=0, eos_token_id=0, **extra)
    dense = AutoModelForCausalLM.from_config(config).eval()
    blocks = find_blocks(dense)
    assert blocks.name.rpartition(".")[0] != "" and decoder_of(dense, blocks) is not dense.get_submodule(
        blocks.name.rpartition(".")[0])   # the list's parent takes no tokens: the decoder is above it
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert decoder_of(dense, blocks)(input_ids=ids).last_hidden_state.shape == (2, 20, 64)
    pruned, out = _wanda_random_maps_exported(dense, text_file, tmp_path / arch)
    ref = load_model(str(pruned)).model.eval()
    with torch.no_grad():
        want = ref(ids).logits
        for maps in ("kernel", "producer"):
            model = shuffleprune.load(str(out), maps=maps)
            assert sum(isinstance(mod, SparseLinear) for mod in model.modules()) > 0
            assert torch.allclose(model(ids).logits, want, atol=1e-4 * float(want.abs().max())), maps


def test_gpt2_conv1d_model_prunes_loads_with_plain_transformers_and_exports(text_file, tmp_path):
    """GPT-2 stores its layers as ``Conv1D`` (``W`` as ``[in, out]``): prune holds them as linears, the
    checkpoint keeps their layout (plain transformers loads it: the pruned logits, every layer 2:4 in
    its map's order along its inputs), and the export compresses all 12 and gives the same logits,
    with the maps in the layers or moved to the LayerNorms that produce their inputs."""
    from transformers import AutoModelForCausalLM

    from conftest import make_tokenizer, tiny_model
    from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps

    src = tmp_path / "gpt2"
    tiny_model("gpt2").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    pruned, out = tmp_path / "pruned", tmp_path / "exported"
    cfg = flat_config(model=str(src), method="sparsegpt", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                      eval_text=None, perm="learned", perm_block=16, perm_steps=3)
    result = prune(cfg, out=pruned, progress=False)
    assert len(result.report["layers"]) == 12 and result.report["nm_ok"]
    plain = AutoModelForCausalLM.from_pretrained(pruned).eval()
    maps = load_index_maps(pruned / INDEX_MAPS)
    for name, layer in plain.named_modules():
        if type(layer).__name__ == "Conv1D" and name.startswith("transformer.h."):
            w = layer.weight.t()     # [out, in]
            assert satisfies_nm(w if name not in maps else w[:, maps[name]], 2, 4), name
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = result.model(ids).logits
        assert torch.allclose(plain(ids).logits, want, atol=1e-5)
        export_checkpoint(pruned, out)
        for where in ("kernel", "producer"):
            model = shuffleprune.load(str(out), maps=where)
            assert sum(isinstance(mod, SparseLinear) for mod in model.modules()) == 12
            assert torch.allclose(model(ids).logits, want, atol=1e-5)


def test_multimodal_checkpoint_has_its_text_decoder_pruned_exported_and_reloaded(text_file, tmp_path):
    """A Gemma 3 checkpoint is multimodal (vocabulary, heads and context in its ``text_config``): its
    text decoder's 21 linears are pruned with learned maps, the vision tower is left as it is, and
    the export gives the pruned logits."""
    from conftest import make_tokenizer, tiny_model

    src = tmp_path / "gemma3"
    dense = tiny_model("gemma3")
    dense.save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    pruned, out = tmp_path / "pruned", tmp_path / "exported"
    cfg = flat_config(model=str(src), method="wanda", pattern="2:4", calib=str(text_file), nsamples=8, seqlen=32,
                      eval_text=None, perm="learned", perm_block=16, perm_steps=3)
    result = prune(cfg, out=pruned, progress=False)
    assert len(result.report["layers"]) == 21 and all(".language_model." in l["name"] for l in result.report["layers"])
    vision = {n: p for n, p in result.model.named_parameters() if "vision" in n}
    assert vision and all(torch.equal(p, dense.get_parameter(n)) for n, p in vision.items())
    export_checkpoint(pruned, out)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = shuffleprune.load(str(out))
        assert sum(isinstance(mod, SparseLinear) for mod in model.modules()) == 21
        assert torch.allclose(model(ids).logits, result.model(ids).logits, atol=1e-5)


def test_alibi_model_prunes_with_the_default_recipe_exports_and_reloads(text_file, tmp_path):
    """BLOOM (ALiBi bias laid out per window, fused query_key_value, LayerNorms with biases, GELU MLP)
    through the default recipe with learned maps instead of searched ones, its weight update replaying
    blocks on batches of several sizes; the export gives the pruned model's logits with its maps in the
    layers or at the norms."""
    from conftest import make_tokenizer, tiny_model

    src = tmp_path / "bloom"
    tiny_model("bloom").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    from shuffleprune.prune import PruneConfig

    cfg = PruneConfig.build("accurate", model=str(src), pattern="2:4", calib=str(text_file), nsamples=5, seqlen=32,
                            batch_size=2, eval_text=None, perm="learned", perm_block=16, perm_steps=2)
    prune(cfg, out=tmp_path / "pruned", progress=False)
    export_checkpoint(tmp_path / "pruned", tmp_path / "exported")
    ref = load_model(str(tmp_path / "pruned")).model
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    for maps in ("kernel", "producer"):
        model = shuffleprune.load(str(tmp_path / "exported"), maps=maps)
        assert sum(isinstance(mod, SparseLinear) for mod in model.modules()) == 12
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-5)


def test_index_maps_move_to_the_norms_that_produce_their_input(pruned_perm_dir, tmp_path):
    """``load(maps="producer")``: q/k/v and gate/up lose their shared map, the RMSNorms feeding them
    write their output permuted (recognised numerically, fused kernel under the interpreter here), o_proj
    keeps its own (its input comes from no module), and the logits stay the same."""
    from shuffleprune.deploy.producer_maps import MappedOutput

    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    ref = shuffleprune.load(str(tmp_path / "exported"), maps="kernel")
    model = shuffleprune.load(str(tmp_path / "exported"), maps="producer")
    for layer, ref_layer in zip(model.model.layers, ref.model.layers):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            assert isinstance(norm, MappedOutput) and norm.scale is not None
        attn, mlp = layer.self_attn, layer.mlp
        assert all(lin.perm is None for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
        assert attn.o_proj.perm is not None
        assert torch.equal(layer.input_layernorm.perm, ref_layer.self_attn.q_proj.perm)
        assert torch.equal(layer.post_attention_layernorm.perm, ref_layer.mlp.up_proj.perm)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)
        for mod in model.modules():
            if isinstance(mod, MappedOutput):
                mod.kernel = True  # the Triton kernel, interpreted on the CPU
        assert torch.allclose(model(ids).logits, expected, atol=1e-4)
        torch._dynamo.reset()   # torch.compile: the fused norm is one operator (Dynamo traced its kernel before)
        explained = torch._dynamo.explain(model)(ids)
        assert explained.graph_count == 1 and explained.graph_break_count == 0
        assert sum(str(g.code).count("torch.ops.shuffleprune.rmsnorm_mapped") for g in explained.graphs) == 2 * len(model.model.layers)
        assert torch.allclose(torch.compile(model, backend="aot_eager")(ids).logits, expected, atol=1e-4)
        torch._dynamo.reset()
    with pytest.raises(UserError, match="maps must be"):
        shuffleprune.load(str(tmp_path / "exported"), maps="norm")
    for option, needle in (({"fuse": "no"}, "fuse must be True or False, not 'no'"),   # a string was taken as true
                           ({"cslt": "off"}, "cslt must be None .*, True or False, not 'off'")):
        with pytest.raises(UserError, match=needle):
            shuffleprune.load(str(tmp_path / "exported"), **option)


def test_a_map_stays_in_the_layers_when_another_module_reads_the_producer_output(pruned_perm_dir, tmp_path):
    """An MLP that also adds its input (the norm's output, read in order) must keep gate/up's map."""
    from torch import nn

    from shuffleprune.deploy.producer_maps import MappedOutput, move_maps_to_producers

    class AddsInput(nn.Module):
        def __init__(self, mlp: nn.Module):
            super().__init__()
            self.mlp = mlp

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x) + x

    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    model = shuffleprune.load(str(tmp_path / "exported"), maps="kernel")
    layer = model.model.layers[1]
    layer.mlp = AddsInput(layer.mlp)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    for lin in (layer.self_attn.q_proj, layer.mlp.mlp.gate_proj):
        lin.choices[1] = "decode"   # as if auto had measured them with their maps
    moved = move_maps_to_producers(model)
    assert layer.self_attn.q_proj.choices == {}                  # moved: measured again without the map
    assert layer.mlp.mlp.gate_proj.choices == {1: "decode"}      # kept its map: its choice stands
    assert "model.layers.1.post_attention_layernorm" not in moved and "model.layers.1.input_layernorm" in moved
    assert "model.layers.0.post_attention_layernorm" in moved
    assert not isinstance(layer.post_attention_layernorm, MappedOutput) and layer.mlp.mlp.gate_proj.perm is not None
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)


def test_a_map_stays_in_its_layer_when_an_unmapped_layer_reads_the_same_norm_output(pruned_perm_dir, tmp_path):
    """XGLM-like: v_proj reads the norm's output through a map, q_proj and k_proj read it in order. The
    norm cannot write it in v_proj's order; with near-uniform attention (q and k tiny, as in a random
    model) doing so changed the block by only 7e-5 of its output, which the probe's old bound let
    through."""
    from shuffleprune.deploy.producer_maps import MappedOutput, move_maps_to_producers

    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    model = shuffleprune.load(str(tmp_path / "exported"), maps="kernel", fuse=False)
    attn = model.model.layers[1].self_attn
    assert attn.v_proj.perm is not None
    with torch.no_grad():
        for lin in (attn.q_proj, attn.k_proj):
            lin.perm, lin.shared_gather = None, None    # identity maps: they read the norm's output in order
            lin.values.mul_(1e-3)
    attn.v_proj.shared_gather = None
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    moved = move_maps_to_producers(model)
    assert "model.layers.1.input_layernorm" not in moved and "model.layers.0.input_layernorm" in moved
    assert not isinstance(model.model.layers[1].input_layernorm, MappedOutput) and attn.v_proj.perm is not None
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-6)


def test_rms_form_recognises_rmsnorms_by_what_they_compute():
    from torch import nn
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from shuffleprune.deploy.producer_maps import rms_form

    llama, gemma = LlamaRMSNorm(48, eps=1e-6), Gemma3RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
    assert rms_form(llama, 48)[1:] == (1e-6, 0.0) and rms_form(gemma, 48)[1:] == (1e-6, 1.0)
    assert rms_form(llama, 64) is None                       # another width
    assert rms_form(nn.LayerNorm(48, bias=False), 48) is None  # subtracts the mean
    assert rms_form(nn.LayerNorm(48), 48) is None


def test_load_moves_maps_to_producers_by_default_and_skips_models_without_maps(tiny_dir, pruned_perm_dir, tmp_path,
                                                                              monkeypatch):
    """``load``'s default puts shared maps at their producers, probing the model once for both of its
    rewrites (maps and stacking); a model without mapped sparse layers (any plain HF checkpoint) is
    never probed."""
    from shuffleprune import block_inputs
    from shuffleprune.deploy import fused_inputs, producer_maps
    from shuffleprune.deploy.producer_maps import MappedOutput, has_maps

    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    built = []
    real_probe = block_inputs.block_probe
    for module in (block_inputs, producer_maps, fused_inputs):   # every name the probe is called by
        monkeypatch.setattr(module, "block_probe", lambda *a, **k: built.append(1) or real_probe(*a, **k))
    model = shuffleprune.load(str(tmp_path / "exported"))
    assert any(isinstance(mod, MappedOutput) for mod in model.modules())
    assert any(mod.fused_inputs is not None for mod in model.modules() if isinstance(mod, SparseLinear))
    assert len(built) == 1   # one probe shared by both rewrites
    assert has_maps(shuffleprune.load(str(tmp_path / "exported"), maps="kernel"))

    def probe(*_a, **_k):
        raise AssertionError("a model without index maps was probed")

    for module in (block_inputs, producer_maps, fused_inputs):
        monkeypatch.setattr(module, "block_probe", probe)
    plain = shuffleprune.load(str(tiny_dir))
    assert not has_maps(plain) and not any(isinstance(mod, MappedOutput) for mod in plain.modules())


def test_layers_reading_one_input_run_as_one_stacked_layer(pruned_perm_dir, tmp_path, monkeypatch):
    """``load``'s ``fuse``: q/k/v (and gate/up) read one tensor, so they run as one stacked layer;
    the logits are those of the unfused model, one stacked call serves the group while its input
    is unchanged, the members become views of the stacked weight (one copy in memory), and a dtype
    change rebuilds it. With the maps kept in the layers the stacked layer carries the shared map."""
    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    for maps in ("producer", "kernel"):
        plain = shuffleprune.load(str(tmp_path / "exported"), maps=maps, fuse=False)
        model = shuffleprune.load(str(tmp_path / "exported"), maps=maps)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        group = attn.q_proj.fused_inputs
        assert group is not None and group is attn.k_proj.fused_inputs is attn.v_proj.fused_inputs
        assert mlp.gate_proj.fused_inputs is mlp.up_proj.fused_inputs is not None
        assert attn.o_proj.fused_inputs is None and mlp.down_proj.fused_inputs is None
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-5)
        stacked = group.stacked
        assert (stacked.perm is None) == (maps == "producer")
        assert {lin.values.untyped_storage().data_ptr() for lin in (attn.q_proj, attn.k_proj, attn.v_proj)} == \
            {stacked.values.untyped_storage().data_ptr()}

    rows = []
    original = SparseLinear.run
    monkeypatch.setattr(SparseLinear, "run", lambda self, impl, x: rows.append(self.out_features) or original(self, impl, x))
    x = torch.randn(1, 5, attn.q_proj.in_features)
    with torch.no_grad():
        q = attn.q_proj(x)
        assert group.output_cache._source is x and group.output_cache._value is not None   # k, v take rows of it
        k, v = attn.k_proj(x), attn.v_proj(x)
        assert rows == [stacked.out_features]                      # one stacked call for the three
        assert group.output_cache._source is None and group.output_cache._value is None   # all took theirs: held no more
        x.mul_(2)                                                   # changed in place: computed again
        assert torch.allclose(attn.k_proj(x), 2 * k, atol=1e-5) and len(rows) == 2
        ref = plain.model.layers[0].self_attn
        assert torch.allclose(q, ref.q_proj(x / 2), atol=1e-5) and torch.allclose(v, ref.v_proj(x / 2), atol=1e-5)
        kept = attn.k_proj.values
        attn.k_proj.values = kept * 0                 # a member's weight replaced: the group is built again
        rows.clear()
        assert not attn.k_proj(x).any() and group.stacked is not stacked
        assert torch.allclose(attn.q_proj(x), 2 * q, atol=1e-5)   # the rebuilt stack's one call serves q
        stacked = group.stacked
        assert torch.allclose(attn.v_proj(x), 2 * v, atol=1e-5) and group.stacked is stacked   # unchanged: not rebuilt
        assert rows == [stacked.out_features]
        attn.k_proj.values = kept                     # and back
        assert torch.allclose(attn.k_proj(x), 2 * k, atol=1e-5) and group.stacked is not stacked
    model.double()
    plain.double()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-9)
    assert attn.q_proj.fused_inputs.stacked.values.dtype == torch.float64


def test_torch_compile_keeps_each_sparse_layer_one_operator_in_one_graph(pruned_perm_dir, tmp_path, monkeypatch):
    """Under ``torch.compile`` every ``SparseLinear`` is one custom operator (``shuffleprune::sparse_linear``)
    running the layer's eager forward: the whole model is one graph (no break on the stacked groups'
    and kernel choices' Python state), the stacked q/k/v group still runs as one call, and the
    compiled model gives the eager logits. A deep copy is a layer of its own for the operator."""
    import copy

    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    model = shuffleprune.load(str(tmp_path / "exported"))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(ids).logits
        explained = torch._dynamo.explain(model)(ids)
        assert explained.graph_count == 1 and explained.graph_break_count == 0
        rows = []
        original = SparseLinear.run
        monkeypatch.setattr(SparseLinear, "run", lambda self, impl, x: rows.append(self.out_features) or original(self, impl, x))
        got = torch.compile(model, backend="aot_eager")(ids).logits
        assert torch.allclose(got, want, atol=1e-5)
        q_proj = model.model.layers[0].self_attn.q_proj
        assert q_proj.fused_inputs.stacked.out_features in rows        # the group's one stacked call
        assert len(rows) == 4 * len(model.model.layers)              # per block: q/k/v, o, gate/up, down
        attn = model.model.layers[0].self_attn   # one token: each member's rows are contiguous, yet its own storage
        x1 = torch.randn(1, 1, q_proj.in_features)
        outs = [torch.ops.shuffleprune.sparse_linear(x1, lin._key) for lin in (attn.q_proj, attn.k_proj, attn.v_proj)]
        assert len({o.untyped_storage().data_ptr() for o in outs}) == 3
        twin = copy.deepcopy(q_proj)
        assert twin._key != q_proj._key
        twin.fused_inputs = None
        twin.values.zero_()
        x = torch.randn(1, 3, q_proj.in_features)
        assert not torch.ops.shuffleprune.sparse_linear(x, twin._key).any()   # the copy's weights, not the original's
    torch._dynamo.reset()


def test_generate_with_a_static_cache_compiles_the_export_and_keeps_its_tokens(pruned_perm_dir, tmp_path):
    """``generate(cache_implementation="static")``, the one argument that makes transformers compile the
    decoding step itself (on a GPU by default, with ``mode="reduce-overhead"``; here on the CPU through
    ``CompileConfig``), compiles a loaded export whole (``fullgraph``: no break) and gives the greedy
    tokens of an eager ``generate``."""
    from transformers import CompileConfig

    export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    model = shuffleprune.load(str(tmp_path / "exported"))
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    torch._dynamo.utils.counters.clear()
    config = CompileConfig(backend="aot_eager", mode=None, fullgraph=True)
    config._compile_all_devices = True   # transformers compiles on CUDA only unless asked
    got = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static", compile_config=config)
    assert torch.equal(got, want)
    assert getattr(model, "_compiled_call", None) is not None     # the decoding step was compiled, as one graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_load_with_cusparselt_buffers_gives_the_same_model(pruned_perm_dir, tmp_path):
    """``load(cslt=True)``: the layers whose shape allows it hold one cuSPARSELt buffer (k/v, 32 rows,
    do not), stacked groups of such layers share one, and the model computes what the export's
    layout computes."""
    out = tmp_path / "exported"
    export_checkpoint(pruned_perm_dir, out)
    plain = shuffleprune.load(str(out), dtype="bfloat16")
    tiled = shuffleprune.load(str(out), dtype="bfloat16", cslt=True)
    layers = {n: mod for n, mod in tiled.named_modules() if isinstance(mod, SparseLinear)}
    converted = {n for n, mod in layers.items() if mod.tiled}
    assert converted == {n for n, mod in layers.items() if mod.out_features % 64 == 0} and converted
    assert not any(n.endswith(("k_proj", "v_proj")) for n in converted)
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        assert torch.equal(tiled(ids).logits, plain(ids).logits)
    gate = layers["model.layers.0.mlp.gate_proj"]
    assert gate.fused_inputs is not None and gate.fused_inputs.stacked.tiled   # gate/up: one stacked buffer
    assert gate.values.untyped_storage().data_ptr() == gate.fused_inputs.stacked._packed.untyped_storage().data_ptr()


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_moe_experts_export_compressed_and_run_from_their_sparse_layers(model_type, text_file, tmp_path):
    """A MoE's pruned experts are exported compressed per expert (no dense copy of the fused tensor
    anywhere: not in model.safetensors, not in the loaded model) and the loaded model, running them
    through the registered shuffleprune experts forward, gives the pruned logits; a fused parameter
    left dense (--skip) stays in the dense checkpoint and runs beside the compressed one."""
    import copy

    from conftest import make_tokenizer, tiny_model
    from shuffleprune.deploy.sparse_experts import IMPLEMENTATION, eager_experts_forward, experts_mode, set_experts_mode

    src = tmp_path / model_type
    tiny_model(model_type).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    for skip in (None, ["*experts.down_proj*"]):
        pruned, exported = tmp_path / f"pruned{bool(skip)}", tmp_path / f"exported{bool(skip)}"
        cfg = flat_config(model=str(src), calib=str(text_file), eval_text=None, nsamples=4, seqlen=32, batch_size=2,
                          method="wanda", pattern="2:4", skip=skip)
        if skip:   # the skipped experts are a third of the blocks' weights: said to stay dense
            with pytest.warns(UserWarning, match=r"3\d% of the decoder blocks' weights stay dense .*down_proj"):
                prune(cfg, out=pruned, progress=False)
        else:
            prune(cfg, out=pruned, progress=False)
        fmt = export_checkpoint(pruned, exported)
        compressed = {f"model.layers.{i}.mlp.experts.{p}" for i in range(3)
                      for p in (("gate_up_proj",) if skip else ("gate_up_proj", "down_proj"))}
        assert fmt["version"] == 2 and set(fmt["experts"]) == compressed
        assert fmt["experts"]["model.layers.0.mlp.experts.gate_up_proj"] == \
            {"experts": 4, "shape": [256, 64], "transposed": model_type == "gpt_oss", "perm": False}
        # the experts are 87-89 % of these models' weights; compressed (float32) they take 17/32 of that
        size = {d: sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in (pruned, exported)}
        ratio = size[exported] / size[pruned]
        assert 0.65 < ratio < 0.75 if skip else ratio < 0.6, ratio
        assert "model.layers.2.mlp.experts.gate_up_proj[3].values" in load_file(str(exported / SPARSE_FILE))
        ref = load_model(str(pruned)).model
        model = shuffleprune.load(str(exported))
        experts = model.model.layers[0].mlp.experts
        assert model.config._experts_implementation == IMPLEMENTATION
        assert experts.gate_up_proj is None and len(experts.nm_experts["gate_up_proj"]) == 4
        assert (experts.down_proj is None) == (not skip)
        with torch.no_grad():
            want = ref(ids).logits
            torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
            # the grouped kernel (both projections compressed) gives the same; with one left dense, the loop runs
            assert set_experts_mode(model, "grouped") == (3 if skip else 6)
            assert experts_mode(experts, ids) == ("loop" if skip else "grouped")
            torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
            # torch.compile: each experts layer is one operator running its eager forward; one graph, as dense
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(ids)
            assert explained.graph_count == 1 and explained.graph_break_count == 0
            torch._dynamo.reset()
            torch.testing.assert_close(torch.compile(model, backend="aot_eager")(ids).logits, want, rtol=1e-5, atol=1e-5)
            torch._dynamo.reset()
            twin = copy.deepcopy(experts)   # a copy's operator runs the copy
            held = twin.nm_experts["gate_up_proj"]
            assert held.owner is twin and held._key != experts.nm_experts["gate_up_proj"]._key
            held.values.mul_(2)
            x = torch.randn(5, held.in_features)
            top, weights = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]]), torch.full((5, 2), 0.5)
            got = torch.ops.shuffleprune.nm_experts(x, top, weights, held._key)
            assert torch.equal(got, eager_experts_forward(twin, x, top, weights))
            assert not torch.allclose(got, eager_experts_forward(experts, x, top, weights))


def test_exports_of_format_version_1_still_load(pruned_perm_dir, tmp_path):
    """Version 2 added the experts, 3 experts in a model's own layout (an export without those is still
    written as v2, for older readers); a version-1 export (linears only) loads as before, a newer one
    is refused."""
    fmt = export_checkpoint(pruned_perm_dir, tmp_path / "exported")
    assert fmt["version"] == 2
    fmt_file = tmp_path / "exported" / "shuffleprune_format.json"
    fmt_file.write_text(json.dumps({**{k: v for k, v in fmt.items() if k != "experts"}, "version": 1}))
    assert sum(isinstance(m, SparseLinear) for m in shuffleprune.load(str(tmp_path / "exported")).modules()) > 0
    fmt_file.write_text(json.dumps({**fmt, "version": 4}))
    with pytest.raises(UserError, match="reads shuffleprune.nm v1, v2, v3"):
        shuffleprune.load(str(tmp_path / "exported"))


def test_export_compresses_the_layers_the_run_pruned_even_when_a_dense_one_holds_zeros(tiny_dir, text_file, tmp_path):
    """Which linears are N:M comes from the run's report, not from their zeros: a layer left dense
    (--skip) that happens to hold an exact zero stays dense instead of failing the N:M check."""
    pruned = tmp_path / "pruned"
    cfg = flat_config(model=str(tiny_dir), method="wanda", pattern="2:4", calib=str(text_file), nsamples=4, seqlen=32,
                      eval_text=None, perm="random", perm_block=16, skip=["*.mlp.down_proj"])
    prune(cfg, out=pruned, progress=False)
    state = load_file(str(pruned / "model.safetensors"))
    skipped = "model.layers.1.mlp.down_proj.weight"
    state[skipped][0, :3] = 0  # dense, with zeros (not 2:4)
    save_file(state, str(pruned / "model.safetensors"), metadata={"format": "pt"})
    fmt = export_checkpoint(pruned, tmp_path / "exported")
    assert len(fmt["layers"]) == 3 * 6 and not any(n.endswith("down_proj") for n in fmt["layers"])
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = load_model(str(pruned)).model(ids).logits
        assert torch.allclose(shuffleprune.load(str(tmp_path / "exported"))(ids).logits, ref, atol=1e-5)


def test_linears_outside_the_blocks_are_compressed_only_when_they_own_their_weight():
    """dst trains every linear; the export compresses those outside the decoder blocks too, except a
    layer whose weight another module shares (a tied head: compressing it would untie the embedding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shuffleprune.deploy.export import _pruned_outside_blocks

    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, vocab_size=64)
    untied = LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=False))
    tied = LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=True))
    pruned = {"lm_head", "model.layers.0.mlp.up_proj", "model.embed_tokens", "model.layers.0.mlp.experts.up_proj[0]"}
    assert list(_pruned_outside_blocks(untied, pruned, {"model.layers.0.mlp.up_proj"})) == ["lm_head"]
    assert _pruned_outside_blocks(tied, pruned, {"model.layers.0.mlp.up_proj"}) == {}
    assert _pruned_outside_blocks(untied, None, set()) == {}   # without a report only the blocks' zeros count


def test_export_of_an_unstructured_run_says_what_it_was(tiny_dir, text_file, tmp_path):
    """A checkpoint pruned unstructured is refused as such (it was '--pattern must look like N:M, got
    unstructured-0.5', naming a flag the user never gave)."""
    pruned = tmp_path / "unstructured"
    shuffleprune.prune(str(tiny_dir), out=pruned, sparsity=0.5, calib=str(text_file), nsamples=4, seqlen=32,
                       eval_text=None, progress=False)
    r = CliRunner().invoke(app, ["export", str(pruned), str(tmp_path / "e")])
    assert r.exit_code == 2 and "was pruned unstructured (unstructured-0.5)" in r.output, r.output
    assert not (tmp_path / "e").exists()


def test_a_loaded_export_is_not_saved_as_an_untrained_model(tiny_dir, text_file, tmp_path):
    """``save_pretrained`` (``push_to_hub``) of a loaded export wrote its compressed tensors under names
    transformers does not read, so the copy loaded, with a load report, as a randomly initialised
    model; it is now refused, and such a copy (or any checkpoint missing weights) is refused on load."""
    from transformers import AutoTokenizer, PreTrainedModel

    prune(flat_config(model=str(tiny_dir), calib=str(text_file), nsamples=4, seqlen=32, eval_text=None),
          out=tmp_path / "pruned", progress=False)
    export_checkpoint(tmp_path / "pruned", tmp_path / "deployed", progress=False)
    model = shuffleprune.load(str(tmp_path / "deployed"))
    for call in (lambda: model.save_pretrained(tmp_path / "copy"), lambda: model.push_to_hub("me/copy")):
        with pytest.raises(UserError, match=rf"^a model loaded from the export '{tmp_path / 'deployed'}' cannot be saved "
                                            r"with save_pretrained or push_to_hub \(its compressed layers would be lost\)"):
            call()
    assert not (tmp_path / "copy").exists()
    PreTrainedModel.save_pretrained(model, tmp_path / "copy")   # what it wrote before (or an older shuffleprune)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "copy")
    with pytest.raises(UserError, match=r"'.*copy' holds compressed N:M tensors \(e\.g\. model\.layers\.0\..*\.values\) "
                                        "without shuffleprune_format.json: it was saved with save_pretrained"):
        shuffleprune.load(str(tmp_path / "copy"))
    tensors = load_file(str(tmp_path / "pruned" / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "pruned" / "model.safetensors"), metadata={"format": "pt"})
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "pruned"), "--tasks", "ppl", "--ppl-text", str(text_file)])
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == (
        f"error: '{tmp_path / 'pruned'}' lacks weights its config.json asks for (model.layers.2.mlp.up_proj.weight), which "
        "transformers would initialise at random; give the complete checkpoint"), res.output
