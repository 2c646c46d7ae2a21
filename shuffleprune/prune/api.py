"""``shuffleprune.prune(...)``, the Python API's one call: a model (a name or an object) and a recipe in,
a :class:`~shuffleprune.prune.driver.PruneResult` out."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from shuffleprune.calib import texts_in_memory
from shuffleprune.models import in_memory
from shuffleprune.prune.config import PruneConfig
from shuffleprune.prune.driver import PruneResult, prune as run_prune


def prune_model(model: Any = None, recipe: str | Path | None = None, out: str | Path | None = None, *,
                tokenizer: Any = None, resume: bool = False, overwrite: bool = False, progress: bool = True,
                **options: Any) -> PruneResult:
    """Prune ``model`` (hub id, HF dir, ``.gguf``; None: the embedded SmolLM2-135M-Instruct; or a
    transformers causal LM already in memory, with its ``tokenizer``, pruned in place and left where it
    was: on its devices, or dispatched by its ``device_map`` again) with a recipe
    (``fast``, ``balanced``, ``accurate``, ``paper``, ``best``, ``learned`` or a YAML file; default
    ``accurate``) and ``options`` that override it (the command line's names: ``pattern``, ``method``,
    ``perm``, ``nsamples``, ``perm_steps`` …). With ``out``, the checkpoint, report, recipe and model
    card are written there. ``calib`` and ``eval_text`` also take documents in memory (a list of
    strings or a ``datasets.Dataset``), recorded by their count and digest (``documents:N:…``; one
    such text for both is split as a shared file is). Returns a ``PruneResult`` (``.report``,
    ``.model``, ``.tokenizer``)."""
    loaded = None if isinstance(model, (str, Path, type(None))) else in_memory(model, tokenizer)
    if loaded is None and tokenizer is not None:
        raise TypeError("tokenizer= goes with a model object; a model path or hub id brings its own tokenizer")
    name = loaded.source if loaded is not None else (str(model) if model is not None else None)
    documents = texts_in_memory(options, ("calib", "eval_text"))   # named by their digest in the config and report
    config = PruneConfig.build(recipe, model=name, **options)
    return run_prune(config, out=out, resume=resume, overwrite=overwrite, progress=progress, loaded=loaded,
                     documents=documents)
