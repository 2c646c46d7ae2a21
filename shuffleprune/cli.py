"""The ``shuffleprune`` command line (thin: parse, call the library, print)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import List, Optional

import typer
from rich.text import Text

from shuffleprune.console import plain_console
from shuffleprune.errors import UserError, given_path

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="N:M sparsity for pretrained LLMs with learned input-channel permutations.")
out_console, err = plain_console(), plain_console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from shuffleprune.version import __version__

        out_console.print(f"shuffleprune {__version__}")
        raise typer.Exit()


def _ours(filename: str) -> bool:
    """Whether ``filename`` is in this package (its calib and kernels are installed beside it, or sit
    at the top of a source checkout)."""
    files = [getattr(sys.modules.get(name), "__file__", None) for name in ("shuffleprune", "shuffleprune.calib",
                                                                           "shuffleprune.kernels")]
    roots = [Path(f).resolve().parent for f in files if f]
    return any(Path(filename).resolve().is_relative_to(root) for root in roots)


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning) -> None:
    """This tool's own warnings as one ``warning: …`` line (not Python's file:line form with the
    source line); other libraries' warnings as Python prints them."""
    if issubclass(category, UserWarning) and _ours(filename):
        err.print(Text.assemble(("warning:", "bold yellow"), f" {message}"), soft_wrap=True)
    else:
        _default(message, category, filename, lineno, file, line)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the version and exit.")) -> None:
    """N:M sparsity for pretrained LLMs with learned input-channel permutations."""
    warnings.showwarning = _show_warning


def _fail(exc: Exception) -> None:
    err.print(Text.assemble(("error:", "bold red"), f" {exc}"), soft_wrap=True)
    raise typer.Exit(2)


def _path(value: Optional[str], flag: str) -> Optional[Path]:
    """A path option as a Path (None stays None); an empty one is a one-line error (Path("") is the current
    directory). Path options are read as text for this: typer's own Path type turns "" into "."."""
    try:
        return given_path(value, flag)
    except UserError as exc:
        _fail(exc)


_TRUST_HELP = ("Run the model, configuration and tokenizer code the checkpoint ships (its config.json's auto_map), "
               "as transformers' trust_remote_code: only for a model you trust.")
_DATA, _OUT, _RUN, _RARE = "Data and evaluation", "Output", "Compute and selection", "Rare knobs (prefer a recipe file or --set)"


@app.command()
def prune(
    model: Optional[str] = typer.Argument(None, help="Hub id, local HF dir or .gguf file; omit for the embedded SmolLM2-135M-Instruct."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="fast (Wanda + swap search), balanced (SparseGPT + swap search), accurate (balanced, then a masked least-squares update of the kept weights; the default), paper (ShuffleSparse: learned block permutations, Wanda), best (balanced, then block reconstruction of the kept weights against the unpruned model; slow), learned (permutations learned on the whole model + SparseGPT), or a recipe .yaml (e.g. an earlier run's OUT/recipe.yaml)."),
    base: Optional[str] = typer.Option(None, "--base", help="Mask and weight update: magnitude, wanda, sparsegpt or gradual (gradual OBS masks inside the exact least-squares update; overrides the recipe's)."),
    pattern: Optional[str] = typer.Option(None, "--pattern", help="N:M pattern: keep N of every M input columns", show_default="2:4"),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="Unstructured sparsity instead of N:M (e.g. 0.5); no permutation."),
    perm: Optional[str] = typer.Option(None, "--perm", help="Input-channel permutation: none, random, search or learned (overrides the recipe's; none turns it off)."),
    perm_from: Optional[str] = typer.Option(None, "--perm-from", metavar="<path>", help="Reuse the index maps of an earlier run's output dir instead of computing them."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override any stage: KIND=NAME or KIND.PARAM=VALUE, e.g. --set permutation.steps=200 (repeatable)."),
    trust_remote_code: Optional[bool] = typer.Option(None, "--trust-remote-code", help=_TRUST_HELP),
    calib: Optional[str] = typer.Option(None, "--calib", rich_help_panel=_DATA, help="Calibration text: c4, wikitext2 (hub), any hub dataset OWNER/NAME[:CONFIG][@SPLIT[START:STOP]] with a text or chat (messages) column, wiki, brown (offline), or a .txt, .jsonl, .json, .csv, .tsv or .parquet file (.gz too) or a directory of them (used whole; a downloaded dataset's split: DIR@SPLIT[START:STOP])", show_default="wiki"),
    nsamples: Optional[int] = typer.Option(None, "--nsamples", rich_help_panel=_DATA, help="Calibration windows", show_default="128"),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", rich_help_panel=_DATA, help="Calibration window length in tokens, capped by the model's context", show_default="2048"),
    seed: Optional[int] = typer.Option(None, "--seed", rich_help_panel=_DATA, help="Seed of the calibration windows (and every random choice)", show_default="0"),
    eval_text: Optional[str] = typer.Option(None, "--eval-text", rich_help_panel=_DATA, help="Perplexity text (a file, or a hub split's rows, is used whole; the same as --calib is split), 'none' to skip", show_default="auto = wikitext2 for hub calibration, else the other offline source"),
    eval_ctx: Optional[int] = typer.Option(None, "--eval-ctx", rich_help_panel=_DATA, help="Perplexity window length", show_default="--seqlen"),
    eval_tokens: Optional[int] = typer.Option(None, "--eval-tokens", rich_help_panel=_DATA, help="Score at most this many held-out tokens", show_default="all of the text; c4: 256 windows, as the papers"),
    bos: Optional[str] = typer.Option(None, "--bos", rich_help_panel=_DATA, help="For tokenizers that add a BOS token (LLaMA, Gemma, …): window (every calibration and perplexity window starts with it, as lm-eval) or text (only the start of each text, as SparseGPT's and Wanda's loaders: their numbers)", show_default="window"),
    out: Optional[str] = typer.Option(None, "--out", rich_help_panel=_OUT, metavar="<path>", help="Write the pruned HF checkpoint, prune_report.json, recipe.yaml and a README.md card here."),
    export: Optional[str] = typer.Option(None, "--export", rich_help_panel=_OUT, metavar="<path>", help="Also write the deployable compressed N:M checkpoint here (needs --out)."),
    resume: bool = typer.Option(False, "--resume", rich_help_panel=_OUT, help="Continue an interrupted run from its last finished block in --out."),
    overwrite: bool = typer.Option(False, "--overwrite", rich_help_panel=_OUT,
                                   help="Replace a non-empty --out (never one holding an input)."),
    plots: Optional[str] = typer.Option(None, "--plots", rich_help_panel=_OUT, metavar="<path>", help="With a permutation: write strength / penalty / loss PNGs here."),
    device: Optional[str] = typer.Option(None, "--device", rich_help_panel=_RUN, help="auto, cpu, cuda or cuda:N (one block at a time on it)", show_default="auto"),
    dtype: Optional[str] = typer.Option(None, "--dtype", rich_help_panel=_RUN, help="auto (the checkpoint's dtype; float32 computing on CPU; GGUF saved as bfloat16), float32, bfloat16, float16."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", rich_help_panel=_RUN, help="Calibration windows per block forward", show_default="8"),
    only: Optional[List[str]] = typer.Option(None, "--only", rich_help_panel=_RUN, help="Prune only linears and MoE experts whose full name matches this glob (repeatable; experts are named like model.layers.0.mlp.experts.down_proj[3])."),
    skip: Optional[List[str]] = typer.Option(None, "--skip", rich_help_panel=_RUN, help="Do not prune linears or MoE experts whose full name matches this glob (repeatable; e.g. '*experts*')."),
    tf32: Optional[bool] = typer.Option(None, "--tf32", rich_help_panel=_RUN, help="On CUDA: TF32 float32 matmuls (faster permutation learning)."),
    deterministic: Optional[bool] = typer.Option(None, "--deterministic", rich_help_panel=_RUN, help="PyTorch's deterministic algorithms: the same command repeats bit for bit on a GPU too (slower there; CPU runs repeat without it)."),
    quiet: bool = typer.Option(False, "--quiet", rich_help_panel=_RUN, help="No progress bars."),
    recon: Optional[str] = typer.Option(None, "--recon", hidden=True),
    perm_init: Optional[str] = typer.Option(None, "--perm-init", hidden=True),
    perm_loss: Optional[str] = typer.Option(None, "--perm-loss", hidden=True),
    relax: Optional[str] = typer.Option(None, "--relax", hidden=True),
    perm_block: Optional[int] = typer.Option(None, "--perm-block", hidden=True),
    perm_steps: Optional[int] = typer.Option(None, "--perm-steps", hidden=True),
    perm_lr: Optional[float] = typer.Option(None, "--perm-lr", hidden=True),
    perm_lr_decay: Optional[str] = typer.Option(None, "--perm-lr-decay", hidden=True),
    perm_lambda: Optional[float] = typer.Option(None, "--perm-lambda", hidden=True),
    perm_share: Optional[str] = typer.Option(None, "--perm-share", hidden=True),
    perm_batch: Optional[int] = typer.Option(None, "--perm-batch", hidden=True),
    perm_holdout: Optional[float] = typer.Option(None, "--perm-holdout", hidden=True),
    mask_stats: Optional[str] = typer.Option(None, "--mask-stats", hidden=True),
) -> None:
    """Prune a model one-shot to N:M (or unstructured) sparsity, block by block, and report perplexity.

    Rare knobs, hidden here and kept for scripts, set recipe stage parameters
    (README → Recipes): --recon, --perm-init, --perm-loss, --relax, --perm-block,
    --perm-steps, --perm-lr, --perm-lr-decay, --perm-lambda, --perm-share,
    --perm-batch, --perm-holdout, --mask-stats.
    """
    from shuffleprune.deploy.export import check_export_target
    from shuffleprune.plots import check_plot_dir
    from shuffleprune.prune import PruneConfig, prune as run_prune, resumable
    from shuffleprune.report import print_prune_report

    if export is not None and (out is None or sparsity is not None):
        _fail(UserError("--export needs --out DIR and an N:M --pattern"))
    out, export, plots = (_path(value, flag) for value, flag in ((out, "--out"), (export, "--export"), (plots, "--plots")))
    try:
        given = dict(model=model, pattern=pattern, sparsity=sparsity, calib=calib, nsamples=nsamples, seqlen=seqlen,
                     seed=seed, only=only or None, skip=skip or None, dtype=dtype, eval_text=eval_text,
                     eval_ctx=eval_ctx, eval_tokens=eval_tokens, device=device, batch_size=batch_size, tf32=tf32,
                     deterministic=deterministic, bos=bos, trust_remote_code=trust_remote_code)
        given = {k: v for k, v in given.items() if v is not None}  # what was typed overrides the recipe
        config = PruneConfig.build(
            recipe, overrides=list(set_ or []), **given, method=base, perm=perm, perm_from=perm_from, recon=recon,
            perm_init=perm_init, perm_loss=perm_loss, relax=relax, perm_block=perm_block, perm_steps=perm_steps,
            perm_lr=perm_lr, perm_lr_decay=perm_lr_decay, perm_lambda=perm_lambda, perm_share=perm_share,
            perm_batch=perm_batch, perm_holdout=perm_holdout, mask_stats=mask_stats)
        if plots is not None:   # these before pruning, not after an hour of it
            if config.stage_name("permutation") is None:
                raise UserError("--plots draws the run's permutations and this run has none (--perm none or --sparsity)")
            check_plot_dir(plots)
        if export is not None:
            if config.sparsity is not None:
                raise UserError("--export needs an N:M pattern; the recipe sets unstructured sparsity")
            check_export_target(export, out, overwrite)
        if out is None:   # said before the run, not after it
            warnings.warn("no --out: the pruned model is scored, then not saved; pass --out DIR to keep it")
        result = run_prune(config, out=out, resume=resume, overwrite=overwrite, progress=not quiet)
    except UserError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        if resumable(out):
            err.print(f"interrupted; continue with the same command plus --resume (state in {out})", soft_wrap=True)
        else:
            err.print("interrupted before the first checkpoint; nothing to resume: rerun the same command", soft_wrap=True)
        raise typer.Exit(130)
    print_prune_report(result.report, out_console)
    if out is not None:
        out_console.print(f"wrote {out} (HF checkpoint, prune_report.json, recipe.yaml, README.md)", soft_wrap=True)
    if plots is not None:
        _write_plots(result.report, plots)
    if export is not None:
        _export(out, export, overwrite, progress=not quiet, trust_remote_code=config.trust_remote_code)


def _export(pruned: Path, out: Path, overwrite: bool, pattern: Optional[str] = None, fold: bool = True,
            progress: bool = True, trust_remote_code: bool = False) -> None:
    from shuffleprune.deploy.export import export_checkpoint

    try:
        fmt = export_checkpoint(pruned, out, pattern=pattern, fold=fold, overwrite=overwrite, progress=progress,
                                trust_remote_code=trust_remote_code)
    except UserError as exc:
        _fail(exc)
    dense = sum(f.stat().st_size for f in pruned.glob("*.safetensors") if f.name != "index_maps.safetensors")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    experts = sum(e["experts"] for e in fmt["experts"].values())
    out_console.print(f"wrote {out}: {len(fmt['layers'])} {fmt['pattern']} layers, "
                      f"{len(fmt['runtime_gathers'])} with a runtime gather, {len(fmt['folded'])} permutations folded"
                      f"{f', {experts} MoE expert matrices' if experts else ''}; "
                      f"{size / 2**20:.1f} MiB (pruned checkpoint {dense / 2**20:.1f} MiB)", soft_wrap=True)


@app.command()
def export(
    pruned: str = typer.Argument(..., help="A directory written by `shuffleprune prune --out` (or `dst --out`, `finetune --out`)."),
    out: Optional[str] = typer.Argument(None, show_default=False, help="Where to write the compressed checkpoint (or --out, as prune, eval and dst take it)."),
    out_option: Optional[str] = typer.Option(None, "--out", show_default=False, metavar="<path>", help="The same as OUT."),
    pattern: Optional[str] = typer.Option(None, "--pattern", help="N:M pattern (default: the one in prune_report.json)."),
    fold: bool = typer.Option(True, "--fold/--no-fold", help="Fold input permutations into producer rows where the logits stay the same."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty OUT (never one holding an input)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help=_TRUST_HELP),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
) -> None:
    """Write a deployable N:M checkpoint: compressed values + 2-bit positions + index maps (load with shuffleprune.load)."""
    if (out is None) == (out_option is None):
        _fail(UserError("give where to write the checkpoint once: shuffleprune export PRUNED OUT, or PRUNED --out OUT"))
    _export(_path(pruned, "PRUNED"), _path(out if out is not None else out_option, "OUT"), overwrite, pattern, fold,
            progress=not quiet, trust_remote_code=trust_remote_code)


def _write_plots(report: dict, plots: Path) -> None:
    from shuffleprune.plots import plot_perm_report

    try:
        paths = plot_perm_report(report, plots)
    except UserError as exc:
        _fail(exc)
    out_console.print("wrote " + ", ".join(str(p) for p in paths), soft_wrap=True)


@app.command()
def report(
    pruned: str = typer.Argument(..., help="A directory written by `shuffleprune prune --out` (or `dst --out`, `finetune --out`)."),
    plots: Optional[str] = typer.Option(None, "--plots", metavar="<path>", help="Write permutation PNGs (strength vs depth, penalty and loss curves) here."),
) -> None:
    """Show a pruned checkpoint's report again and draw its permutation pictures (or a dst run's curves)."""
    from shuffleprune.report import print_prune_report, read_report, training_summary

    pruned, plots = _path(pruned, "PRUNED"), _path(plots, "--plots")
    try:
        if (pruned / "dst_report.json").is_file():  # a `dst` run directory
            from shuffleprune.plots import plot_dst_report

            rep = read_report(pruned / "dst_report.json")
            out_console.print(training_summary(rep), soft_wrap=True)
            if plots is not None:
                out_console.print("wrote " + ", ".join(str(p) for p in plot_dst_report(rep, plots)), soft_wrap=True)
            return
        path = pruned / "prune_report.json"
        if not path.is_file():
            run_dir = pruned.parent if (pruned.parent / "dst_report.json").is_file() else None
            raise UserError(f"no prune_report.json (nor a dst run's dst_report.json) in '{pruned}'; " +
                            (f"give '{run_dir}', the dst run it belongs to" if run_dir is not None else
                             "give a directory written by `shuffleprune prune --out` or `shuffleprune dst --out`"))
        rep = read_report(path)
    except UserError as exc:
        _fail(exc)
    print_prune_report(rep, out_console)
    if plots is not None:
        _write_plots(rep, plots)


def _split_csv(values: Optional[List[str]]) -> List[str]:
    return [t.strip() for v in values or [] for t in v.split(",") if t.strip()]


@app.command("eval")
def eval_(
    models: Optional[List[str]] = typer.Argument(None, help="Models to compare: hub ids, HF dirs, pruned dirs or .gguf files; 'default' (or nothing) = the embedded SmolLM2-135M-Instruct."),
    tasks: Optional[List[str]] = typer.Option(None, "--tasks", help="Comma-separated lm-eval tasks; 'ppl' = held-out perplexity. Default: hellaswag,arc_easy,arc_challenge,openbookqa,ppl."),
    limit: Optional[float] = typer.Option(None, "--limit", help="lm-eval --limit: at most this many items per task (below 1: a fraction)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="The model the others are compared with item by item (paired differences ± their standard error); default: the first."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="Few-shot examples (default: each task's own, 0 for the paper's tasks)."),
    batch_size: int = typer.Option(8, "--batch-size", help="lm-eval batch size."),
    apply_chat_template: bool = typer.Option(False, "--apply-chat-template", help="lm-eval --apply_chat_template: each item (and its few-shot examples, as turns) through the model's chat template, for instruct models."),
    offline: bool = typer.Option(False, "--offline", help="Use local task data even if the hub is reachable (automatic when it is not)."),
    include_path: Optional[List[str]] = typer.Option(None, "--include-path", help="Extra directory of lm-eval task YAMLs (repeatable)."),
    ppl_text: str = typer.Option("auto", "--ppl-text", help="Perplexity text: auto (wikitext2 online, brown offline), wikitext2, c4, a hub dataset OWNER/NAME[:CONFIG][@SPLIT[START:STOP]], wiki, brown, a .txt, .jsonl, .json, .csv, .tsv or .parquet path (.gz too) or a directory of such files."),
    ppl_ctx: int = typer.Option(2048, "--ppl-ctx", help="Perplexity window length (capped by the model's context)."),
    ppl_bos: str = typer.Option("window", "--ppl-bos", help="For tokenizers that add a BOS token: window (every perplexity window starts with it, as lm-eval) or text (only the start of the text, as SparseGPT's and Wanda's loaders)."),
    ppl_tokens: Optional[int] = typer.Option(None, "--ppl-tokens", help="Use at most this many held-out tokens (default: the whole test split; c4: 256 windows, as the papers)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (checkpoint dtype; float32 on CPU), float32, bfloat16, float16."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help=_TRUST_HELP),
    out: Optional[str] = typer.Option(None, "--out", metavar="<path>", help="Write results JSON here, and the table as Markdown next to it (.md)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
    verbose: bool = typer.Option(False, "--verbose", help="Show lm-eval's own log."),
) -> None:
    """Score models side by side: zero-shot accuracy via lm-evaluation-harness, plus held-out perplexity."""
    from shuffleprune.evaluation.config import DEFAULT_TASKS, EvalConfig
    from shuffleprune.evaluation.evaluate import evaluate_models
    from shuffleprune.report import print_eval_report

    out = _path(out, "--out")
    if limit is not None and limit >= 1 and float(limit).is_integer():
        limit = int(limit)  # a count of items, as lm-eval's CLI records it
    config = EvalConfig(models=list(models) if models else [None],
                        tasks=list(DEFAULT_TASKS) if tasks is None else _split_csv(tasks), limit=limit,
                        num_fewshot=num_fewshot, batch_size=batch_size, device=device, dtype=dtype, offline=offline,
                        include_path=list(include_path) if include_path else None, ppl_text=ppl_text,
                        ppl_ctx=ppl_ctx, ppl_tokens=ppl_tokens, ppl_bos=ppl_bos, apply_chat_template=apply_chat_template,
                        trust_remote_code=trust_remote_code, baseline=baseline)
    try:
        results = evaluate_models(config, out=out, progress=not quiet,
                                  notify=lambda msg: err.print(msg, soft_wrap=True),
                                  verbose=verbose)
    except UserError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        err.print("interrupted; nothing written", soft_wrap=True)
        raise typer.Exit(130)
    print_eval_report(results, out_console)
    if out is not None:
        out_console.print(f"wrote {out} and {out.with_suffix('.md')}", soft_wrap=True)


def _config_kw(pairs: Optional[List[str]]) -> dict:
    import json

    out = {}
    for pair in _split_csv(pairs):
        key, sep, value = pair.partition("=")
        if not sep:
            _fail(UserError(f"--config-kw expects key=value, got '{pair}'"))
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@app.command()
def dst(
    out: str = typer.Option(..., "--out", metavar="<path>", help="Run directory: checkpoint.pt, dst_report.json, model/."),
    arch: str = typer.Option("gpt2", "--arch", help="transformers model type (gpt2, llama, …) or a config dir / hub id."),
    config_kw: Optional[List[str]] = typer.Option(None, "--config-kw", help="Config overrides key=value (comma-separated or repeated), e.g. n_layer=12,n_embd=768,n_head=12."),
    tokenizer: str = typer.Option("default", "--tokenizer", help="Tokenizer: default (the embedded model's), bpe:N (byte-level BPE with N tokens trained on the training text), a dir, a .gguf file or a hub id."),
    data: str = typer.Option("wiki", "--data", help="Text: wikitext103 (hub, as the papers), a hub dataset OWNER/NAME[:CONFIG][@SPLIT[START:STOP]], wiki, brown (offline), or a .txt, .jsonl, .json, .csv, .tsv or .parquet path (.gz too) or a directory of them (every 10th document held out for the perplexity; one document: its last tenth)."),
    method: str = typer.Option("rigl", "--method", help="dense, rigl, set, srigl, dsb, pixelfly, diag or nm (N:M, exportable)."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="Global sparsity of the sparsified layers (default 0.9; nm: 1 − N/M)."),
    pattern: str = typer.Option("2:4", "--pattern", help="nm: keep N of every M consecutive inputs."),
    distribution: str = typer.Option("erk", "--distribution", help="Layer-wise densities: erk or uniform."),
    delta_t: int = typer.Option(100, "--delta-t", help="Steps between mask updates."),
    alpha: float = typer.Option(0.3, "--alpha", help="Initial drop fraction (cosine-decayed)."),
    t_end: Optional[int] = typer.Option(None, "--t-end", help="Last mask update step (default: 75% of --steps)."),
    block: int = typer.Option(16, "--block", help="dsb block size."),
    perm: str = typer.Option("none", "--perm", help="Input permutation for column-structured methods: none, random or learned."),
    perm_lr: float = typer.Option(1e-3, "--perm-lr", help="Adam learning rate of the soft permutations."),
    lambda_max: float = typer.Option(1e-4, "--lambda-max", help="l1−l2 penalty weight (ramped from 0 over --t-perm)."),
    t_perm: Optional[int] = typer.Option(None, "--t-perm", help="Permutation learning ends here (default: half of --steps)."),
    delta: float = typer.Option(0.22, "--delta", help="A layer's permutation hardens once P(M) < delta."),
    perm_init: float = typer.Option(0.5, "--perm-start", help="α of the soft start α·I + (1−α)/d·11ᵀ of learned permutations (1: identity; 0: uniform, which maps each input to its mean: zero after a LayerNorm without bias)."),
    sparse_head: bool = typer.Option(False, "--sparse-head", help="Also sparsify an untied LM head (default: dense, as prune keeps it; export compresses it)."),
    seq_len: int = typer.Option(256, "--seq-len", help="Training and evaluation window length in tokens."),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per step in all (split over the processes of a distributed run)."),
    steps: int = typer.Option(1000, "--steps", help="Optimizer steps."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak AdamW learning rate (linear warmup, then cosine decay)."),
    warmup: int = typer.Option(100, "--warmup", help="Learning-rate warmup steps."),
    eval_every: int = typer.Option(200, "--eval-every", help="Steps between held-out perplexities (0: only at the end)."),
    eval_tokens: Optional[int] = typer.Option(65536, "--eval-tokens", help="Held-out tokens for perplexity."),
    checkpoint_every: int = typer.Option(200, "--checkpoint-every", help="Steps between checkpoints for --resume (0: only at the end)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initialisation and every random choice."),
    deterministic: bool = typer.Option(False, "--deterministic", help="PyTorch's deterministic algorithms: the same command repeats bit for bit on a GPU too (slower there)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help=_TRUST_HELP.replace("checkpoint ships", "--arch or --tokenizer checkpoint ships")),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoint.pt (same options)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty OUT (never one holding an input)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Dynamic sparse training from scratch (RigL-style schedules, structured masks, learned permutations)."""
    from shuffleprune.calib import held_out_part
    from shuffleprune.dst.config import DSTConfig, TrainConfig
    from shuffleprune.dst.train import is_main_process, train

    out = _path(out, "--out")
    cfg = TrainConfig(arch=arch, config_kw=_config_kw(config_kw), tokenizer=tokenizer, data=data, seq_len=seq_len,
                      batch_size=batch_size, steps=steps, lr=lr, warmup=warmup, eval_every=eval_every,
                      eval_tokens=eval_tokens, checkpoint_every=checkpoint_every, seed=seed,
                      trust_remote_code=trust_remote_code)
    try:
        dcfg = DSTConfig(method=method, sparsity=sparsity, pattern=pattern, distribution=distribution, delta_t=delta_t, alpha=alpha,
                         t_end=t_end if t_end is not None else int(0.75 * steps), block=block, perm=perm,
                         perm_lr=perm_lr, lambda_max=lambda_max, t_perm=t_perm if t_perm is not None else steps // 2,
                         delta=delta, perm_init=perm_init, sparse_head=sparse_head, seed=seed)
        dcfg.check()
        report = train(cfg, dcfg, out, resume=resume, overwrite=overwrite, progress=not quiet,
                       deterministic=deterministic)
    except UserError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        err.print(f"interrupted; continue with the same command plus --resume (checkpoint in {out})", soft_wrap=True)
        raise typer.Exit(130)
    if is_main_process():   # one line, from the main process
        out_console.print(f"final ppl {report['final_ppl']:.2f} ({data}, {held_out_part(data, split_from_shared=True)}, ctx {seq_len}), density {report['density']:.4f}, "
                          f"{report['train_seconds']:.0f} s; wrote {out}", soft_wrap=True)


@app.command()
def finetune(
    pruned: str = typer.Argument(..., metavar="pruned", help="A pruned checkpoint (a prune --out dir, a dst run's model/, a hub id)."),
    out: str = typer.Option(..., "--out", help="Run directory: model/ (the fine-tuned checkpoint), dst_report.json, checkpoint.pt."),
    data: str = typer.Option("wiki", "--data", help="Text: a hub dataset OWNER/NAME[:CONFIG][@SPLIT[START:STOP]], wikitext103, c4, wiki, brown (offline), or a .txt, .jsonl, .json, .csv, .tsv or .parquet path (.gz too) or a directory of them (every 10th document held out for the perplexity)."),
    steps: int = typer.Option(200, "--steps", help="Optimizer steps."),
    lr: float = typer.Option(1e-4, "--lr", help="Peak AdamW learning rate (linear warmup, then cosine decay)."),
    warmup: int = typer.Option(20, "--warmup", help="Learning-rate warmup steps."),
    seq_len: int = typer.Option(512, "--seq-len", help="Training and evaluation window length in tokens."),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per step in all (split over the processes of a distributed run)."),
    eval_every: int = typer.Option(50, "--eval-every", help="Steps between held-out perplexities (0: only before and at the end)."),
    eval_tokens: Optional[int] = typer.Option(65536, "--eval-tokens", help="Held-out tokens for perplexity."),
    checkpoint_every: int = typer.Option(50, "--checkpoint-every", help="Steps between checkpoints for --resume (0: only at the end)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the training windows."),
    deterministic: bool = typer.Option(False, "--deterministic", help="PyTorch's deterministic algorithms: the same command repeats bit for bit on a GPU too (slower there)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help=_TRUST_HELP),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoint.pt (same options)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty OUT (never one holding an input)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Fine-tune a pruned checkpoint's kept weights on text, its zeros held (the N:M pattern and index maps stay valid)."""
    from shuffleprune.calib import held_out_part
    from shuffleprune.dst.finetune import finetune as finetune_checkpoint
    from shuffleprune.dst.train import is_main_process
    from shuffleprune.report import ppl_change

    out = _path(out, "--out")
    try:
        report = finetune_checkpoint(pruned, out, data=data, steps=steps, lr=lr, warmup=warmup, seq_len=seq_len,
                                     batch_size=batch_size, eval_every=eval_every, eval_tokens=eval_tokens,
                                     checkpoint_every=checkpoint_every, seed=seed, trust_remote_code=trust_remote_code,
                                     resume=resume, overwrite=overwrite, progress=not quiet, deterministic=deterministic)
    except UserError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        err.print(f"interrupted; continue with the same command plus --resume (checkpoint in {out})", soft_wrap=True)
        raise typer.Exit(130)
    if is_main_process():
        out_console.print(f"ppl {ppl_change(report)} ({data}, {held_out_part(data, split_from_shared=True)}, "
                          f"ctx {seq_len}), density {report['density']:.4f} held, {report['train_seconds']:.0f} s; "
                          f"wrote {out / 'model'}", soft_wrap=True)


def main() -> None:  # pragma: no cover
    app(prog_name="shuffleprune")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
