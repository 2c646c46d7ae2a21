"""lm-evaluation-harness for ``eval``: task names checked and their data placed (stock, local copies offline,
or the user's YAMLs), a model in memory scored, its results read into rows, and the ``lm_eval`` command
that would score the same."""
from __future__ import annotations

import difflib
import logging
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

from shuffleprune.errors import UserError
from shuffleprune.evaluation.config import PPL, EvalConfig
from shuffleprune.evaluation.offline_tasks import OFFLINE_TASKS, build_offline_tasks, local_name, stock_name
from shuffleprune.evaluation.paired import item_scores
from shuffleprune.models import LoadedModel
from shuffleprune.perm.linear import INDEX_MAPS, weights_stored_permuted
from shuffleprune.quiet import lm_eval_progress_bars

# The metric each task is reported with (the paper's choice for its four; acc elsewhere).
HEADLINE = {"hellaswag": "acc", "arc_easy": "acc", "arc_challenge": "acc_norm", "openbookqa": "acc_norm",
            "piqa": "acc", "winogrande": "acc", "boolq": "acc", "lambada_openai": "acc"}
LM_EVAL_SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234,
                 "fewshot_random_seed": 1234}  # lm-eval's own defaults, so the CLI gives the same numbers


@dataclass
class TaskPlan:
    """What lm-eval runs: the names it is handed, the name each is shown by, where each one's data comes from, the
    task directories, and lm-eval's task manager (None for perplexity alone)."""

    lm_tasks: list[str]          # names handed to lm-eval
    display: dict[str, str]      # lm-eval name → name shown and stored
    origins: dict[str, str]      # shown name → where its data came from
    include_path: list[str]
    task_manager: object


def plan_tasks(config: EvalConfig, offline: bool) -> TaskPlan:
    """Check every task name against lm-eval's index and decide where its data comes from."""
    names = [t for t in dict.fromkeys(config.tasks) if t != PPL]
    user_paths = [str(Path(p).resolve()) for p in config.include_path or []]
    if not names:   # perplexity alone: lm-eval is not imported (nor its task index built)
        return TaskPlan([], {}, {}, user_paths, None)
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=user_paths or None)
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        near = {n: difflib.get_close_matches(n, tm.all_tasks, n=1) for n in unknown}
        hint = "; ".join(f"{n}: did you mean {m[0]}?" for n, m in near.items() if m)
        raise UserError(f"unknown task(s) {', '.join(unknown)}{f' ({hint})' if hint else ''}; see `lm_eval ls tasks`, "
                        "or add --include-path DIR for your own task YAMLs")

    def from_user(name: str) -> bool:
        entry = tm.task_index[name]
        return entry.yaml_path is not None and any(
            str(Path(entry.yaml_path).resolve()).startswith(p + os.sep) for p in user_paths)

    if not offline:
        origins = {n: "local task (--include-path)" if from_user(n) else
                   f"hub: {tm.task_index[n].cfg.get('dataset_path') if tm.task_index[n].cfg else 'lm-eval default'}"
                   for n in names}
        return TaskPlan(names, {n: n for n in names}, origins, user_paths, tm)
    need_local = [n for n in names if not from_user(n)]
    missing = [n for n in need_local if n not in OFFLINE_TASKS]
    if missing:
        raise UserError(f"task(s) {', '.join(missing)} need the Hugging Face hub; offline tasks: "
                        f"{', '.join(OFFLINE_TASKS)} (or your own via --include-path)")
    if need_local and config.num_fewshot:
        raise UserError("offline task data has no training split to draw few-shot examples from; "
                        "use --num-fewshot 0 offline (the paper's setting) or run with the hub")
    stock_paths = {n: Path(tm.task_index[n].yaml_path) for n in need_local}
    local_dir = str(build_offline_tasks(need_local, stock_paths)) if need_local else None
    paths = user_paths + ([local_dir] if local_dir else [])
    tm = TaskManager(include_path=paths)
    lm_tasks = [local_name(n) if n in need_local else n for n in names]
    display = dict(zip(lm_tasks, names))
    origins = {n: OFFLINE_TASKS[n].origin if n in need_local else "local task (--include-path)" for n in names}
    return TaskPlan(lm_tasks, display, origins, paths, tm)


def metric_table(task_results: dict) -> dict[str, float]:
    """``{"acc,none": .5, "acc_stderr,none": .1, "alias": …}`` → ``{"acc": .5, "acc_stderr": .1}``; a metric of
    another filter keeps lm-eval's name (gsm8k's ``exact_match,strict-match`` and ``exact_match,flexible-extract``
    are two numbers, not one)."""
    out = {}
    for key, value in task_results.items():
        if "," not in key or not isinstance(value, (int, float)):
            continue
        metric, filter_name = key.split(",", 1)
        name = metric if filter_name == "none" else key
        out[name] = None if isinstance(value, float) and math.isnan(value) else value
    return out


def stderr_name(metric: str) -> str:
    """The name of ``metric``'s standard error in ``metric_table``: ``acc`` → ``acc_stderr``,
    ``exact_match,strict-match`` → ``exact_match_stderr,strict-match``."""
    base, sep, filter_name = metric.partition(",")
    return f"{base}_stderr{sep}{filter_name}"


def headline_metric(task: str, metrics: dict[str, float]) -> str:
    want = HEADLINE.get(task)
    if want in metrics:
        return want
    return next((m for m in metrics if not m.partition(",")[0].endswith("_stderr")), "")


def quiet_lm_eval(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.ERROR
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(level)


def score_lm_eval(lm: LoadedModel, plan: TaskPlan, config: EvalConfig, progress: bool) -> dict:
    """``plan``'s lm-eval tasks scored on ``lm`` by lm-eval's ``simple_evaluate`` (its bars shown only with
    ``progress``): per task its headline metric, every metric, each item's score (``items``, "0110…" in
    doc-id order, where the metric is right/wrong per item) and what lm-eval says of the run."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    wrapper = HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=config.batch_size)
    # lm-eval records the git commit of the working directory (unused here) by running `git describe`,
    # whose "fatal: not a git repository" would reach the user's terminal outside a repository
    with (patch("lm_eval.evaluator.get_git_commit_hash", return_value=None, create=True),
          lm_eval_progress_bars(progress)):
        raw = simple_evaluate(model=wrapper, tasks=plan.lm_tasks, num_fewshot=config.num_fewshot,
                              limit=config.limit, task_manager=plan.task_manager, log_samples=True,
                              apply_chat_template=config.apply_chat_template,
                              fewshot_as_multiturn=config.apply_chat_template, **LM_EVAL_SEEDS)   # as lm_eval's CLI
    return nested_results(raw, plan)


def nested_results(raw: dict, plan: TaskPlan) -> dict:
    """lm-eval's results as rows: the tasks asked for (a group as one row, its score lm-eval's aggregate)
    with a group's tasks under its ``subtasks``; each with its items' scores where they are right/wrong."""
    samples = raw.get("samples") or {}   # per item, for the paired differences (evaluation.paired)
    children = raw.get("group_subtasks") or {}

    def shown(lm_name: str) -> str:   # the name a task is shown and stored by
        return plan.display.get(lm_name, stock_name(lm_name))

    def leaves(lm_name: str) -> list[str]:   # a group's tasks, through its nested groups
        kids = children.get(lm_name)
        return [leaf for kid in kids for leaf in leaves(kid)] if kids else [lm_name]

    def entry(lm_name: str) -> dict:
        res = raw["results"][lm_name]
        name = shown(lm_name)
        metrics = metric_table(res)
        headline = headline_metric(name, metrics)
        n = raw.get("n-samples", {}).get(lm_name, {})
        row = {
            "metric": headline, "value": metrics.get(headline), "stderr": metrics.get(stderr_name(headline)),
            "metrics": metrics, "lm_eval_task": lm_name,
            "version": raw.get("versions", {}).get(lm_name), "n_shot": raw.get("n-shot", {}).get(lm_name),
            "n_items": n.get("effective"), "n_items_total": n.get("original"),
            "higher_is_better": raw.get("higher_is_better", {}).get(lm_name, {}),
            "data": plan.origins.get(name, plan.origins.get(stock_name(lm_name), "")),
            "items": item_scores(samples[lm_name], headline) if lm_name in samples else None,
        }
        kids = [k for k in children.get(lm_name, []) if k in raw["results"]]
        if kids:
            row["subtasks"] = {shown(k): entry(k) for k in kids}
            tasks = leaves(lm_name)
            counts = [raw.get("n-samples", {}).get(t, {}) for t in tasks]
            row["n_items"] = sum(c.get("effective") or 0 for c in counts) or None
            row["n_items_total"] = sum(c.get("original") or 0 for c in counts) or None
            row["items"], row["aggregate"] = group_items(
                [item_scores(samples[t], headline) if t in samples else None for t in tasks],
                [sub["metrics"].get(headline) for sub in row["subtasks"].values()], row["value"])
        return row

    nested = {kid for kids in children.values() for kid in kids}
    return {shown(n): entry(n) for n in raw["results"] if n not in nested}


def group_items(leaf_items: list[str | None], subtask_values: list[float | None],
                value: float | None) -> tuple[str | None, str | None]:
    """How a group's score comes from its tasks, and its items' scores where it is their mean: ``"mean of
    items"`` (lm-eval's ``weight_by_size``: the items of all its tasks, in order), ``"mean of subtasks"``
    (each task weighs the same), or None (another aggregate)."""
    if value is None:
        return None, None
    if leaf_items and all(leaf_items):
        joined = "".join(leaf_items)
        if abs(joined.count("1") / len(joined) - value) < 1e-9:
            return joined, "mean of items"
    if subtask_values and None not in subtask_values and abs(sum(subtask_values) / len(subtask_values) - value) < 1e-9:
        return None, "mean of subtasks"
    return None, None


def equivalent_cli(path: str, dtype: str, plan: TaskPlan, config: EvalConfig, device: str,
                    repo_id: str | None = None) -> str | None:
    """The ``lm_eval`` command that scores the same model on the same tasks (None when lm-eval's
    CLI cannot express it: it takes a single ``--include_path``, and its ``hf`` loader does not
    apply the index maps of a ``--perm`` checkpoint of the older, permuted-weights layout). An
    exported checkpoint loads through its ``auto_map`` (``trust_remote_code=True``), as a model does whose own code
    ``eval`` was told to trust. A model given
    as a hub ``repo_id`` is named by it (``path`` is then its local snapshot)."""
    from shuffleprune.deploy.load import is_exported

    maps = Path(path) / INDEX_MAPS
    if len(plan.include_path) > 1 or (maps.is_file() and weights_stored_permuted(maps)):
        return None
    trusted = is_exported(path) or config.trust_remote_code
    model_args = f"pretrained={repo_id or path},dtype={dtype}" + (",trust_remote_code=True" if trusted else "")
    parts = ["lm_eval", "--model", "hf", "--model_args", model_args,
             "--tasks", ",".join(plan.lm_tasks), "--batch_size", str(config.batch_size), "--device", device]
    if plan.include_path:
        parts += ["--include_path", plan.include_path[0]]
    if config.limit is not None:
        parts += ["--limit", f"{config.limit:g}"]
    if config.num_fewshot is not None:
        parts += ["--num_fewshot", str(config.num_fewshot)]
    if config.apply_chat_template:
        parts += ["--apply_chat_template"]
    return shlex.join(parts)
