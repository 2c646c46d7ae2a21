import json

import pytest
from conftest import random_text, tiny_model
from typer.testing import CliRunner

from shuffleprune.cli import app

runner = CliRunner()


def test_prune_cli_end_to_end(tiny_dir, text_file, eval_file, tmp_path):
    out = tmp_path / "cli-out"
    res = runner.invoke(app, ["prune", str(tiny_dir), "--base", "sparsegpt", "--pattern", "4:8", "--calib", str(text_file),
                              "--eval-text", str(eval_file), "--nsamples", "4", "--seqlen", "32", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "sparsegpt 4:8" in res.output and "dense" in res.output
    assert "%|" not in res.output, res.output  # --quiet: no bars, transformers' own (loading weights) included
    report = json.loads((out / "prune_report.json").read_text())
    assert report["pattern"] == "4:8" and report["nm_ok"]


def test_a_seqlen_past_the_models_context_warns_and_takes_the_context(tiny_dir, text_file, tmp_path):
    """Calibration windows are at most the model's context (its 256 positions here), as the papers' loaders
    make them; a longer --seqlen says so in one line (it was silent), and the report records the windows'
    length used."""
    out = tmp_path / "capped"
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), "--eval-text", "none", "--nsamples",
                              "2", "--seqlen", "300", "--recipe", "fast", "--quiet", "--out", str(out)])
    assert res.exit_code == 0, res.output
    lines = [l for l in res.output.splitlines() if "context" in l]
    assert lines == ["warning: --seqlen 300 is longer than the model's context (256 positions): calibration "
                     "windows of 256 tokens"], res.output
    assert json.loads((out / "prune_report.json").read_text())["calib"]["seqlen"] == 256
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), "--eval-text", "none", "--nsamples",
                              "2", "--seqlen", "256", "--recipe", "fast", "--quiet"])
    assert res.exit_code == 0 and "context" not in res.output, res.output


def test_prune_without_out_says_first_that_nothing_will_be_saved(tiny_dir, text_file, tmp_path):
    """Without --out the pruned model is scored and dropped: the command says so before the run, in one line,
    so a long run is not lost to a forgotten flag (it was silent)."""
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), "--eval-text", "none", "--nsamples",
                              "2", "--seqlen", "32", "--recipe", "fast", "--quiet"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0] == "warning: no --out: the pruned model is scored, then not saved; pass --out " \
                                         "DIR to keep it", res.output
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), "--eval-text", "none", "--nsamples",
                              "2", "--seqlen", "32", "--recipe", "fast", "--quiet", "--out", str(tmp_path / "kept")])
    assert res.exit_code == 0 and "no --out" not in res.output, res.output


def test_a_short_text_warns_that_the_windows_overlap_in_one_line(tiny_dir, tmp_path):
    """Asking for more calibration tokens than the text has is a warning (the windows repeat text;
    it was silent), printed as ``warning: …`` rather than Python's file:line form."""
    short = tmp_path / "short.txt"
    short.write_text(" ".join(["the of and to in a is that"] * 5))   # 40 tokens
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(short), "--eval-text", "none", "--nsamples", "4",
                              "--seqlen", "32", "--recipe", "fast", "--quiet"])
    assert res.exit_code == 0, res.output
    lines = [l for l in res.output.splitlines() if "overlap" in l]
    assert len(lines) == 1 and lines[0].startswith(f"warning: '{short}' has 40 calibration tokens, fewer than the 4 "
                                                   "windows of 32 ask (128): the windows overlap"), res.output
    assert "UserWarning" not in res.output and "warnings.warn" not in res.output
    corpus = tmp_path / "corpus"   # a perplexity file inside the calibration directory is no held-out text
    corpus.mkdir()
    (corpus / "a.txt").write_text(random_text(600, 1))
    (corpus / "b.txt").write_text(random_text(600, 2))
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(corpus), "--eval-text", str(corpus / "b.txt"),
                              "--nsamples", "2", "--seqlen", "32", "--recipe", "fast", "--quiet"])
    assert res.exit_code == 0, res.output
    assert [l for l in res.output.splitlines() if "not held out" in l] == [
        f"warning: the perplexity text '{corpus / 'b.txt'}' is part of the calibration text '{corpus}': its perplexity "
        "is not held out (give --eval-text a text outside it, or the same directory to split it)"], res.output


def test_quiet_silences_library_bars_and_restores_them(tiny_dir, tmp_path):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    from shuffleprune.deploy.export import export_checkpoint
    from shuffleprune.prune import PruneConfig, prune

    pruned = tmp_path / "pruned"
    prune(PruneConfig.build("fast", model=str(tiny_dir), calib="wiki", nsamples=2, seqlen=16, eval_text=None),
          out=pruned, progress=False)
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()  # restored after the run
    for quiet, bars in ((["--quiet"], False), ([], True)):
        res = runner.invoke(app, ["export", str(pruned), str(tmp_path / f"export{len(quiet)}"), *quiet])
        assert res.exit_code == 0, res.output
        assert ("Loading weights" in res.output) is bars, res.output
    hf_logging.disable_progress_bar()  # a caller's own choice is kept, not turned back on
    try:
        export_checkpoint(pruned, tmp_path / "export-again", progress=False)
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_cli_errors_are_one_line_and_nonzero(tiny_dir, tmp_path, monkeypatch):
    import json
    import shutil

    import huggingface_hub.constants

    from shuffleprune.hub import hub_reachable

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # offline on any machine
    hub_reachable.cache_clear()

    bad = tmp_path / "bad-config"  # config.json disagrees with the weights
    shutil.copytree(tiny_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    untokenized = tmp_path / "no-tokenizer"  # weights and config only, as a bare save_pretrained of the model
    untokenized.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dir / name, untokenized / name)
    # from a Qwen2 config alone transformers builds a tokenizer with an empty vocabulary (no error)
    untokenized_qwen = tmp_path / "no-tokenizer-qwen2"
    tiny_model("qwen2").save_pretrained(untokenized_qwen)
    for args, needle in ((["prune", str(tiny_dir), "--pattern", "4:2"], "impossible pattern"),
                         (["prune", str(bad), "--out", str(tmp_path / "o")], "do not have the shapes its config.json"),
                         (["dst", "--arch", "llama", "--config-kw", "hidden_size=65,num_attention_heads=4",
                           "--tokenizer", str(tiny_dir), "--out", str(tmp_path / "o")], "not a multiple of the number"),
                         (["prune", str(tmp_path / "nope")], "does not exist"),
                         (["prune", "no-such-owner/no-such-model"], "the Hugging Face hub is unreachable"),
                         (["export", "no-such-run", str(tmp_path / "e")],   # was huggingface_hub's offline message
                          "cannot load pruned checkpoint 'no-such-run': no local directory of that name"),
                         (["prune", str(tiny_dir), "--seed", str(10**20), "--out", str(tmp_path / "o")],
                          "--seed must be in 0"),
                         (["dst", "--tokenizer", str(tiny_dir), "--seed", "-1", "--out", str(tmp_path / "o")],
                          "--seed must be in 0"),
                         (["prune", str(tiny_dir), "--base", "obs"], "--base: unknown prune stage 'obs'"),
                         (["prune", str(tiny_dir), "--device", "tpu"], "unknown --device"),
                         (["prune", str(tiny_dir), "--pattern", "2:4", "--sparsity", "0.5"], "not both"),
                         (["eval", str(untokenized), "--tasks", "ppl"], "has no tokenizer files: copy those"),
                         (["prune", str(untokenized_qwen), "--out", str(tmp_path / "o")], "has no tokenizer files"),
                         (["dst", "--arch", "gpt2", "--tokenizer", str(untokenized_qwen), "--out", str(tmp_path / "o")],
                          "has no tokenizer files"),
                         (["dst", "--tokenizer", "no-such-owner/no-such-tokenizer", "--out", str(tmp_path / "o")],
                          "cannot load tokenizer 'no-such-owner/no-such-tokenizer': no local directory"),  # was an OSError
                         (["dst", "--tokenizer", "bpe:0", "--out", str(tmp_path / "o")], "use bpe:VOCAB_SIZE"),
                         (["dst", "--arch", "t5", "--tokenizer", str(tiny_dir), "--out", str(tmp_path / "o")],   # a traceback
                          "--arch t5: transformers has no causal-LM class for model type 't5'"),
                         (["dst", "--config-kw", "n_layer=0", "--tokenizer", str(tiny_dir), "--out", str(tmp_path / "o")],
                          "this model has no layers to sparsify"),   # was a ZeroDivisionError
                         (["prune", str(tiny_dir), "--calib", "c4", "--out", str(tmp_path / "o")], "offline sources"),
                         (["prune", str(tiny_dir), "--batch-size", "0", "--out", str(tmp_path / "o")],
                          "--batch-size must be"),
                         (["prune", str(tiny_dir), "--eval-ctx", "1", "--out", str(tmp_path / "o")],
                          "--eval-ctx must be"),
                         (["prune", str(tiny_dir), "--eval-tokens", "0", "--out", str(tmp_path / "o")],
                          "--eval-tokens must be"),
                         (["prune", str(tiny_dir), "--nsamples", "0", "--out", str(tmp_path / "o")],
                          "--nsamples must be >= 1, got 0"),
                         (["prune", str(tiny_dir), "--seqlen", "1", "--out", str(tmp_path / "o")],
                          "--seqlen must be >= 2 (a window predicts seqlen − 1 tokens), got 1"),
                         (["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-ctx", "1"], "--ppl-ctx must be >= 2"),
                         (["dst", "--tokenizer", str(tiny_dir), "--steps", "0", "--out", str(tmp_path / "o")],
                          "--steps must be >= 1, got 0"),
                         (["dst", "--tokenizer", str(tiny_dir), "--alpha", "2", "--out", str(tmp_path / "o")],
                          "--alpha must be in [0, 1], got 2.0"),
                         (["dst", "--tokenizer", str(tiny_dir), "--method", "nm", "--perm", "learned", "--delta", "0",
                           "--out", str(tmp_path / "o")], "--delta must be > 0, got 0.0")):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], res.output
    assert not (tmp_path / "o").exists()
    hub_reachable.cache_clear()



def test_an_empty_path_is_refused_not_read_as_the_current_directory(tiny_dir, text_file, tmp_path, monkeypatch):
    """``--out "$OUT"`` with OUT unset: Path("") is the current directory, which --overwrite cleared (and a
    text, --perm-from or PRUNED read there). Each path option, and a text source, refuses an empty value in
    one line, and the directory is left as it was; the Python API refuses it too."""
    import shuffleprune
    from shuffleprune.errors import UserError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("kept")
    run = ["prune", str(tiny_dir), "--calib", str(text_file), "--nsamples", "4", "--seqlen", "32", "--eval-text", "none"]
    out = ["--out", str(tmp_path / "o")]
    for args, needle in (([*run, "--out", "", "--overwrite"], "--out is empty (an unset shell variable?); give a path, "
                                                            "or '.' for this directory"),
                         ([*run, *out, "--export", ""], "--export is empty"),
                         ([*run, *out, "--plots", ""], "--plots is empty"),
                         ([*run, *out, "--perm-from", ""], "--perm-from is empty"),
                         ([*run[:3], "", *run[4:], *out], "a text source is empty; use c4, wikitext2, wiki, brown"),
                         ([*run[:-1], " ", *out], "a text source is empty"),
                         (["export", "", str(tmp_path / "e")], "PRUNED is empty"),
                         (["export", str(tiny_dir), ""], "OUT is empty"),
                         (["report", ""], "PRUNED is empty"),
                         (["eval", str(tiny_dir), "--tasks", "ppl", "--out", ""], "--out is empty"),
                         (["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-text", ""], "a text source is empty"),
                         (["eval", str(tiny_dir), "--tasks", "ppl", "--include-path", ""], "--include-path is empty"),
                         (["dst", "--data", "", "--out", str(tmp_path / "o")], "a text source is empty"),
                         (["dst", "--data", str(text_file), "--out", ""], "--out is empty")):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        lines = [l for l in res.output.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (args, res.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "mine.txt", "tiny-llama"]
    for call in (lambda: shuffleprune.prune(str(tiny_dir), "fast", "", calib=str(text_file), nsamples=4, seqlen=32),
                 lambda: shuffleprune.export("", tmp_path / "e"),
                 lambda: shuffleprune.export(tiny_dir, "")):
        with pytest.raises(UserError, match="is empty"):
            call()

def test_help_documents_defaults():
    from shuffleprune.version import __version__

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"shuffleprune {__version__}"
    res = runner.invoke(app, ["prune", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for needle in ("--recipe", "--pattern", "default: (2:4)", "--nsamples", "default: (128)", "--seqlen",
                   "default: (2048)", "--resume", "--set"):
        assert needle in res.output


def test_overwrite_never_clears_an_input(tiny_dir, text_file, tmp_path):
    """`--overwrite` clears `--out` (and `export` its target): refused, with nothing deleted, when that
    directory is an input or holds one (the model, a text, earlier index maps, the pruned checkpoint)."""
    import shutil

    work = tmp_path / "work"   # a model and a text inside the directory named as --out
    shutil.copytree(tiny_dir, work / "model")
    shutil.copy(text_file, work / "calib.txt")
    small = ["--nsamples", "4", "--seqlen", "32", "--eval-text", "none", "--quiet"]
    pruned = tmp_path / "pruned"
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), *small, "--out", str(pruned)])
    assert res.exit_code == 0, res.output
    before = {p: sorted(x.name for x in p.rglob("*")) for p in (tiny_dir, work, pruned)}
    for args, needle in (
            (["prune", str(tiny_dir), "--calib", str(text_file), "--out", str(tiny_dir)], f"is the input '{tiny_dir}'"),
            (["prune", str(work / "model"), "--calib", str(text_file), "--out", str(work)], "holds the input"),
            (["prune", str(tiny_dir), "--calib", str(work / "calib.txt"), "--out", str(work)], "calib.txt"),
            (["prune", str(tiny_dir), "--calib", str(text_file), "--perm-from", str(pruned), "--out", str(pruned)],
             "is the input"),
            (["dst", "--data", str(work / "calib.txt"), "--tokenizer", str(tiny_dir), "--steps", "2",
              "--out", str(work)], "holds the input"),
            (["dst", "--data", str(text_file), "--tokenizer", str(tiny_dir), "--steps", "2", "--out", str(tiny_dir)],
             "is the input")):
        res = runner.invoke(app, [*args, *small, "--overwrite"] if args[0] == "prune" else [*args, "--overwrite"])
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], (args, res.output)
    for target in (pruned, tmp_path):   # the pruned checkpoint itself, and a directory above it
        res = runner.invoke(app, ["export", str(pruned), str(target), "--overwrite"])
        assert res.exit_code == 2 and "export target" in res.output and "the pruned checkpoint" in res.output, res.output
    assert before == {p: sorted(x.name for x in p.rglob("*")) for p in before}


def test_prune_checks_its_export_target_before_pruning(tiny_dir, text_file, tmp_path):
    """`prune --export` refuses a target it could not write (the --out itself, a dir above it, a file, a
    non-empty dir without --overwrite, an unstructured recipe) before pruning, not after the whole run."""
    small = ["--calib", str(text_file), "--nsamples", "4", "--seqlen", "32", "--eval-text", "none", "--quiet"]
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    out = tmp_path / "pruned"
    res = runner.invoke(app, ["prune", str(tiny_dir), *small, "--out", str(out)])
    recipe = tmp_path / "unstructured.yaml"   # a recipe file can ask for unstructured sparsity (no flag says so)
    text = (out / "recipe.yaml").read_text().replace("pattern: '2:4'", "pattern: null")
    recipe.write_text(text.replace("sparsity: null", "sparsity: 0.5").split("- permutation:")[0] + "- prune: wanda\n")
    out = tmp_path / "o" / "pruned"
    for extra, needle in (([ "--export", str(out)], "is the pruned checkpoint"),
                          (["--export", str(tmp_path / "o"), "--overwrite"], "holds the pruned checkpoint"),
                          (["--export", str(tmp_path / "a-file")], "is a file"),
                          (["--export", str(tmp_path / "full")], "is not empty"),
                          (["--export", str(tmp_path / "x"), "--recipe", str(recipe)], "needs an N:M pattern")):
        res = runner.invoke(app, ["prune", str(tiny_dir), *small, "--out", str(out), *extra])
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], (extra, res.output)
        assert not (tmp_path / "o").exists() and not (tmp_path / "x").exists()   # nothing was pruned



def test_plots_are_checked_before_pruning_and_drawn_after(tiny_dir, text_file, tmp_path):
    """`--plots` into a file, or on a run without a permutation (where nothing was drawn, silently),
    fails before pruning; with the default recipe's permutation the strength picture is written."""
    small = ["--calib", str(text_file), "--nsamples", "4", "--seqlen", "32", "--eval-text", "none", "--quiet"]
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "pruned"
    for extra, needle in ((["--plots", str(tmp_path / "a-file")], "is a file"),
                          (["--perm", "none", "--plots", str(tmp_path / "pics")], "this run has none")):
        res = runner.invoke(app, ["prune", str(tiny_dir), *small, "--out", str(out), *extra])
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], (extra, res.output)
        assert not out.exists() and not (tmp_path / "pics").exists()
    res = runner.invoke(app, ["prune", str(tiny_dir), *small, "--out", str(out), "--plots", str(tmp_path / "pics")])
    assert res.exit_code == 0 and (tmp_path / "pics" / "perm_strength.png").stat().st_size > 0, res.output
    res = runner.invoke(app, ["report", str(out), "--plots", str(tmp_path / "a-file")])
    assert res.exit_code == 2 and "is a file" in res.output and "Traceback" not in res.output, res.output


def test_a_dir_holding_a_model_names_it(tiny_dir, tmp_path):
    """A directory whose model lies one level down (a dst run's OUT/model) is named in the error of
    every command that takes a model, instead of only 'no config.json'."""
    import shutil

    run = tmp_path / "dst-run"
    shutil.copytree(tiny_dir, run / "model")
    (run / "dst_report.json").write_text("{}")
    for args in (["prune", str(run)], ["export", str(run), str(tmp_path / "x")], ["eval", str(run), "--tasks", "ppl"]):
        res = runner.invoke(app, args)
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and f"give '{run / 'model'}'" in lines[0], (args, res.output)


def test_an_encoder_decoder_is_refused_by_its_model_type(tmp_path):
    """A checkpoint transformers has no causal-LM class for (T5) says so and its model type, instead of
    transformers' list of every config class it accepts."""
    from conftest import make_tokenizer
    from transformers import AutoConfig

    path = tmp_path / "t5"
    AutoConfig.for_model("t5", vocab_size=128, d_model=64, num_layers=2, num_heads=4, d_ff=128).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    for args in (["prune", str(path)], ["eval", str(path), "--tasks", "ppl"]):
        res = runner.invoke(app, args)
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1, res.output
        assert "no causal-LM class for its model type 't5'" in lines[0] and "Model type should be" not in lines[0]


def test_a_damaged_run_report_is_a_one_line_error(tiny_dir, text_file, tmp_path):
    """`report` and `export` of a checkpoint whose prune_report.json is cut short or edited into
    something else say so in one line (they were a JSONDecodeError or KeyError traceback)."""
    pruned = tmp_path / "pruned"
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), "--nsamples", "4", "--seqlen", "32",
                              "--eval-text", "none", "--quiet", "--out", str(pruned)])
    assert res.exit_code == 0, res.output
    whole = (pruned / "prune_report.json").read_text()
    for text, needle in ((whole[: len(whole) // 2], "is not a readable run report"),
                         ('{"model": "x"}', "has no method, pattern")):
        (pruned / "prune_report.json").write_text(text)
        for args in (["report", str(pruned)], ["export", str(pruned), str(tmp_path / "e")]):
            res = runner.invoke(app, args)
            lines = [l for l in res.output.splitlines() if l.startswith("error:")]
            assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], (args, res.output)
    assert not (tmp_path / "e").exists()


def test_an_output_dir_that_is_a_symlink_stays_one(tiny_dir, text_file, tmp_path):
    """`--out` / an export target linked to a directory elsewhere (another disk) is written through the
    link, which stays a link (`--overwrite` was 'Cannot call rmtree on a symbolic link', and export
    failed even into an empty linked dir)."""
    small = ["--calib", str(text_file), "--nsamples", "4", "--seqlen", "32", "--eval-text", "none", "--quiet"]
    for name in ("pruned", "deployed", "trained"):
        (tmp_path / "disk" / name).mkdir(parents=True)
        (tmp_path / "disk" / name / "old.txt").write_text("from an earlier run")
        (tmp_path / name).symlink_to(tmp_path / "disk" / name, target_is_directory=True)
    pruned, deployed, trained = (tmp_path / n for n in ("pruned", "deployed", "trained"))
    res = runner.invoke(app, ["prune", str(tiny_dir), *small, "--out", str(pruned), "--overwrite",
                              "--export", str(deployed)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["dst", "--data", str(text_file), "--tokenizer", str(tiny_dir), "--arch", "llama",
                              "--config-kw", "hidden_size=32,intermediate_size=64,num_hidden_layers=1,"
                              "num_attention_heads=2,num_key_value_heads=1", "--seq-len", "16", "--batch-size", "2",
                              "--steps", "1", "--eval-tokens", "32", "--quiet", "--out", str(trained), "--overwrite"])
    assert res.exit_code == 0, res.output
    for link, expect in ((pruned, "prune_report.json"), (deployed, "shuffleprune_format.json"),
                         (trained, "dst_report.json")):
        assert link.is_symlink() and (tmp_path / "disk" / link.name / expect).is_file(), link
        assert not (link / "old.txt").exists()


def test_unwritable_outputs_are_refused_before_the_run(tiny_dir, text_file, tmp_path):
    """An output path that cannot be written (here: below a file) is a one-line error before anything
    runs, for every command's outputs (they were a FileNotFoundError/NotADirectoryError traceback, for
    prune --export, --plots and eval --out only after the whole run)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    small = ["--calib", str(text_file), "--nsamples", "4", "--seqlen", "32", "--eval-text", "none", "--quiet"]
    pruned = tmp_path / "pruned"
    cases = ((["prune", str(tiny_dir), *small, "--out", str(blocker / "o")], "--out"),
             (["prune", str(tiny_dir), *small, "--out", str(pruned), "--export", str(blocker / "e")], "export target"),
             (["prune", str(tiny_dir), *small, "--out", str(pruned), "--plots", str(blocker / "p")], "--plots"),
             (["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-text", str(text_file), "--out", str(blocker / "r.json")],
              "--out"),
             (["dst", "--tokenizer", str(tiny_dir), "--data", str(text_file), "--out", str(blocker / "d")], "--out"))
    for args, flag in cases:
        res = runner.invoke(app, args)
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1, (args, res.output)
        assert lines[0].startswith(f"error: {flag} '") and f"cannot write in '{blocker}'" in lines[0], lines[0]
        assert not pruned.exists()


def test_text_faults_are_found_before_the_model_loads(tiny_dir, tmp_path, monkeypatch):
    """A bad line deep in a .jsonl, and one file of one document named for both calibration and
    evaluation, fail before the model is loaded (they failed only after loading and capture)."""
    import shuffleprune.prune.driver as driver

    def no_load(*_args, **_kw):
        raise AssertionError("the model was loaded before the texts were checked")

    monkeypatch.setattr(driver, "_load_prunable", no_load)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps({"text": f"document {i}"}) for i in range(30)) + "\n{oops\n")
    one = tmp_path / "one.txt"
    one.write_text("a")
    for args, needle in ((["--calib", str(bad)], "bad.jsonl:31: not a JSON object"),
                         (["--calib", str(one), "--eval-text", str(one)], "one.txt' is too short to split into text to fit")):
        res = runner.invoke(app, ["prune", str(tiny_dir), *args, "--out", str(tmp_path / "o"), "--quiet"])
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output
    assert not (tmp_path / "o").exists()


def test_bad_input_with_overwrite_keeps_the_earlier_output(tiny_dir, text_file, tmp_path):
    """--overwrite empties --out only once the run's inputs have loaded: a model that does not load
    (prune) or a damaged text (dst) is an error that leaves the earlier run's output as it was (both
    deleted it first)."""
    import shutil

    bad_model = tmp_path / "bad-config"   # config.json disagrees with the weights: found only when loading
    shutil.copytree(tiny_dir, bad_model)
    config = json.loads((bad_model / "config.json").read_text())
    (bad_model / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    bad_text = tmp_path / "bad.jsonl"
    bad_text.write_text('{"text": "fine"}\n{oops\n')
    cases = ((["prune", str(bad_model), "--calib", str(text_file), "--eval-text", "none"], "do not have the shapes"),
             (["dst", "--data", str(bad_text), "--tokenizer", str(tiny_dir)], "bad.jsonl:2: not a JSON object"))
    for args, needle in cases:
        earlier = tmp_path / f"earlier-{args[0]}"
        earlier.mkdir()
        (earlier / "result.txt").write_text("an earlier run's output")
        res = runner.invoke(app, [*args, "--out", str(earlier), "--overwrite", "--quiet"])
        lines = [l for l in res.output.splitlines() if l.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output
        assert [p.name for p in earlier.iterdir()] == ["result.txt"], args


def test_paths_and_messages_are_printed_as_they_are(tiny_dir, text_file, tmp_path):
    """Text from the user or a library is not rich markup or emoji codes: a model named
    'nope[red]:smile:' was shown as 'nope😄', an output dir 'o[bold]x' as 'ox'."""
    res = runner.invoke(app, ["prune", str(tmp_path / "nope[red]:smile:")])
    assert res.exit_code == 2 and f"error: model path '{tmp_path}/nope[red]:smile:' does not exist" in res.output
    out = tmp_path / "o[bold]x"
    res = runner.invoke(app, ["prune", str(tiny_dir), "--calib", str(text_file), "--nsamples", "4", "--seqlen", "32",
                              "--eval-text", "none", "--quiet", "--out", str(out)])
    assert res.exit_code == 0 and f"wrote {out} (HF checkpoint" in res.output, res.output


def test_a_quantized_checkpoint_is_refused_by_prune_and_needs_its_library_for_eval(tiny_dir, text_file, tmp_path,
                                                                                      monkeypatch):
    """prune needs full-precision weights: a quantized checkpoint (or model in memory) is refused before
    its weights are read and before --out is touched; eval names the library a quantized checkpoint needs
    in one line (it was an ImportError traceback)."""
    import shutil

    import shuffleprune
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = tmp_path / "gptq"
    shutil.copytree(tiny_dir, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (quantized / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("kept")
    res = runner.invoke(app, ["prune", str(quantized), "--calib", str(text_file), "--nsamples", "2", "--seqlen", "16",
                              "--out", str(out), "--overwrite", "--quiet"])
    assert res.exit_code == 2 and res.output.strip() == (
        f"error: '{quantized}' is quantized (gptq): pruning needs its full-precision weights; prune the unquantized "
        "model it came from (and quantize the pruned one)"), res.output
    assert (out / "earlier.txt").read_text() == "kept"
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.config.quantization_config = {"quant_method": "awq", "bits": 4}   # as a quantized model in memory says
    from shuffleprune.errors import UserError

    with pytest.raises(UserError, match=r"is quantized \(awq\)"):
        shuffleprune.prune(model, "fast", tokenizer=AutoTokenizer.from_pretrained(tiny_dir), calib=str(text_file))

    def needs_optimum(*args, **kwargs):
        raise ImportError("Loading a GPTQ quantized model requires optimum (`pip install optimum`)")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", needs_optimum)
    res = runner.invoke(app, ["eval", str(quantized), "--tasks", "ppl", "--ppl-text", str(text_file)])
    assert res.exit_code == 2 and res.output.strip() == (
        f"error: cannot load model '{quantized}': Loading a GPTQ quantized model requires optimum (`pip install "
        "optimum`)"), res.output


def test_a_model_larger_than_the_free_memory_is_warned_about_before_it_loads(tiny_dir, tmp_path, monkeypatch):
    """Loading holds the weights whole in CPU memory; a process short of it is killed without a word,
    so the shortfall is one warning line first (the run goes on: the estimate may be pessimistic)."""
    from shuffleprune.runtime import memory

    text = tmp_path / "held.txt"
    text.write_text(random_text(400, 3))
    args = ["eval", str(tiny_dir), "--tasks", "ppl", "--ppl-text", str(text)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "CPU memory" not in res.output, res.output
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1000)
    size = sum(f.stat().st_size for f in tiny_dir.glob("*.safetensors"))
    res = runner.invoke(app, args + ["--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert [l for l in res.output.splitlines() if "CPU memory" in l] == [
        f"warning: '{tiny_dir}' takes about {size / 1024:.0f} KiB of CPU memory to load (its weights are held there "
        "whole), and 1000 B is available: the process may be killed for memory"], res.output


def test_text_source_help_names_every_text_file_kind():
    """``--calib``, ``--ppl-text`` and ``--data`` write the file kinds out (importing ``calib.files`` would
    load torch at the CLI's start); each names exactly :data:`calib.files.TEXT_FILES` and gzip, so a kind
    added to the readers and not to the help fails here."""
    import typer.main

    from shuffleprune.calib.files import TEXT_FILES

    commands = typer.main.get_command(app).commands
    for command, flag in (("prune", "--calib"), ("eval", "--ppl-text"), ("dst", "--data")):
        param = next(p for p in commands[command].params if flag in p.opts)
        assert TEXT_FILES in param.help and ".gz too" in param.help, (command, flag, param.help)
