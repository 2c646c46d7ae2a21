"""A caller's model loaded with a ``device_map`` (accelerate's dispatch, a block offloaded to disk): pruned
in place and scored as it is placed, like the same model loaded whole."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import shuffleprune
from shuffleprune.errors import UserError
from shuffleprune.placement import is_dispatched


def _offloaded(path, tmp_path):
    """The tiny LLaMA with its middle block offloaded to disk (its weights on the meta device)."""
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=tmp_path / "offload")
    assert is_dispatched(model) and model.model.layers[1].mlp.down_proj.weight.device.type == "meta"
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_dispatched_model_is_pruned_in_place_and_dispatched_again(tiny_dir, text_file, eval_file, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model, whole = _offloaded(tiny_dir, tmp_path), AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(model, ids), _logits(whole, ids), rtol=0, atol=0)
    kw = dict(calib=str(text_file), eval_text=str(eval_file), eval_tokens=2000, nsamples=4, seqlen=32, progress=False)
    result = shuffleprune.prune(model, "fast", tmp_path / "out", tokenizer=tokenizer, **kw)
    want = shuffleprune.prune(whole, "fast", tokenizer=tokenizer, **kw)
    assert result.model is model and result.report["nm_ok"]
    assert result.report["eval"] == want.report["eval"] and result.report["ppl"] == want.report["ppl"]
    assert model.hf_device_map["model.layers.1"] == "cpu"   # the disk's part now offloaded to CPU memory
    assert all(p.device.type == "cpu" for p in model.parameters())
    torch.testing.assert_close(_logits(model, ids), _logits(whole, ids), rtol=0, atol=0)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(_logits(saved, ids), _logits(whole, ids), rtol=0, atol=0)


def test_a_failed_run_leaves_a_dispatched_model_usable(tiny_dir, text_file, tmp_path):
    model = _offloaded(tiny_dir, tmp_path)
    ids = torch.randint(2, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    with pytest.raises(UserError, match="no linear layers selected"):
        shuffleprune.prune(model, "fast", tokenizer=AutoTokenizer.from_pretrained(tiny_dir), calib=str(text_file),
                           only=["nothing.*"], progress=False)
    assert set(model.hf_device_map) == {"model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
                                        "model.norm", "model.rotary_emb", "lm_head"}   # dispatched by its map again
    torch.testing.assert_close(_logits(model, ids), before, rtol=0, atol=0)


def test_a_dispatched_model_is_scored_where_it_is(tiny_dir, eval_file, tmp_path):
    tokenizer, whole = AutoTokenizer.from_pretrained(tiny_dir), AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        whole.model.layers[1].mlp.up_proj.weight[:, ::2] = 0   # zeros in the block to offload
    whole.save_pretrained(tmp_path / "zeroed")
    model = _offloaded(tmp_path / "zeroed", tmp_path)
    rows = shuffleprune.evaluate([model, whole], tokenizer=tokenizer, tasks="ppl", ppl_text=str(eval_file),
                                 progress=False)["models"]
    assert rows[0]["ppl"] == rows[1]["ppl"] and rows[0]["sparsity"] == rows[1]["sparsity"] > 0
    assert is_dispatched(model) and model.model.layers[1].mlp.up_proj.weight.device.type == "meta"   # left as it was


def test_a_model_in_training_mode_is_pruned_and_scored_without_dropout_and_given_back_as_it_was(text_file, eval_file):
    from conftest import make_tokenizer, tiny_model

    tokenizer = make_tokenizer()
    kw = dict(calib=str(text_file), eval_text=str(eval_file), eval_tokens=2000, nsamples=4, seqlen=32, progress=False)
    results = []
    for training in (False, True):
        model = tiny_model("gpt2").to(torch.bfloat16).train(training)   # dropout 0.1, a half-precision weight
        assert model.config.resid_pdrop > 0
        score = shuffleprune.evaluate(model, tokenizer=tokenizer, tasks="ppl", ppl_text=str(eval_file), progress=False)
        assert model.training is training and model.dtype == torch.bfloat16   # upcast on the CPU for the time
        result = shuffleprune.prune(model, "fast", tokenizer=tokenizer, **kw)
        assert model.training is training and {p.dtype for p in model.parameters()} == {torch.bfloat16}
        results.append((score["models"][0]["ppl"], result.report["ppl"], model.state_dict()))
    (score, ppl, weights), (score_t, ppl_t, weights_t) = results
    assert score_t == score and ppl_t == ppl
    assert all(torch.equal(weights[k], weights_t[k]) for k in weights)


def test_a_compiled_model_is_pruned_as_the_model_it_wraps_and_a_peft_model_is_refused(text_file):
    from conftest import make_tokenizer, tiny_model

    model = tiny_model("llama")
    compiled = torch.compile(model)   # nothing is compiled before a call
    result = shuffleprune.prune(compiled, "fast", tokenizer=make_tokenizer(), calib=str(text_file), nsamples=4,
                                seqlen=32, eval_text=None, progress=False)
    assert result.model is model and result.report["nm_ok"]
    assert (model.model.layers[0].mlp.up_proj.weight == 0).float().mean() == 0.5

    class PeftModelForCausalLM(torch.nn.Module):   # peft's wrapper, by its name (peft is not a dependency)
        pass

    with pytest.raises(TypeError, match=r"^model is a PEFT PeftModelForCausalLM: merge its adapters first "
                                        r"\(model\.merge_and_unload\(\)\)"):
        shuffleprune.prune(PeftModelForCausalLM(), tokenizer=make_tokenizer())
