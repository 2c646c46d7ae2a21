"""shuffleprune: N:M sparsity for pretrained LLMs with learned input-channel permutations.

The Python API::

    import shuffleprune
    result = shuffleprune.prune("meta-llama/Llama-2-7b-hf", recipe="balanced", out="pruned/")
    result = shuffleprune.prune(model, tokenizer=tokenizer)  # a transformers model in memory, pruned in place
    shuffleprune.export("pruned/", "deployed/")       # values + 2-bit positions + index maps
    model = shuffleprune.load("deployed/")             # compressed SparseLinear layers (or any pruned/HF dir)
    results = shuffleprune.evaluate(["pruned/"], tasks=["ppl"])
    sparsifier = shuffleprune.DynamicSparsifier(...)   # dynamic sparse training in your own loop
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from shuffleprune.version import __version__


def export(pruned: str | Path, out: str | Path, pattern: str | None = None, overwrite: bool = False, *,
           fold: bool = True, progress: bool = True) -> dict:
    """Write the compressed, deployable checkpoint of a pruned one (a dir or hub id) to ``out``;
    returns its format dict (layers, folds, gathers). ``pattern``: for a checkpoint without a
    prune report (e.g. ``"2:4"``); ``fold=False`` keeps every index map as a runtime gather
    (the command line's ``--no-fold``)."""
    from shuffleprune.deploy.export import export_checkpoint

    return export_checkpoint(pruned, out, pattern=pattern, fold=fold, overwrite=overwrite, progress=progress)


def evaluate(models: list[str | None], tasks: list[str] | None = None, out: str | Path | None = None, **options: Any) -> dict:
    """Score ``models`` side by side (lm-eval tasks and ``ppl``); ``options`` as ``EvalConfig``'s fields."""
    from shuffleprune.evaluation.evaluate import DEFAULT_TASKS, EvalConfig, evaluate_models

    config = EvalConfig(models=list(models), tasks=list(tasks or DEFAULT_TASKS), **options)
    return evaluate_models(config, out=Path(out) if out is not None else None, progress=False)


def __getattr__(name: str) -> Any:
    if name == "prune":  # the package shuffleprune.prune, which calling runs prune_model (see its docstring)
        import importlib

        return importlib.import_module("shuffleprune.prune")
    if name in ("DynamicSparsifier", "DSTConfig"):
        from shuffleprune import dst

        return getattr(dst, name)
    raise AttributeError(f"module 'shuffleprune' has no attribute '{name}'")
