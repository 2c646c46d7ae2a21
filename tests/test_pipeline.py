import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from rich.console import Console
from transformers import AutoModelForCausalLM

from shuffleprune.errors import UserError
from shuffleprune.masks import satisfies_nm
from shuffleprune.models import load_model
from shuffleprune.prune import PruneConfig, prune
from shuffleprune.report import print_prune_report
from conftest import flat_config


def config(tiny_dir, text_file, eval_file, **kw):
    base = dict(model=str(tiny_dir), calib=str(text_file), eval_text=str(eval_file), nsamples=6, seqlen=32,
                eval_ctx=32, batch_size=4, method="wanda", pattern="2:4")
    base.update(kw)
    return flat_config(**base)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_prune_writes_checkpoint_that_reloads_with_same_logits(method, tiny_dir, text_file, eval_file, tmp_path):
    out = tmp_path / "out"
    result = prune(config(tiny_dir, text_file, eval_file, method=method), out=out, progress=False)
    report = json.loads((out / "prune_report.json").read_text())
    assert report["method"] == method and report["pattern"] == "2:4" and report["nm_ok"] is True
    assert len(report["layers"]) == 3 * 7 and all(l["nm_ok"] for l in report["layers"])
    assert report["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert report["ppl"]["dense"] > 1 and report["ppl"]["pruned"] > 1
    assert report["calib"] == {"source": str(text_file), "nsamples": 6, "seqlen": 32, "seed": 0, "documents": 112,
                               "tokens": 6000, "split_from_shared_file": False}  # the whole file: used as given
    assert {"calibration", "prune", "eval"} <= set(report["seconds"]) and report["peak_rss_mb"] > 0
    card = (out / "README.md").read_text()
    assert f"{eval_file} (the whole file, " in card and report["eval"]["split"] == "the whole file"   # it said "test"
    console = Console(width=300, record=True)
    print_prune_report(report, console)   # the table said "heldout.txt test" of a file read whole
    assert f"ppl ({eval_file}, the whole file, ctx 32, " in console.export_text()
    if method == "wanda":   # the export's card says so too
        import shuffleprune

        shuffleprune.export(out, tmp_path / "exported", progress=False)
        assert f"pruning run ({eval_file}, the whole file, windows of 32" in (tmp_path / "exported" / "README.md").read_text()
        # eval on the same text and windows: the same perplexity, and both tables count the same tokens scored
        # (the prune table counted every token read, eval's the tokens in whole windows, predicted or not)
        from shuffleprune.report import print_eval_report

        scores = shuffleprune.evaluate(str(out), tasks="ppl", ppl_text=eval_file, ppl_ctx=32)
        assert scores["models"][0]["ppl"] == pytest.approx(report["ppl"]["pruned"], rel=1e-6)
        scored = report["eval"]["tokens_scored"]
        assert scored == report["eval"]["tokens"] // 32 * 31 < report["eval"]["tokens"]   # no BOS: 31 predicted per window
        print_prune_report(report, console)
        print_eval_report(scores, console)
        text = console.export_text()
        assert f"ctx 32, {scored} tokens scored)" in text and f"ctx 32, {scored} tok scored)" in text
    assert "(112 documents, 6000 tokens)" in card and f"prune {tiny_dir} --recipe PATH/recipe.yaml --out OUT" in card
    assert not (out / ".resume").exists() and not (out / ".staging").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 100, (2, 20))
    with torch.no_grad():
        assert torch.allclose(reloaded(tokens).logits, result.model(tokens).logits, atol=1e-5)
    for name, w in reloaded.named_parameters():
        if name.endswith("proj.weight"):
            assert satisfies_nm(w, 2, 4), name


def test_each_text_file_is_read_once_per_run(tiny_dir, text_file, eval_file, monkeypatch):
    """A run reads each local text once (it was read to check it before the model loaded and again to
    use it), and one file serving both sides once."""
    import shuffleprune.calib.files as files

    reads = []
    real = files.read_text_file
    monkeypatch.setattr(files, "read_text_file", lambda p: reads.append(Path(p).name) or real(p))
    prune(config(tiny_dir, text_file, eval_file, nsamples=2), progress=False)
    assert sorted(reads) == sorted([text_file.name, eval_file.name])
    reads.clear()
    prune(config(tiny_dir, text_file, text_file, nsamples=2), progress=False)
    assert reads == [text_file.name]


def test_rows_of_a_hub_split_calibrate_as_the_same_documents_in_a_file_do(tiny_dir, text_file, tmp_path, monkeypatch):
    """``--calib OWNER/NAME@SPLIT[:N]``: those rows give the checkpoint a file of them gives, and the same
    rows as ``--eval-text`` are split as one file is; rows overlapping the calibration rows are warned
    about; a bad split fails on the command line in one line before anything is written."""
    from typer.testing import CliRunner

    from conftest import fake_hub_datasets
    from shuffleprune.cli import app

    docs = [d for d in text_file.read_text().split("\n\n") if d.strip()]
    fake_hub_datasets(monkeypatch, {"train": {"text": docs + ["not read"] * 5, "n": list(range(len(docs) + 5))}})
    spec = f"me/docs@train[:{len(docs)}]"
    from_file = prune(config(tiny_dir, text_file, text_file), progress=False)
    from_hub = prune(config(tiny_dir, spec, spec), tmp_path / "out", progress=False)
    for a, b in zip(from_file.model.parameters(), from_hub.model.parameters()):
        assert torch.equal(a, b)
    report = from_hub.report
    assert report["calib"]["source"] == spec and report["calib"]["split_from_shared_file"]
    assert report["eval"]["split"] == "its held-out part" and report["ppl"] == from_file.report["ppl"]
    assert f"calib: {spec}" in (tmp_path / "out" / "recipe.yaml").read_text()
    with pytest.warns(UserWarning, match=r"'me/docs@train\[100:\]' is part of the calibration text"):
        prune(config(tiny_dir, spec, "me/docs@train[100:]", nsamples=2), progress=False)

    res = CliRunner().invoke(app, ["prune", str(tiny_dir), "--calib", "me/docs@train[:5%]", "--out", str(tmp_path / "o")])
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and "gives a percentage" in errors[0], res.output
    assert not (tmp_path / "o").exists()


def test_documents_in_memory_calibrate_as_the_same_text_in_a_file_does(tiny_dir, text_file, tmp_path):
    """``shuffleprune.prune(calib=[...])`` and ``calib=datasets.Dataset`` (or a streamed one; the Python API took only
    names and paths): the same windows, so the same checkpoint, as those documents in a .txt; one
    list for both sides is split as one file is; the recipe file names them by digest and asks for
    them again."""
    import datasets

    import shuffleprune

    docs = [d for d in text_file.read_text().split("\n\n") if d.strip()]
    kw = dict(nsamples=4, seqlen=32, progress=False)
    from_file = shuffleprune.prune(str(tiny_dir), "fast", calib=str(text_file), eval_text=str(text_file), **kw)
    from_list = shuffleprune.prune(str(tiny_dir), "fast", tmp_path / "out", calib=docs, eval_text=list(docs), **kw)
    for a, b in zip(from_file.model.parameters(), from_list.model.parameters()):
        assert torch.equal(a, b)
    report = from_list.report
    assert report["calib"]["source"].startswith("documents:") and report["calib"]["split_from_shared_file"]
    assert report["eval"]["split"] == "its held-out part" and report["ppl"] == from_file.report["ppl"]
    assert "calib=<the same documents>, eval_text=<the same documents>" in (tmp_path / "out" / "README.md").read_text()
    table = datasets.Dataset.from_dict({"content": docs, "n": list(range(len(docs)))})   # a dataset's text column
    from_dataset = shuffleprune.prune(str(tiny_dir), "fast", calib=table, eval_text=None, **kw)
    assert from_dataset.report["calib"]["source"] == report["calib"]["source"]
    streamed = shuffleprune.prune(str(tiny_dir), "fast", calib=table.to_iterable_dataset(), eval_text=None, **kw)
    assert streamed.report["calib"]["source"] == report["calib"]["source"]   # a streamed dataset: the same rows
    frame = shuffleprune.prune(str(tiny_dir), "fast", calib=table.to_pandas(), eval_text=None, **kw)
    assert frame.report["calib"]["source"] == report["calib"]["source"]       # a pandas DataFrame: the same rows
    chats = [[{"role": "user", "content": d[:len(d) // 2]}, {"role": "assistant", "content": d[len(d) // 2:]}] for d in docs]
    as_chat = shuffleprune.prune(str(tiny_dir), "fast", calib=datasets.Dataset.from_dict({"messages": chats}),
                                 eval_text=None, **kw)   # no chat template here: read as plain role: content lines
    as_lines = shuffleprune.prune(str(tiny_dir), "fast", calib=[f"user: {c[0]['content']}\nassistant: {c[1]['content']}"
                                                                for c in chats], eval_text=None, **kw)
    assert all(torch.equal(a, b) for a, b in zip(as_chat.model.parameters(), as_lines.model.parameters()))
    assert as_chat.report["calib"]["conversations"] == len(docs) and as_chat.report["calib"]["chat_template"] is False
    assert "conversations" not in as_lines.report["calib"]
    with pytest.raises(UserError, match=r"'documents:\d+:\w+' stands for documents passed in memory .* pass them again"):
        shuffleprune.prune(str(tiny_dir), tmp_path / "out" / "recipe.yaml", **kw)
    again = shuffleprune.prune(str(tiny_dir), tmp_path / "out" / "recipe.yaml", calib=docs, eval_text=docs, **kw)
    assert again.report["ppl"] == report["ppl"]
    for bad, needle in (({"calib": {"text": "a"}}, "'calib' takes a text source name, .* got dict"),
                        ({"calib": ["", " "]}, "'calib' holds no text"),
                        ({"calib": datasets.Dataset.from_dict({"q": ["a"], "a": ["b"]})},
                         r"the calib dataset: no single text field \(string fields: q, a\) and no chat field "
                         r"\(role/content messages\); rename"),
                        ({"calib": datasets.DatasetDict({"train_sft": table, "test_sft": table})},
                         r"'calib' is a DatasetDict of splits \(train_sft, test_sft\); pass one of them, e\.g\. "
                         r"calib=dataset\['train_sft'\]")):
        with pytest.raises(UserError, match=needle):
            shuffleprune.prune(str(tiny_dir), "fast", **bad, **kw)


def test_weights_outside_linears_are_reported_and_warned_about(tiny_dir, text_file, eval_file, tmp_path):
    """Matrices prune does not act on (here a Mixtral's fused experts, skipped by --skip) are reported as
    left dense — a warning, the report and the model card — where a dense LLaMA has none."""
    from conftest import make_tokenizer, tiny_model

    src = tmp_path / "moe"
    tiny_model("mixtral").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    with pytest.warns(UserWarning, match=r"8\d% of the decoder blocks' weights .*experts\.gate_up_proj"):
        result = prune(config(src, text_file, eval_file, eval_text=None, skip=["*experts*"]), out=tmp_path / "out",
                       progress=False)
    unseen = result.report["outside_linears"]
    assert unseen["share"] > 0.8 and unseen["names"][0].endswith("mlp.experts.gate_up_proj")
    assert "stay dense" in (tmp_path / "out" / "README.md").read_text()
    assert {l["name"].rsplit(".", 1)[-1] for l in result.report["layers"]} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    dense = prune(config(tiny_dir, text_file, eval_file, eval_text=None), progress=False)
    assert dense.report["outside_linears"] == {"share": 0.0, "numel": 0, "names": []}


def test_sequential_pass_feeds_pruned_outputs_forward(tiny_dir, text_file, eval_file):
    lm = load_model(str(tiny_dir))
    seen = []
    handle = lm.model.model.layers[2].register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    cfg = config(tiny_dir, text_file, eval_file, eval_text=None)
    result = prune(cfg, progress=False, loaded=lm)
    handle.remove()
    # the first call of 4 windows on block 2: its statistics pass (before it, one window checked which
    # linears the blocks call)
    stats_pass_input = next(x for x in seen if x.shape[0] == 4)
    from shuffleprune.calib import calibration_windows, get_source

    tokens = calibration_windows(get_source(str(text_file)), lm.tokenizer, 6, 32, 0)
    with torch.no_grad():
        pruned_h = result.model(tokens[:4], output_hidden_states=True).hidden_states[2]
        dense_h = load_model(str(tiny_dir)).model(tokens[:4], output_hidden_states=True).hidden_states[2]
    assert torch.allclose(stats_pass_input, pruned_h, atol=1e-5)
    assert not torch.allclose(stats_pass_input, dense_h, atol=1e-3)


def test_unstructured_and_other_patterns(tiny_dir, text_file, eval_file):
    r = prune(config(tiny_dir, text_file, eval_file, pattern=None, sparsity=0.7, eval_text=None), progress=False).report
    assert r["pattern"] == "unstructured-0.7" and r["nm_ok"] is None
    # per row, int(cols * 0.7) weights are pruned (Wanda's rounding): 44/64 and 89/128 here
    assert 0.6875 <= r["sparsity"] <= 0.7
    r = prune(config(tiny_dir, text_file, eval_file, pattern="1:4", eval_text=None, method="sparsegpt"), progress=False).report
    assert r["nm_ok"] and r["sparsity"] == pytest.approx(0.75, abs=1e-3)


class Crash(Exception):
    pass


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_killed_run_resumes_to_identical_checkpoint(method, tiny_dir, text_file, eval_file, tmp_path):
    cfg = config(tiny_dir, text_file, eval_file, method=method)
    full = tmp_path / "full"
    prune(cfg, out=full, progress=False)

    def crash_after_block_0(i):
        if i == 0:
            raise Crash

    part = tmp_path / "part"
    with pytest.raises(Crash):
        prune(cfg, out=part, progress=False, on_block_done=crash_after_block_0)
    assert not (part / "model.safetensors").exists()  # nothing final written by the killed run
    assert json.loads((part / ".resume" / "state.json").read_text())["next_block"] == 1
    with pytest.raises(UserError, match="--resume"):
        prune(cfg, out=part, progress=False)
    with pytest.raises(UserError, match="different settings"):
        prune(config(tiny_dir, text_file, eval_file, method=method, seed=1), out=part, resume=True, progress=False)
    resumed = prune(cfg, out=part, resume=True, progress=False)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.report["ppl"] == json.loads((full / "prune_report.json").read_text())["ppl"]


@pytest.mark.parametrize("arch", ["gpt2", "zamba2", "gemma3n_text", "llama4_text", "zaya"])
def test_resume_is_identical_for_conv1d_layers_and_per_window_block_arguments(arch, text_file, eval_file, tmp_path):
    """A resumed run reloads GPT-2's blocks from their checkpoint in Conv1D's layout, recaptures
    Zamba2's per-window embeddings for every window, keeps Gemma 3n's windows along their own dim
    of the hidden states (and refills the keys and values its pruned blocks hand on), finds Llama 4's stacked
    experts again by tracing, and refills what Zaya's pruned blocks return to the next: the same checkpoint
    and perplexities as one run."""
    from conftest import make_tokenizer, tiny_model

    src = tmp_path / arch
    tiny_model(arch).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    cfg = config(src, text_file, eval_file, method="sparsegpt")
    full, part = tmp_path / "full", tmp_path / "part"
    prune(cfg, out=full, progress=False)

    crash_at = 1 if arch == "gemma3n_text" else 0   # Gemma 3n: after the block that stores keys and values

    def crash(i):
        if i == crash_at:
            raise Crash

    with pytest.raises(Crash):
        prune(cfg, out=part, progress=False, on_block_done=crash)
    resumed = prune(cfg, out=part, resume=True, progress=False)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.report["ppl"] == json.loads((full / "prune_report.json").read_text())["ppl"]


def test_full_disk_is_one_line_and_resume_writes_the_checkpoint(tiny_dir, text_file, eval_file, tmp_path, monkeypatch):
    import errno

    from transformers import PreTrainedModel

    cfg = config(tiny_dir, text_file, eval_file)
    full = tmp_path / "full"
    prune(cfg, out=full, progress=False)

    def no_space(self, path, **kw):
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(PreTrainedModel, "save_pretrained", no_space)
        with pytest.raises(UserError, match="no space left .* --resume"):
            prune(cfg, out=out, progress=False)
    assert not (out / ".staging").exists() and not (out / "model.safetensors").exists()
    resumed = prune(cfg, out=out, resume=True, progress=False)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.report["ppl"] == json.loads((full / "prune_report.json").read_text())["ppl"]
    assert not (out / ".resume").exists()


def test_odd_widths_are_named_at_once_with_a_skip_that_fixes_them(text_file, eval_file, tmp_path):
    """A model whose every MLP has an input width M does not divide: one error counts them all and names a
    ``--skip`` glob that, given back, prunes the rest (it named the first layer alone, one rerun per block)."""
    from conftest import make_tokenizer, tiny_model

    odd = tmp_path / "odd"
    tiny_model("llama", inter=130).save_pretrained(odd)
    make_tokenizer().save_pretrained(odd)
    with pytest.raises(UserError) as err:
        prune(config(odd, text_file, eval_file), out=tmp_path / "out", progress=False)
    assert str(err.value) == ("3 layers have input widths not divisible by M=4 (e.g. model.layers.0.mlp.down_proj: "
                              "130 columns); skip them with --skip '*.mlp.down_proj' or choose another M")
    assert not (tmp_path / "out").exists()
    report = prune(config(odd, text_file, eval_file, skip=["*.mlp.down_proj"]), out=tmp_path / "out",
                   progress=False).report
    assert report["nm_ok"] and len(report["layers"]) == 3 * 6
    assert not any(l["name"].endswith("down_proj") for l in report["layers"])


def test_bad_inputs_leave_nothing_behind(tiny_dir, text_file, eval_file, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(UserError, match="does not exist"):
        prune(config(tiny_dir, tmp_path / "missing.txt", eval_file), out=out, progress=False)
    with pytest.raises(UserError, match="not divisible by M=3"):
        prune(config(tiny_dir, text_file, eval_file, pattern="2:3"), out=out, progress=False)
    with pytest.raises(UserError, match="nothing to resume"):
        prune(config(tiny_dir, text_file, eval_file), out=out, resume=True, progress=False)
    with pytest.raises(UserError, match="no linear layers selected"):
        prune(config(tiny_dir, text_file, eval_file, only=["*nothing*"]), out=out, progress=False)
    short = tmp_path / "short.txt"
    short.write_text("the of and to in a is that")
    with pytest.raises(UserError, match="has only 8 tokens"):
        prune(config(tiny_dir, short, eval_file), out=out, progress=False)
    assert not out.exists()


def test_skip_keeps_layers_dense(tiny_dir, text_file, eval_file):
    r = prune(config(tiny_dir, text_file, eval_file, skip=["*down_proj"], eval_text=None), progress=False)
    assert not any(l["name"].endswith("down_proj") for l in r.report["layers"])
    assert float((r.model.model.layers[0].mlp.down_proj.weight == 0).float().mean()) < 0.01


def test_linears_the_model_never_calls_stay_dense_with_a_warning(text_file, tmp_path):
    """Mamba reads ``dt_proj.weight`` directly (``dt_proj.weight @ x``) and never calls that layer, so no
    statistics reach it: it is left dense and named (warning, report), and every layer the model does
    call is pruned to 2:4."""
    from conftest import make_tokenizer, tiny_model

    src = tmp_path / "mamba"
    dense = tiny_model("mamba")
    dense.save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    with pytest.warns(UserWarning, match=r"3 linear layers stay dense: .*dt_proj"):
        result = prune(config(src, text_file, None, eval_text=None), out=tmp_path / "out", progress=False)
    names = [f"backbone.layers.{i}.mixer.dt_proj" for i in range(3)]
    assert result.report["not_called"] == names
    pruned = {l["name"] for l in result.report["layers"]}
    assert pruned == {f"backbone.layers.{i}.mixer.{p}" for i in range(3) for p in ("in_proj", "x_proj", "out_proj")}
    assert all(l["nm_ok"] for l in result.report["layers"])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name in names:
        assert torch.equal(reloaded.get_submodule(name).weight, dense.get_submodule(name).weight)
    assert set(result.report["outside_linears"]["names"]) >= set(names)


def test_a_weight_blocks_share_is_pruned_once(text_file, tmp_path):
    """Zamba2's hybrid blocks tie their transformer block's parameters: each shared weight is pruned
    once, in the first block that holds it (one report row, one mask), and is 2:4 wherever it is used."""
    from conftest import make_tokenizer, tiny_model

    src = tmp_path / "zamba2"
    tiny_model("zamba2").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    result = prune(config(src, text_file, None, eval_text=None), progress=False)
    names = [l["name"] for l in result.report["layers"]]
    shared = [n for n in names if ".shared_transformer." in n]
    assert shared and all(n.startswith("model.layers.1.") for n in shared) and len(names) == len(set(names))
    layers = result.model.model.layers
    for name in shared:
        sub = name[len("model.layers.1."):]
        assert layers[2].get_submodule(sub).weight is layers[1].get_submodule(sub).weight
        assert satisfies_nm(layers[2].get_submodule(sub).weight, 2, 4)


def test_gguf_cache_key_follows_contents_not_location(tmp_path):
    """Each virtualenv holds its own copy of the embedded GGUF: copies must share one converted dir
    (a path-keyed cache grew by a full fp32 model per venv), while any change to the file must not."""
    from shuffleprune.gguf import gguf_fingerprint

    body = bytearray(torch.randint(0, 256, (9 << 20,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    a, b = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "other-name.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(body)
    assert gguf_fingerprint(a) == gguf_fingerprint(b)
    for where in (10, len(body) - 10):  # header and tail both count
        changed = bytearray(body)
        changed[where] ^= 1
        b.write_bytes(changed)
        assert gguf_fingerprint(b) != gguf_fingerprint(a)
    b.write_bytes(body[:-1])
    assert gguf_fingerprint(b) != gguf_fingerprint(a)


def test_gguf_cache_entry_is_converted_again_under_another_transformers_major(tmp_path, monkeypatch):
    """A directory converted by transformers 5 names a tokenizer class transformers 4 lacks (and the
    cache is shared by virtualenvs): each major version converts, and then reuses, its own entry."""
    import transformers

    from shuffleprune import gguf as gguf_files

    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    converted = []

    def convert(path, out):
        converted.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_files, "convert_gguf", convert)
    for version in ("4.57.6", "5.0.0", "5.24.0", "4.56.1"):
        monkeypatch.setattr(transformers, "__version__", version)
        gguf_files.gguf_as_hf_dir(gguf)
    assert len(converted) == 2 and converted[0] != converted[1]
    assert [out.name.endswith(f"transformers{major}") for out, major in zip(converted, "45")] == [True, True]


def test_a_gguf_file_that_cannot_be_read_is_a_one_line_error(tmp_path, text_file, monkeypatch):
    """A file named .gguf that is not one (another format, a download saved as an error page) and a GGUF
    file cut short ended in the gguf reader's traceback; each is now one line naming the file and the fix,
    with no --out and no cache entry left behind."""
    from typer.testing import CliRunner

    from shuffleprune.cli import app

    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(tmp_path / "cache"))
    cases = {"page.gguf": (b"<html>404</html>", "is not a GGUF file (it does not begin with GGUF's magic bytes)"),
             "cut.gguf": (b"GGUF\x03\x00\x00\x00" + bytes(7), "as a model (unpack_from requires a buffer")}
    for name, (data, needle) in cases.items():
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"out-{name}"
        r = CliRunner().invoke(app, ["prune", str(tmp_path / name), "--calib", str(text_file), "--nsamples", "2",
                                     "--seqlen", "16", "--out", str(out), "--quiet"])
        lines = [l for l in r.output.splitlines() if l.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output
        assert str(tmp_path / name) in lines[0] and not out.exists()
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_dir() and p.name != "models"]


def test_a_transformers_older_than_the_tested_one_is_warned_about_once(tiny_dir, monkeypatch):
    """A pin elsewhere or a --no-deps install can leave a transformers older than pyproject's floor,
    where MoE experts are laid out differently: loading warns once with the upgrade, then loads."""
    import warnings

    import transformers

    from shuffleprune import models

    want = ".".join(map(str, models.MIN_TRANSFORMERS))
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"transformers>={want}"' in pyproject   # the floor pip enforces is the one warned about
    for version, warns in (("4.57.6", True), (f"{models.MIN_TRANSFORMERS[0]}.{models.MIN_TRANSFORMERS[1] - 1}.2", True),
                           (want + ".0", False), (want + ".0rc1", False), ("6.0.0.dev0", False)):
        monkeypatch.setattr(transformers, "__version__", version)
        models.warn_if_old_transformers.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            models.load_model(str(tiny_dir))
            models.load_model(str(tiny_dir))
        told = [w for w in caught if "shuffleprune is tested" in str(w.message)]
        assert len(told) == int(warns), (version, [str(w.message) for w in caught])
        if warns:
            assert f"transformers {version} is older" in str(told[0].message)
            assert f"pip install -U 'transformers>={want}'" in str(told[0].message)
    models.warn_if_old_transformers.cache_clear()


def test_models_load_with_transformers_own_modules_and_no_hub_kernels(tiny_dir, monkeypatch):
    """transformers ≥ 5.25 downloads the hub's kernels and swaps them into a model's layers unless asked not
    to: every model shuffleprune loads (to prune, evaluate or export it) asks not to, so nothing beyond the
    checkpoint is fetched and calibration sees the reference forward."""
    import transformers

    from shuffleprune import models

    asked, real = [], transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        asked.append(kwargs.get("use_kernels", "default"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    assert models.load_model(str(tiny_dir)).model is not None
    assert asked == [False]


def test_tf32_is_switched_on_for_cuda_only_and_restored():
    from shuffleprune.runtime.devices import tf32_matmuls

    before = torch.backends.cuda.matmul.allow_tf32
    with tf32_matmuls(torch.device("cpu"), True) as on:
        assert not on and torch.backends.cuda.matmul.allow_tf32 == before
    with pytest.raises(RuntimeError):
        with tf32_matmuls(torch.device("cuda"), True) as on:  # only flags: needs no GPU
            assert on and torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
            raise RuntimeError("a failing run")
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.parametrize("recipe", ["paper", "learned"])
def test_deterministic_runs_every_stage_strictly_and_resumes_across_the_setting(recipe, tiny_dir, text_file, eval_file,
                                                                                tmp_path):
    """``--deterministic`` runs the learned permutations' backward (block and whole-model) under PyTorch's
    strict deterministic algorithms, with no op that lacks one, and says so in the report; on the CPU, where
    runs repeat without it, the checkpoint is the one a plain run writes. It is not part of the run's key:
    an interrupted run may resume with it on or off, as on another device."""
    from typer.testing import CliRunner

    from shuffleprune.cli import app

    options = dict(model=str(tiny_dir), calib=str(text_file), eval_text=str(eval_file), nsamples=4, seqlen=32,
                   batch_size=4, perm_steps=3)
    plain = PruneConfig.build(recipe, **options)
    prune(plain, out=tmp_path / "plain", progress=False)
    args = ["prune", str(tiny_dir), "--recipe", recipe, "--calib", str(text_file), "--eval-text", str(eval_file),
            "--nsamples", "4", "--seqlen", "32", "--batch-size", "4", "--perm-steps", "3", "--quiet"]
    res = CliRunner().invoke(app, [*args, "--deterministic", "--out", str(tmp_path / "det")])
    assert res.exit_code == 0, res.output
    assert not torch.are_deterministic_algorithms_enabled()   # given back
    det = json.loads((tmp_path / "det" / "prune_report.json").read_text())
    before = json.loads((tmp_path / "plain" / "prune_report.json").read_text())
    assert det["deterministic_algorithms"] is True and before["deterministic_algorithms"] is False
    assert det["config"]["deterministic"] is True and det["ppl"] == before["ppl"]
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "det" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert PruneConfig.build(recipe, **options, deterministic=True).key() == plain.key()


def test_an_op_without_a_deterministic_form_stops_a_deterministic_run_and_resume_continues_without_it(
        tiny_dir, text_file, eval_file, tmp_path):
    """An op with no deterministic form met after block 0 (on a GPU: a float cumsum, say) ends a
    ``--deterministic`` run with one line naming the op, the flag to drop and ``--resume``; resumed without
    the flag, the run keeps block 0 and writes the checkpoint a plain run writes."""
    cfg = config(tiny_dir, text_file, eval_file, method="wanda")
    prune(cfg, out=tmp_path / "plain", progress=False)

    def nondeterministic_op(i):
        if i == 0:
            torch.zeros(2).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))   # no deterministic form

    strict = config(tiny_dir, text_file, eval_file, method="wanda", deterministic=True)
    part = tmp_path / "part"
    with pytest.raises(UserError, match=r"^put_ has no deterministic implementation .*; run without --deterministic "
                                        r"and with --resume, which continues from the last finished block$"):
        prune(strict, out=part, progress=False, on_block_done=nondeterministic_op)
    assert not torch.are_deterministic_algorithms_enabled()
    assert json.loads((part / ".resume" / "state.json").read_text())["next_block"] == 1
    prune(cfg, out=part, resume=True, progress=False)
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(part / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_model_too_large_for_the_device_is_scored_block_by_block(tiny_dir, text_file, eval_file, tmp_path, monkeypatch):
    """When the model does not fit the device whole, prune's and eval's perplexities are measured
    one block at a time on it, and equal the whole model's; eval's lm-eval tasks, which need the
    whole model there, are refused with the fix. (Forced here: on the CPU everything fits.)"""
    from typer.testing import CliRunner

    import shuffleprune.evaluation.evaluate as evaluate
    import shuffleprune.prune.driver as driver
    from shuffleprune.cli import app

    cfg = config(tiny_dir, text_file, eval_file, method="wanda")
    report = prune(cfg, progress=False).report
    whole = report["ppl"]
    assert report["eval"]["block_by_block"] is False
    calls = []
    monkeypatch.setattr(driver, "fits_on_device", lambda *a, **k: calls.append(1) or False)
    monkeypatch.setattr(evaluate, "fits_on_device", lambda *a, **k: calls.append(1) or False)
    report = prune(cfg, out=tmp_path / "pruned", progress=False).report
    blockwise = report["ppl"]
    assert report["eval"]["block_by_block"] is True  # the report says how it was scored
    assert len(calls) == 2 and blockwise["dense"] == pytest.approx(whole["dense"], rel=1e-5)
    assert blockwise["pruned"] == pytest.approx(whole["pruned"], rel=1e-5)
    runner = CliRunner()
    args = ["eval", str(tmp_path / "pruned"), "--ppl-text", str(eval_file), "--ppl-ctx", "32", "--quiet"]
    res = runner.invoke(app, [*args, "--tasks", "ppl", "--out", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert "one block at a time" in res.output
    assert json.loads((tmp_path / "r.json").read_text())["models"][0]["ppl"] == pytest.approx(whole["pruned"], rel=1e-5)
    res = runner.invoke(app, [*args, "--tasks", "arc_easy", "--out", str(tmp_path / "r2.json")])
    assert res.exit_code == 2 and "--device cpu" in res.output and not (tmp_path / "r2.json").exists()


def test_fits_on_device_weighs_the_model_and_its_logits_against_free_memory(monkeypatch):
    """On CUDA a model fits when its bytes not yet on the device, a window's logits and 1 GiB fit in
    the free memory (the free memory is faked here); on the CPU it always fits."""
    from conftest import tiny_model
    from shuffleprune.runtime.memory import fits_on_device, logits_bytes

    model = tiny_model("llama")
    size = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    work = logits_bytes(model, 512)
    assert work == 512 * 128 * 10
    assert logits_bytes(tiny_model("gemma3"), 512) == work   # multimodal: the vocabulary is the text decoder's
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for free, fits in ((size + work + 2**30, True), (size + work + 2**30 - 1, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 80 * 2**30))
        assert fits_on_device(model, cuda, work) is fits
    assert fits_on_device(model, torch.device("cpu"), 10**15)
    # weights already on the device ("cuda" meaning the current one, cuda:0 here) need no room again
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (work + 2**30, 80 * 2**30))
    on_gpu = [SimpleNamespace(device=torch.device("cuda", 0), numel=p.numel, element_size=p.element_size)
              for p in model.parameters()]
    resident = SimpleNamespace(parameters=lambda: on_gpu, buffers=lambda: [])
    assert fits_on_device(resident, cuda, work) and not fits_on_device(model, cuda, work)


def test_learned_maps_and_block_fits_run_on_blocks_taking_windows_along_another_dim(text_file, eval_file, tmp_path):
    """Gemma 3n (hidden states ``[altup, batch, L, d]``) with learned index maps (the block's own forward
    on minibatches of windows) and blockrecon against the dense model's outputs: every pruned layer
    N:M in its map's order, the fit lowers each block's held-out error, and the export reloads to the
    pruned logits."""
    import shuffleprune
    from conftest import make_tokenizer, tiny_model
    from shuffleprune.deploy.export import export_checkpoint
    from shuffleprune.prune import PruneConfig

    src = tmp_path / "gemma3n"
    tiny_model("gemma3n_text").save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    cfg = PruneConfig.build("best", model=str(src), calib=str(text_file), eval_text=str(eval_file), nsamples=4,
                            seqlen=32, batch_size=2, pattern="2:4", perm="learned", perm_steps=3, perm_block=16,
                            seed=0, overrides=["update.steps=6", "update.check_every=2"])
    result = prune(cfg, out=tmp_path / "out", progress=False)
    report = result.report
    assert report["nm_ok"] is True and len(report["layers"]) == 3 * (14 - 3) - 2   # LAuReL; no k/v where reused
    assert len(report["gating_linears"]) == 3 * 3   # AltUp's router and coefficient layers stay dense
    fits = [b["blockrecon"] for b in report["stage_blocks"] if "blockrecon" in b]
    assert len(fits) == 3 and all(f["held_out_after"] <= f["held_out_before"] for f in fits)
    assert any(f["held_out_after"] < f["held_out_before"] for f in fits)
    export_checkpoint(tmp_path / "out", tmp_path / "exported")
    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits
        torch.testing.assert_close(shuffleprune.load(str(tmp_path / "exported"))(ids).logits, want, rtol=0, atol=1e-4)


def test_the_python_api_prunes_a_name_or_a_model_in_memory_call_after_call(tiny_dir, text_file, tmp_path):
    import shuffleprune
    from transformers import AutoTokenizer

    kw = dict(calib=str(text_file), nsamples=4, seqlen=32, eval_text=None, progress=False)
    by_name = shuffleprune.prune(str(tiny_dir), "fast", **kw)  # the package shuffleprune.prune takes the call
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    in_memory = shuffleprune.prune(model, "fast", tmp_path / "out", tokenizer=AutoTokenizer.from_pretrained(tiny_dir), **kw)
    assert in_memory.model is model and by_name.report["nm_ok"] and in_memory.report["nm_ok"]  # pruned in place
    assert all(torch.equal(a, b) for a, b in zip(by_name.model.state_dict().values(), model.state_dict().values()))
    assert json.loads((tmp_path / "out" / "prune_report.json").read_text())["model"] == str(tiny_dir)
    assert "base_model:" not in (tmp_path / "out" / "README.md").read_text()  # a local path is no hub id
    from shuffleprune import prune as api

    assert api is shuffleprune.prune and api.PruneConfig is not None  # one object, function and package
    from inspect import signature

    assert list(signature(api).parameters)[:4] == ["model", "recipe", "out", "tokenizer"]  # what IDEs show
    assert all(callable(getattr(shuffleprune, name)) for name in ("load", "export", "evaluate", "DynamicSparsifier"))
    for call, needle in ((lambda: api(model, "fast"), "needs its tokenizer"),
                         (lambda: api(str(tiny_dir), tokenizer=object()), "goes with a model object"),
                         (lambda: api(3), "not int"),
                         (lambda: api(model.model, tokenizer=object()), "LlamaModel has no LM head")):
        with pytest.raises(TypeError, match=needle):
            call()


def test_model_cards_name_a_base_model_only_by_a_hub_id(tmp_path):
    from shuffleprune.models import EMBEDDED_HUB_ID, base_model_id

    assert base_model_id("meta-llama/Llama-2-7b-hf") == "meta-llama/Llama-2-7b-hf"
    assert base_model_id("embedded:SmolLM2-135M-Instruct") == EMBEDDED_HUB_ID
    for local in ("in-memory LlamaForCausalLM", str(tmp_path), "./dir", "a/b/c"):
        assert base_model_id(local) is None, local
