"""Models that ship their own code (``auto_map`` in config.json, transformers' ``trust_remote_code``): refused
with a one-line error naming ``--trust-remote-code``, and with it pruned, exported, loaded and scored."""
import json
from pathlib import Path

import pytest
import torch
from conftest import make_tokenizer, tiny_config
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from typer.testing import CliRunner

import shuffleprune
from shuffleprune.cli import app
from shuffleprune.errors import UserError

runner = CliRunner()

CONFIG_CODE = '''from transformers import LlamaConfig


class ShippedConfig(LlamaConfig):
    model_type = "shipped_llama"
'''
MODEL_CODE = '''from transformers import LlamaForCausalLM

from .configuration_shipped import ShippedConfig


class ShippedForCausalLM(LlamaForCausalLM):
    """A model type transformers does not know, in code the checkpoint ships."""
    config_class = ShippedConfig
'''


@pytest.fixture
def shipped_dir(tmp_path: Path) -> Path:
    """A tiny LLaMA saved under a model type of its own, whose classes are code in the checkpoint (auto_map)."""
    path = tmp_path / "shipped-model"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama")).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    (path / "configuration_shipped.py").write_text(CONFIG_CODE)
    (path / "modeling_shipped.py").write_text(MODEL_CODE)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="shipped_llama", architectures=["ShippedForCausalLM"],
                  auto_map={"AutoConfig": "configuration_shipped.ShippedConfig",
                            "AutoModelForCausalLM": "modeling_shipped.ShippedForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_a_model_that_ships_its_code_runs_only_with_trust_remote_code(shipped_dir, text_file, eval_file, tiny_task,
                                                                      tmp_path):
    """Without ``--trust-remote-code`` prune, export, eval and ``shuffleprune.load`` refuse the model in one line
    naming the flag, and write nothing (transformers would ask at a prompt, or fail naming its Python argument).
    With it, the pruned checkpoint keeps the model's code (it loads as that class), its card names the flag, the
    export keeps the code too and loads, through shuffleprune and through transformers, as the pruned model
    (same logits), and eval scores it with an lm_eval command that trusts it."""
    out, deployed = tmp_path / "pruned", tmp_path / "deployed"
    common = [str(shipped_dir), "--recipe", "fast", "--calib", str(text_file), "--eval-text", str(eval_file),
              "--nsamples", "4", "--seqlen", "32", "--quiet", "--out", str(out)]
    res = runner.invoke(app, ["prune", *common])
    assert res.exit_code == 2 and not out.exists(), res.output
    assert res.output.strip().splitlines() == [
        f"error: '{shipped_dir}' ships its own model code (an auto_map in its config files), which runs only when you "
        "trust it: pass --trust-remote-code (Python: trust_remote_code=True)"]

    res = runner.invoke(app, ["prune", *common, "--trust-remote-code"])
    assert res.exit_code == 0, res.output
    assert {"configuration_shipped.py", "modeling_shipped.py"} <= {p.name for p in out.iterdir()}
    pruned = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(pruned).__name__ == "ShippedForCausalLM"
    card = (out / "README.md").read_text()
    assert 'from_pretrained("PATH", trust_remote_code=True)' in card and "--trust-remote-code --out OUT" in card
    assert "trust_remote_code" not in (out / "recipe.yaml").read_text()   # a recipe file never turns it on

    res = runner.invoke(app, ["export", str(out), str(deployed), "--quiet"])
    assert res.exit_code == 2 and "--trust-remote-code" in res.output and not deployed.exists(), res.output
    res = runner.invoke(app, ["export", str(out), str(deployed), "--quiet", "--trust-remote-code"])
    assert res.exit_code == 0, res.output
    fmt = json.loads((deployed / "shuffleprune_format.json").read_text())
    assert fmt["model_class"] == "modeling_shipped.ShippedForCausalLM"
    card = (deployed / "README.md").read_text()
    assert 'shuffleprune.load("PATH", device="cuda", trust_remote_code=True)' in card
    assert "shuffleprune eval PATH --tasks ppl,arc_easy,hellaswag --trust-remote-code" in card
    assert json.loads((deployed / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "configuration_shipped.ShippedConfig", "AutoModelForCausalLM": "shuffleprune_hf.ShufflepruneForCausalLM"}

    with pytest.raises(UserError, match="--trust-remote-code"):
        shuffleprune.load(str(deployed))
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    want = _logits(pruned, tokens)
    loaded = shuffleprune.load(str(deployed), trust_remote_code=True)
    assert type(loaded).__name__ == "ShippedForCausalLM"
    assert torch.allclose(_logits(loaded, tokens), want, atol=1e-5)
    via_transformers = AutoModelForCausalLM.from_pretrained(deployed, trust_remote_code=True)
    assert torch.allclose(_logits(via_transformers, tokens), want, atol=1e-5)

    results = tmp_path / "eval.json"
    scoring = ["eval", str(out), "--tasks", "tiny_mc,ppl", "--include-path", str(tiny_task), "--limit", "4",
               "--ppl-text", str(eval_file), "--ppl-ctx", "32", "--quiet", "--out", str(results)]
    res = runner.invoke(app, scoring)
    assert res.exit_code == 2 and "--trust-remote-code" in res.output and not results.exists(), res.output
    res = runner.invoke(app, [*scoring, "--trust-remote-code"])
    assert res.exit_code == 0, res.output
    row = json.loads(results.read_text())["models"][0]
    report = json.loads((out / "prune_report.json").read_text())
    assert row["ppl"] == pytest.approx(report["ppl"]["pruned"], rel=1e-4)
    assert f"pretrained={out},dtype=float32,trust_remote_code=True " in row["lm_eval_cli"]


def _ship_tokenizer_code(path: Path) -> None:
    """Make the tokenizer in ``path`` a class of its own, in code it ships (``auto_map`` in tokenizer_config.json)."""
    (path / "tokenization_shipped.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass ShippedTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="ShippedTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_shipped.ShippedTokenizer"]})
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_dst_trains_an_architecture_that_ships_its_code_only_with_trust_remote_code(shipped_dir, text_file, tmp_path):
    """``dst --arch DIR`` whose configuration and model classes are code the checkpoint ships (and a tokenizer
    whose class is too): refused in one line naming ``--trust-remote-code``, nothing written; with it, a model of
    that class is trained, saved with its code and a card that names the flag, and exported and loaded back to the
    trained model's logits."""
    from shuffleprune.dst.fresh_model import training_tokenizer

    _ship_tokenizer_code(shipped_dir)
    out = tmp_path / "run"
    common = ["dst", "--arch", str(shipped_dir), "--config-kw", "num_hidden_layers=2", "--tokenizer", str(shipped_dir),
              "--data", str(text_file), "--method", "nm", "--seq-len", "32", "--batch-size", "2", "--steps", "4",
              "--warmup", "1", "--delta-t", "2", "--eval-every", "0", "--eval-tokens", "256", "--checkpoint-every", "0",
              "--quiet", "--out", str(out)]
    res = runner.invoke(app, common)
    assert res.exit_code == 2 and not out.exists(), res.output
    assert res.output.strip().splitlines() == [
        f"error: '{shipped_dir}' ships its own model code (an auto_map in its config files), which runs only when you "
        "trust it: pass --trust-remote-code (Python: trust_remote_code=True)"]
    with pytest.raises(UserError, match="ships its own model code .* pass --trust-remote-code"):   # its tokenizer too
        training_tokenizer(str(shipped_dir), ["the of and"])
    assert type(training_tokenizer(str(shipped_dir), ["the of and"], trust_remote_code=True)).__name__ == "ShippedTokenizer"

    res = runner.invoke(app, [*common, "--trust-remote-code"])
    assert res.exit_code == 0, res.output
    model_dir, deployed = out / "model", tmp_path / "deployed"
    assert {"configuration_shipped.py", "modeling_shipped.py"} <= {p.name for p in model_dir.iterdir()}
    trained = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    assert type(trained).__name__ == "ShippedForCausalLM" and trained.config.num_hidden_layers == 2
    card = (model_dir / "README.md").read_text()
    assert 'from_pretrained("PATH", trust_remote_code=True)' in card
    assert "`shuffleprune export PATH DEPLOYED --trust-remote-code`" in card

    res = runner.invoke(app, ["export", str(model_dir), str(deployed), "--quiet", "--trust-remote-code"])
    assert res.exit_code == 0, res.output
    tokens = torch.randint(0, trained.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    loaded = shuffleprune.load(str(deployed), trust_remote_code=True)
    assert type(loaded).__name__ == "ShippedForCausalLM"
    assert torch.allclose(_logits(loaded, tokens), _logits(trained, tokens), atol=1e-5)
