"""``shuffleprune finetune``: a pruned checkpoint's kept weights trained with its zeros held, through the dst trainer."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import shuffleprune
from conftest import make_tokenizer, tiny_model
from shuffleprune.cli import app
from shuffleprune.errors import UserError
from shuffleprune.prune import PruneConfig, prune

runner = CliRunner()
SMALL = dict(steps=8, lr=3e-3, warmup=1, seq_len=32, batch_size=4, eval_every=4, eval_tokens=512, checkpoint_every=4,
             progress=False)


@pytest.fixture
def pruned_bf16(tmp_path, text_file):
    """A tiny LLaMA saved in bfloat16, pruned to 2:4 by the `fast` recipe (Wanda, searched index maps)."""
    source = tmp_path / "bf16"
    tiny_model("llama").to(torch.bfloat16).save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    out = tmp_path / "pruned"
    prune(PruneConfig.build("fast", model=str(source), calib=str(text_file), nsamples=4, seqlen=32, eval_text=None),
          out=out, progress=False)
    return out


def test_finetune_holds_the_zeros_keeps_the_dtype_and_maps_and_exports_exactly(pruned_bf16, eval_file, text_file,
                                                                              tmp_path, capfd):
    capfd.readouterr()
    report = shuffleprune.finetune(pruned_bf16, tmp_path / "run", data=str(eval_file), **SMALL)   # not its calibration
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s]" not in err, err   # progress=False: the start loads without a bar
    tuned = tmp_path / "run" / "model"
    before, after = load_file(str(pruned_bf16 / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    pruned = [k for k in before if ".layers." in k and before[k].dim() == 2]
    assert len(pruned) == 3 * 7 and all((before[k] == 0).float().mean() == 0.5 for k in pruned)
    assert all(not after[k][before[k] == 0].any() for k in pruned)           # every zero stays zero
    assert all(not torch.equal(before[k], after[k]) for k in pruned)         # and learned
    assert all(after[k].dtype == torch.bfloat16 for k in after)              # saved as the checkpoint was
    assert {"prune_report.json", "index_maps.safetensors", "recipe.yaml"} <= {p.name for p in tuned.iterdir()}
    assert report["carried"] == ["prune_report.json", "index_maps.safetensors", "recipe.yaml"]
    evals = report["evals"]   # the pruned checkpoint's own perplexity first, then every 4 steps
    assert [e["step"] for e in evals] == [0, 4, 8] and evals[-1]["ppl"] == report["final_ppl"] < evals[0]["ppl"]
    assert report["density"] == pytest.approx(0.5) and report["dst"]["method"] == "keep"
    assert json.loads((tmp_path / "run" / "dst_report.json").read_text())["carried"] == report["carried"]
    card = (tuned / "README.md").read_text()
    assert f"The pruned checkpoint `{pruned_bf16}` fine-tuned" in card and "shuffleprune export PATH DEPLOYED" in card
    assert f"{evals[0]['ppl']:.2f} → {report['final_ppl']:.2f}" in card
    # the report it carries says 2:4: export needs no --pattern, and computes the fine-tuned model
    fmt = shuffleprune.export(tuned, tmp_path / "deployed", progress=False)
    assert fmt["pattern"] == "2:4"
    ids = torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        torch.testing.assert_close(shuffleprune.load(str(tmp_path / "deployed"))(ids).logits,
                                   AutoModelForCausalLM.from_pretrained(tuned).eval()(ids).logits, rtol=0, atol=2e-2)
    # eval's row says it was fine-tuned, and warns that the fine-tuning text is not held out for it
    from shuffleprune.evaluation.config import EvalConfig
    from shuffleprune.evaluation.evaluate import evaluate_models

    said = []
    scores = evaluate_models(EvalConfig(models=[str(tuned)], tasks=["ppl"], ppl_text=str(eval_file), ppl_ctx=32,
                                        ppl_tokens=512), progress=False, notify=said.append)
    assert scores["models"][0]["pruned"] == "wanda 2:4, search perm + finetune 8 steps" and scores["models"][0]["model"] == "run/model"
    assert any(f"was calibrated or trained on '{eval_file}'" in m for m in said), said
    assert scores["models"][0]["fitted_on"] == {   # both runs that made it, in the results file
        "calibration": {"source": str(text_file), "nsamples": 4, "seqlen": 32, "seed": 0},
        "training": {"data": str(eval_file), "steps": 8, "batch_size": 4, "seq_len": 32, "lr": 3e-3, "seed": 0}}


def test_finetune_resumes_to_the_uninterrupted_run(pruned_bf16, text_file, tmp_path):
    from shuffleprune.dst.config import DSTConfig, TrainConfig
    from shuffleprune.dst.train import train

    start = str(pruned_bf16)
    cfg = TrainConfig(arch=start, tokenizer=start, init=start, data=str(text_file), steps=8, lr=3e-3, warmup=1,
                      seq_len=32, batch_size=4, eval_every=4, eval_tokens=512, checkpoint_every=2)
    full = train(cfg, DSTConfig(method="keep"), tmp_path / "full", progress=False)
    assert train(cfg, DSTConfig(method="keep"), tmp_path / "killed", progress=False, stop_after=5) == {"stopped_at": 5}
    resumed = train(cfg, DSTConfig(method="keep"), tmp_path / "killed", resume=True, progress=False)
    assert [r["loss"] for r in resumed["loss_curve"]] == [r["loss"] for r in full["loss_curve"]]
    assert resumed["evals"] == full["evals"]   # the start's perplexity is not measured again
    a = load_file(str(tmp_path / "full" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_finetune_refuses_what_it_cannot_fine_tune_before_writing(tiny_dir, pruned_bf16, text_file, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(UserError, match=f"'{tiny_dir}' has no zeros in its linear layers to hold: prune it first"):
        shuffleprune.finetune(tiny_dir, out, data=str(text_file), **SMALL)
    shuffleprune.export(pruned_bf16, tmp_path / "deployed", progress=False)
    with pytest.raises(UserError, match="is an export .*; fine-tune the pruned checkpoint it was exported from"):
        shuffleprune.finetune(tmp_path / "deployed", out, data=str(text_file), **SMALL)
    with pytest.raises(UserError, match="does not exist"):
        shuffleprune.finetune(tmp_path / "missing", out, data=str(text_file), **SMALL)
    with pytest.raises(UserError, match="clearing it would delete that input"):   # --out onto the checkpoint it reads
        shuffleprune.finetune(pruned_bf16, pruned_bf16, data=str(text_file), overwrite=True, **SMALL)
    from shuffleprune.dst.config import DSTConfig, TrainConfig
    from shuffleprune.dst.train import train

    start = str(pruned_bf16)
    with pytest.raises(UserError, match="fine-tuned with method 'keep', which holds its zeros, not 'rigl'"):
        train(TrainConfig(arch=start, tokenizer=start, init=start, data=str(text_file)), DSTConfig(method="rigl"), out)
    assert not out.exists() and (pruned_bf16 / "model.safetensors").is_file()


def test_finetune_cli_prints_the_gain_and_refuses_bad_input_in_one_line(pruned_bf16, text_file, tmp_path):
    args = ["finetune", str(pruned_bf16), "--data", str(text_file), "--steps", "4", "--lr", "3e-3", "--warmup", "1",
            "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "512", "--quiet"]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "run" / "dst_report.json").read_text())
    assert f"ppl {report['evals'][0]['ppl']:.2f} → {report['final_ppl']:.2f}" in res.output
    assert f"wrote {tmp_path / 'run' / 'model'}" in res.output
    res = runner.invoke(app, ["report", str(tmp_path / "run")])   # the run's line again, said as a fine-tune
    assert res.exit_code == 0 and (f"finetune of {pruned_bf16}: ppl {report['evals'][0]['ppl']:.2f} → "
                                   f"{report['final_ppl']:.2f}, density 0.5000 held") in res.output, res.output
    for extra, needle in ((["--steps", "0"], "--steps must be >= 1"), (["--seq-len", "4"], "--seq-len must be >= 8"),
                          (["--lr", "0"], "--lr must be > 0"),
                          (["--eval-every", "-1"], "--eval-every must be >= 0 (0: only before the first step and at the end)")):
        res = runner.invoke(app, [*args, *extra, "--out", str(tmp_path / "bad")])
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output
        assert not (tmp_path / "bad").exists()
