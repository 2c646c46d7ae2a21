"""``shuffleprune eval``: lm-eval on in-memory models, results files, errors, offline task data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import random_text
from shuffleprune.cli import app
from shuffleprune.errors import UserError
from shuffleprune.evaluation.config import EvalConfig
from shuffleprune.evaluation.evaluate import evaluate_models
from shuffleprune.models import load_model

runner = CliRunner()


def _reference_accuracy(model, tokenizer, task_dir: Path) -> float:
    """argmax over choices of sum log p(choice | question), computed here without lm-eval."""
    hits = []
    for line in (task_dir / "tiny_mc.jsonl").read_text().splitlines():
        doc = json.loads(line)
        ctx = tokenizer(doc["question"])["input_ids"]
        scores = []
        for choice in doc["choices"]:
            ids = tokenizer(doc["question"] + " " + choice)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            scores.append(sum(float(logp[t - 1, ids[t]]) for t in range(len(ctx), len(ids))))
        hits.append(max(range(len(scores)), key=scores.__getitem__) == doc["gold"])
    return sum(hits) / len(hits)


def test_eval_scores_the_in_memory_model(tiny_dir, tiny_task, tmp_path, monkeypatch):
    lm = load_model(str(tiny_dir))
    with torch.no_grad():  # make the in-memory model differ from the checkpoint on disk
        for p in lm.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    calls = []
    lm.model.register_forward_hook(lambda *_: calls.append(1))
    import transformers

    def no_reload(*a, **k):
        raise AssertionError("eval reloaded the model instead of using the in-memory one")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_reload)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(random_text(2000, seed=3))
    config = EvalConfig(models=[str(tiny_dir)], tasks=["tiny_mc", "ppl"], include_path=[str(tiny_task)],
                        ppl_text=str(heldout), ppl_ctx=32, batch_size=4)
    res = evaluate_models(config, out=tmp_path / "r.json", progress=False, loaded={str(tiny_dir): lm})
    assert calls, "lm-eval never called the in-memory model"
    row = res["models"][0]
    assert row["results"]["tiny_mc"]["value"] == pytest.approx(_reference_accuracy(lm.model, lm.tokenizer, tiny_task))
    from shuffleprune.calib import eval_tokens, get_source
    from shuffleprune.evaluation.perplexity import perplexity

    assert row["ppl"] == pytest.approx(perplexity(lm.model, eval_tokens(get_source(str(heldout)), lm.tokenizer), 32))


def test_apply_chat_template_reaches_lm_eval_and_its_recorded_command(tiny_dir, tiny_task, tmp_path, monkeypatch):
    """``--apply-chat-template`` (instruct models): every lm-eval item goes through the tokenizer's chat
    template, the results and the equivalent ``lm_eval`` command say so; a model without a template is a
    one-line error naming the flag, found before any model is scored."""
    from lm_eval.models.huggingface import HFLM

    rendered = []
    real = HFLM.apply_chat_template

    def spy(self, chat_history, *args, **kwargs):
        rendered.append(chat_history)
        return real(self, chat_history, *args, **kwargs)

    monkeypatch.setattr(HFLM, "apply_chat_template", spy)
    lm = load_model(str(tiny_dir))
    config = EvalConfig(models=[str(tiny_dir)], tasks=["tiny_mc"], include_path=[str(tiny_task)], limit=4)
    plain = evaluate_models(config, progress=False, loaded={str(tiny_dir): lm})
    assert not rendered and "--apply_chat_template" not in plain["models"][0]["lm_eval_cli"]
    with pytest.raises(UserError, match="has no chat template .* drop --apply-chat-template"):
        evaluate_models(EvalConfig(**{**config.__dict__, "apply_chat_template": True}), progress=False,
                        loaded={str(tiny_dir): lm})
    lm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} the {% endfor %}"
    scored = []
    with monkeypatch.context() as patched, pytest.raises(UserError, match=f"'{tiny_dir}' has no chat template"):
        patched.setattr("shuffleprune.evaluation.evaluate._score_model", lambda *a: scored.append(a))
        evaluate_models(EvalConfig(**{**config.__dict__, "apply_chat_template": True,   # a model on disk without one:
                                      "models": ["mine", str(tiny_dir)]}), progress=False, loaded={"mine": lm})
    assert not scored   # found before any model is scored
    chat = evaluate_models(EvalConfig(**{**config.__dict__, "apply_chat_template": True}), progress=False,
                           loaded={str(tiny_dir): lm})
    assert len(rendered) == 4 and rendered[0][-1]["role"] == "user"   # one chat per item (its choices share it)
    assert chat["lm_eval"]["apply_chat_template"] is True
    assert chat["models"][0]["lm_eval_cli"].endswith("--apply_chat_template")



def test_apply_chat_template_reads_each_tokenizer_once(tiny_dir, tiny_task, tmp_path, monkeypatch):
    """The tokenizer read to check a model's chat template is the one its model is scored with."""
    import shutil

    from transformers import AutoTokenizer

    model_dir = Path(shutil.copytree(tiny_dir, tmp_path / "chat"))
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} the {% endfor %}")
    reads = []
    real = AutoTokenizer.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        reads.append(args[0])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    res = evaluate_models(EvalConfig(models=[str(model_dir)], tasks=["tiny_mc"], include_path=[str(tiny_task)], limit=2,
                                     apply_chat_template=True), progress=False)
    assert res["models"][0]["lm_eval_cli"].endswith("--apply_chat_template")
    assert reads == [str(model_dir)]

def test_results_json_is_complete(tiny_dir, tiny_task, tmp_path):
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(random_text(2000, seed=3))
    pruned = tmp_path / "pruned"
    res = runner.invoke(app, ["prune", str(tiny_dir), "--base", "wanda", "--perm", "search", "--pattern", "2:4", "--calib", str(heldout),
                              "--nsamples", "4", "--seqlen", "32", "--eval-text", "none", "--out", str(pruned), "--quiet",
                              "--export", str(tmp_path / "deployed")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["report", str(pruned)])   # the default recipe's lsq update kept under --base wanda: said
    assert res.exit_code == 0 and "· wanda 2:4, search perm, lsq update ·" in " ".join(res.output.split()), res.output
    out = tmp_path / "results.json"
    res = runner.invoke(app, ["eval", str(tiny_dir), str(pruned), str(tmp_path / "deployed"), "--tasks", "tiny_mc,ppl",
                              "--include-path", str(tiny_task), "--ppl-text", str(heldout), "--ppl-ctx", "32", "--limit", "10",
                              "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["versions"]["lm_eval"] and data["lm_eval"]["limit"] == 10 and data["lm_eval"]["seeds"]
    assert data["tasks"] == ["tiny_mc", "ppl"] and data["lm_eval"]["task_data"]["tiny_mc"]
    assert [m["model"] for m in data["models"]] == ["tiny-llama", "pruned", "deployed"]
    dense, sparse, deployed = data["models"]
    # a --perm checkpoint is a plain transformers model to lm-eval's hf loader; an export loads through its auto_map
    assert "trust_remote_code" not in sparse["lm_eval_cli"] and "trust_remote_code=True" in deployed["lm_eval_cli"]
    assert deployed["ppl"] == pytest.approx(sparse["ppl"], rel=1e-4) and deployed["sparsity"] == pytest.approx(0.5)
    assert dense["sparsity"] == 0 and sparse["sparsity"] == pytest.approx(0.5) and sparse["pruned"] == "wanda 2:4, search perm, lsq update"
    for m in data["models"]:
        r = m["results"]["tiny_mc"]
        assert r["metric"] == "acc" and 0 <= r["value"] <= 1 and r["stderr"] is not None
        assert r["version"] == 3.0 and r["n_shot"] == 0 and r["n_items"] == 10 and r["n_items_total"] == 16
        assert m["ppl"] > 1 and m["ppl_eval"] == {"text": str(heldout), "split": "the whole file", "ctx": 32, "bos": False,
                                                  "bos_mode": None, "tokens": m["ppl_eval"]["tokens"],
                                                  "tokens_scored": m["ppl_eval"]["tokens"] // 32 * 31}
        assert m["ppl_eval"]["tokens"] > 0 and m["ppl_eval"]["tokens"] % 32 == 0
        assert m["average"] == r["value"] and "--limit 10" in m["lm_eval_cli"] and m["path"] in m["lm_eval_cli"]
    assert sparse["ppl"] != dense["ppl"]
    # how each was fitted, in the results file: the pruned checkpoint's calibration and its export's; nothing for dense
    calibration = {"calibration": {"source": str(heldout), "nsamples": 4, "seqlen": 32, "seed": 0}}
    assert sparse["fitted_on"] == deployed["fitted_on"] == calibration and dense["fitted_on"] is None
    md = out.with_suffix(".md").read_text()
    assert "| tiny_mc acc (n=10) |" in md and "pruned" in md
    assert "tiny-llama" in res.output and "average" in res.output
    assert data["offline"] and "hub unreachable" in res.output  # the one-line fallback notice


def test_the_python_api_scores_models_in_memory_beside_directories(tiny_dir, tiny_task, tmp_path, monkeypatch, capfd):
    import shuffleprune
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # run outside a git repository: lm-eval asks git for the working directory's commit, and git's
    # "fatal: not a git repository" must not reach the user's terminal
    (tmp_path / "not-a-repo").mkdir()
    monkeypatch.chdir(tmp_path / "not-a-repo")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(random_text(2000, seed=5))
    result = shuffleprune.prune(str(tiny_dir), "fast", tmp_path / "pruned", calib=str(heldout), nsamples=4, seqlen=32,
                                eval_text=None, progress=False)
    dense = AutoModelForCausalLM.from_pretrained(tiny_dir)
    scores = shuffleprune.evaluate([str(tmp_path / "pruned"), result, dense], tasks=["tiny_mc", "ppl"],
                                   tokenizer=AutoTokenizer.from_pretrained(tiny_dir), include_path=[str(tiny_task)],
                                   limit=4, ppl_text=str(heldout), ppl_ctx=32, progress=False)
    saved, pruned, unpruned = scores["models"]
    assert [m["model"] for m in scores["models"]] == ["pruned", f"{tiny_dir.name} (in memory)",
                                                      f"{tiny_dir.name} (in memory #2)"]
    assert pruned["ppl"] == pytest.approx(saved["ppl"], rel=1e-5) and unpruned["ppl"] != pruned["ppl"]
    assert pruned["sparsity"] == pytest.approx(0.5) and unpruned["sparsity"] == 0
    # a model object has no path a command line could load it from: none is claimed
    assert (pruned["path"], pruned["lm_eval_cli"], unpruned["pruned"]) == (None, None, None)
    assert saved["lm_eval_cli"] and pruned["results"]["tiny_mc"]["n_items"] == 4
    # a PruneResult brings its run's report: its row says how it was pruned, and that the perplexity text is the
    # text it was calibrated on, as the saved checkpoint's row does (both were silent for a result in memory)
    assert pruned["pruned"] == saved["pruned"] == "wanda 2:4, search perm"   # the `fast` recipe's stages
    err = capfd.readouterr().err
    assert "not a git repository" not in err
    # progress=False silences lm-eval's own bars too (building each task's requests, tokenizing, scoring) and
    # datasets' (a local task's split built): only the test's own from_pretrained above draws one
    bars = [line for line in err.replace("\r", "\n").splitlines() if "it/s]" in line or "examples/s]" in line]
    assert bars and all(line.startswith("Loading weights") for line in bars), err
    assert [line.split(" was calibrated")[0] for line in err.splitlines() if "was calibrated or trained on" in line] == \
        ["warning: pruned", f"warning: {tiny_dir.name} (in memory)"], err
    from rich.console import Console

    from shuffleprune.report import print_eval_report

    console = Console(width=300, record=True)
    print_eval_report(scores, console)   # the row said "heldout.txt test" of a file read whole
    assert f"ppl ↓ ({heldout}, the whole file, ctx 32, " in console.export_text()


def test_perplexity_alone_needs_no_lm_eval(tiny_dir, eval_file, monkeypatch):
    """``eval --tasks ppl`` scores without importing lm-eval (nor building its task index, ~2 s): a
    GPU box or a slim install without the harness still gets perplexities."""
    import sys

    import shuffleprune

    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)   # any import of it now raises ImportError
    scores = shuffleprune.evaluate(str(tiny_dir), tasks="ppl", ppl_text=str(eval_file), ppl_ctx=32)
    assert scores["models"][0]["ppl"] > 1


def test_perplexity_of_documents_in_memory_is_that_of_the_same_text_in_a_file(tiny_dir, eval_file):
    """``evaluate(..., ppl_text=[...])`` scores documents held in memory (only names and paths were
    taken), as the same documents in a .txt file score."""
    import shuffleprune

    docs = [d for d in eval_file.read_text().split("\n\n") if d.strip()]
    common = dict(tasks="ppl", ppl_ctx=32)
    from_file = shuffleprune.evaluate(str(tiny_dir), ppl_text=eval_file, **common)["models"][0]   # a Path too
    from_list = shuffleprune.evaluate(str(tiny_dir), ppl_text=docs, **common)["models"][0]
    assert from_list["ppl"] == from_file["ppl"] and from_list["ppl_eval"]["split"] == "all of them"
    assert from_list["ppl_eval"]["text"].startswith(f"documents:{len(docs)}:")


def test_scoring_a_model_on_its_calibration_text_is_warned_about(tiny_dir, text_file, eval_file, tmp_path):
    """``eval --ppl-text`` naming the file a checkpoint was calibrated on warns that the perplexity is
    not held out (it was scored silently); another text does not."""
    import shuffleprune

    shuffleprune.prune(str(tiny_dir), "fast", tmp_path / "pruned", calib=str(text_file), eval_text=None, nsamples=4,
                       seqlen=32, progress=False)
    for ppl_text, warned in ((text_file, True), (eval_file, False)):
        res = CliRunner().invoke(app, ["eval", str(tmp_path / "pruned"), str(tiny_dir), "--tasks", "ppl", "--ppl-text",
                                       str(ppl_text), "--ppl-ctx", "32", "--ppl-tokens", "256", "--quiet"])
        assert res.exit_code == 0, res.output
        lines = [l for l in res.output.splitlines() if "not held out" in l]
        assert lines == ([f"warning: pruned was calibrated or trained on '{text_file}', the perplexity text: its "
                          "perplexity is not held out (give --ppl-text another text)"] if warned else []), res.output


def test_bos_text_mode_scores_and_calibrates_as_the_papers_loaders(eval_file, text_file):
    """``ppl_bos="text"`` / ``bos="text"``: for a tokenizer that adds BOS, the perplexity text is
    encoded once with BOS at its start and cut into consecutive windows, as SparseGPT's and Wanda's
    evaluation loops do (the default puts BOS at the start of every window); prune's dense
    perplexity is that same number, and its report says which mode ran."""
    import math

    from tokenizers import processors

    import shuffleprune
    from conftest import make_tokenizer, tiny_model

    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "[BOS]"})
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", bos)])
    model = tiny_model().eval()
    stream = torch.tensor(tokenizer(eval_file.read_text())["input_ids"])
    assert stream[0] == bos and (stream[1:] != bos).all()
    windows = stream[: stream.numel() // 16 * 16].view(-1, 16)
    with torch.no_grad():
        logits = model(windows).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    papers = math.exp(nll.item())
    common = dict(tasks="ppl", ppl_text=str(eval_file), ppl_ctx=16)
    row = shuffleprune.evaluate(model, tokenizer=tokenizer, ppl_bos="text", **common)["models"][0]
    assert row["ppl"] == pytest.approx(papers, rel=1e-5) and row["ppl_eval"]["bos_mode"] == "text"
    default = shuffleprune.evaluate(model, tokenizer=tokenizer, **common)["models"][0]
    assert default["ppl_eval"]["bos"] and default["ppl"] != pytest.approx(papers, rel=1e-3)
    result = shuffleprune.prune(model, "fast", tokenizer=tokenizer, calib=str(text_file), eval_text=str(eval_file),
                                nsamples=2, seqlen=16, bos="text", progress=False)
    assert result.report["ppl"]["dense"] == pytest.approx(papers, rel=1e-5)
    assert (result.report["bos"], result.report["bos_mode"]) == (False, "text")
    with pytest.raises(UserError, match="--ppl-bos must be window .* or text"):
        shuffleprune.evaluate(model, tokenizer=tokenizer, ppl_bos="first", **common)
    with pytest.raises(UserError, match="--bos must be window"):
        shuffleprune.prune(model, "fast", tokenizer=tokenizer, bos="first")


def test_the_python_api_takes_one_model_a_task_string_and_checks_types(tiny_dir, tmp_path):
    """evaluate("dir", tasks="ppl") scores that model on ppl (a string was iterated letter by letter:
    models 'd', 'i', … and tasks 'p', 'p', 'l'); a value of the wrong type is a one-line error naming
    the setting (limit="5" was a TypeError inside lm-eval's setup)."""
    import shuffleprune

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(random_text(2000, seed=5))
    common = dict(ppl_text=str(heldout), ppl_ctx=32)
    alone = shuffleprune.evaluate(str(tiny_dir), tasks="ppl", **common)
    listed = shuffleprune.evaluate([str(tiny_dir)], tasks=["ppl"], **common)
    assert [m["model"] for m in alone["models"]] == [tiny_dir.name] and alone["config"]["tasks"] == ["ppl"]
    assert alone["models"][0]["ppl"] == listed["models"][0]["ppl"]
    for options, needle in (({"limit": "5"}, "'limit' must be float, got '5'"),
                            ({"ppl_ctx": 64.0}, "'ppl_ctx' must be int, got 64.0"),
                            ({"offline": 1}, "'offline' must be true or false"),
                            ({"include_path": "tasks/"}, "'include_path' must be a list of strings"),
                            ({"tasks": []}, "no tasks given")):   # an empty list is no call for the defaults
        with pytest.raises(UserError, match=needle):
            shuffleprune.evaluate([str(tiny_dir)], **{"tasks": ["ppl"], **common, **options})
    with pytest.raises(UserError, match=r"'2:4' is a pattern, not a recipe: give pattern='2:4'"):
        shuffleprune.prune(str(tiny_dir), "2:4")
    with pytest.raises(UserError, match=r"'pattern' must be str such as '2:4', got 24"):
        shuffleprune.export(str(tiny_dir), tmp_path / "e", pattern=24)
    with pytest.raises(UserError, match=r"export reads a pruned checkpoint from disk, not a dict: prune with out="):
        shuffleprune.export({"report": {}}, tmp_path / "e")   # e.g. what prune() returned (a TypeError deep inside)


def test_the_hub_is_asked_only_when_something_needs_it(tiny_dir, tmp_path, monkeypatch):
    from shuffleprune.evaluation import evaluate as evaluation

    asked = []
    monkeypatch.setattr(evaluation, "hub_reachable", lambda: asked.append(1) or False)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(random_text(2000, seed=4))
    res = runner.invoke(app, ["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-text", str(heldout), "--ppl-ctx", "32", "--quiet",
                              "--out", str(tmp_path / "ppl.json")])
    assert res.exit_code == 0 and not asked and "hub unreachable" not in res.output, res.output
    assert "shuffleprune eval · perplexity" in res.output and "hub data" not in res.output  # no lm-eval task ran
    assert (tmp_path / "ppl.md").read_text().startswith("Perplexity, device cpu.") and "Task data" not in (tmp_path / "ppl.md").read_text()
    res = runner.invoke(app, ["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-ctx", "32", "--ppl-tokens", "2000", "--quiet"])
    assert res.exit_code == 0 and asked, res.output  # auto: wikitext2 if the hub answers, else brown, said so
    notice = next(l for l in res.output.splitlines() if l.startswith("hub unreachable"))
    assert "perplexity on 'brown'" in notice and "lm-eval tasks" not in notice


def test_eval_errors_are_one_line_and_write_nothing(tiny_dir, tiny_task, tmp_path):
    out = tmp_path / "r.json"
    cases = ((["eval", str(tiny_dir), "--tasks", "no_such_task", "--include-path", str(tiny_task)], "unknown task"),
             (["eval", str(tiny_dir), "--tasks", "tiny_mcc", "--include-path", str(tiny_task)],   # a typo: the near name
              "unknown task(s) tiny_mcc (tiny_mcc: did you mean tiny_mc?)"),
             (["eval", str(tmp_path / "missing"), "--tasks", "tiny_mc", "--include-path", str(tiny_task)], "does not exist"),
             (["eval", str(tiny_dir), "--tasks", "tiny_mc", "--include-path", str(tmp_path / "nodir")], "not a directory"),
             (["eval", str(tiny_dir), "--tasks", "mmlu_anatomy", "--offline"], "need the Hugging Face hub"),
             (["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-text", "wikitext2", "--offline"], "needs the Hugging Face hub"),
             (["eval", str(tiny_dir), "--tasks", "arc_easy", "--offline", "--num-fewshot", "5"], "few-shot"),
             (["eval", str(tiny_dir), "--limit", "0"], "--limit"),
             (["eval", str(tiny_dir), "--limit", "1.5"], "--limit must be a count of items (1, 2, …) or a fraction below 1"),
             (["eval", str(tiny_dir), "--tasks", ","], "no tasks given"),   # not the default tasks, silently
             (["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-tokens", "0"], "--ppl-tokens must be"))
    for args, needle in cases:
        res = runner.invoke(app, [*args, "--out", str(out), "--quiet"])
        assert res.exit_code == 2, (args, res.output)
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], (args, res.output)
        assert not out.exists() and not out.with_suffix(".md").exists()
    res = runner.invoke(app, ["eval", str(tiny_dir), "--out", str(tmp_path / "r.txt")])
    assert res.exit_code == 2 and "must name a .json" in res.output


def test_an_allocation_that_fails_while_scoring_is_one_line_and_writes_nothing(tiny_dir, eval_file, tmp_path,
                                                                                 monkeypatch):
    """A perplexity window or lm-eval batch larger than memory ended in torch's allocator traceback; now the
    run stops with a one-line error naming the options to lower, and no results file is written."""
    import shuffleprune.evaluation.evaluate as evaluate

    def short(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(evaluate, "perplexity", short)
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-text", str(eval_file), "--ppl-ctx", "32",
                              "--out", str(out), "--quiet"])
    assert res.exit_code == 2, res.output
    assert [l for l in res.output.splitlines() if l.strip()] == [
        "error: ran out of memory (CUDA out of memory. Tried to allocate 8.00 GiB): lower --batch-size (lm-eval's "
        "tasks) or --ppl-ctx (perplexity)"]
    assert not out.exists() and not out.with_suffix(".md").exists()


def test_eval_replaces_only_its_own_results(tiny_dir, eval_file, tmp_path):
    """`--out` onto a file eval did not write (the model's config.json; a README.json whose .md is the
    model card) is refused and the file left as it was; an earlier results file is replaced."""
    (tiny_dir / "README.md").write_text("the model card")
    kept = {name: (tiny_dir / name).read_bytes() for name in ("config.json", "README.md")}
    small = ["--tasks", "ppl", "--ppl-text", str(eval_file), "--ppl-ctx", "32", "--ppl-tokens", "256", "--quiet"]
    for target in (tiny_dir / "config.json", tiny_dir / "README.json"):
        res = runner.invoke(app, ["eval", str(tiny_dir), *small, "--out", str(target)])
        assert res.exit_code == 2 and "is no earlier eval result" in res.output, res.output
    assert kept == {name: (tiny_dir / name).read_bytes() for name in kept}
    assert not (tiny_dir / "README.json").exists()
    out = tiny_dir / "eval.json"
    for _ in range(2):   # written, then replaced
        res = runner.invoke(app, ["eval", str(tiny_dir), *small, "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["models"][0]["ppl"] > 1 and out.with_suffix(".md").is_file()


def test_offline_tasks_are_the_stock_definitions_on_full_local_data():
    """Item counts of the rebuilt/copied data equal the stock datasets'; prompts are the stock ones."""
    from lm_eval.tasks import TaskManager

    from shuffleprune.evaluation.offline_tasks import build_offline_tasks

    names = ["hellaswag", "arc_easy", "arc_challenge", "openbookqa"]
    stock = TaskManager()
    local_dir = build_offline_tasks(names, {n: Path(stock.task_index[n].yaml_path) for n in names})
    tm = TaskManager(include_path=str(local_dir))
    tasks = tm.load([f"{n}_local" for n in names])["tasks"]
    counts = {name: len(list(task.eval_docs)) for name, task in tasks.items()}
    assert counts == {"hellaswag_local": 10042, "arc_easy_local": 2376, "arc_challenge_local": 1172,
                      "openbookqa_local": 500}
    for n in names:  # same prompt template, metrics and version as the stock YAML
        local_cfg, stock_cfg = tasks[f"{n}_local"].config, stock.task_index[n].cfg
        assert local_cfg.doc_to_text == stock_cfg["doc_to_text"] and local_cfg.metadata["version"] == stock_cfg["metadata"]["version"]
        assert [m["metric"] for m in local_cfg.metric_list] == [m["metric"] for m in stock_cfg["metric_list"]]
    arc = tasks["arc_easy_local"]
    doc = next(iter(arc.eval_docs))
    assert arc.doc_to_text(doc).startswith("Question: ") and arc.doc_to_text(doc).endswith("\nAnswer:")
    assert len(arc.doc_to_choice(doc)) == len(doc["choices"]["text"]) and 0 <= arc.doc_to_target(doc) < len(doc["choices"]["text"])


def test_eval_of_a_hub_export_scores_its_snapshot_and_names_the_repo(tiny_dir, tiny_task, tmp_path, local_hub):
    """`eval me/repo` of an uploaded export scores the compressed model from its snapshot, and the
    recorded lm_eval command names the repo (portable), with trust_remote_code for the auto_map."""
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(random_text(2000, seed=3))
    res = runner.invoke(app, ["prune", str(tiny_dir), "--base", "wanda", "--perm", "search", "--pattern", "2:4",
                              "--calib", str(heldout), "--nsamples", "4", "--seqlen", "32", "--eval-text", "none",
                              "--out", str(tmp_path / "pruned"), "--export", str(tmp_path / "deployed"), "--quiet"])
    assert res.exit_code == 0, res.output
    local_hub("me/tiny-2of4", tmp_path / "deployed")
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["eval", "me/tiny-2of4", str(tmp_path / "deployed"), "--tasks", "tiny_mc,ppl",
                              "--include-path", str(tiny_task), "--ppl-text", str(heldout), "--ppl-ctx", "32",
                              "--limit", "10", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    by_id, local = json.loads(out.read_text())["models"]
    assert by_id["ppl"] == local["ppl"] and by_id["results"]["tiny_mc"]["value"] == local["results"]["tiny_mc"]["value"]
    assert by_id["sparsity"] == pytest.approx(0.5)
    assert "pretrained=me/tiny-2of4," in by_id["lm_eval_cli"] and "trust_remote_code=True" in by_id["lm_eval_cli"]


def test_every_model_is_found_before_the_first_is_scored(tiny_dir, eval_file, tmp_path, monkeypatch):
    """A missing model later in the list fails at once (it failed only after the models before it were
    scored, which on real models takes hours); the one-line error is the loader's."""
    import huggingface_hub.constants

    from shuffleprune.errors import UserError
    from shuffleprune.evaluation import evaluate as evaluation
    from shuffleprune.hub import hub_reachable

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # offline on any machine
    hub_reachable.cache_clear()
    loads = []
    monkeypatch.setattr(evaluation, "load_model", lambda *a, **k: loads.append(a) or load_model(*a, **k))
    for missing, needle in ((str(tmp_path / "nowhere"), "does not exist"), ("no-such-owner/no-such-model", "hub"),
                            (str(tmp_path), "no config.json")):
        config = EvalConfig(models=[str(tiny_dir), missing], tasks=["ppl"], ppl_text=str(eval_file), ppl_ctx=32)
        with pytest.raises(UserError, match=needle):
            evaluate_models(config, progress=False)
        assert loads == []
    hub_reachable.cache_clear()
