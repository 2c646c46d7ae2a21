"""shuffleprune: N:M sparsity for pretrained LLMs with learned input-channel permutations.

The Python API::

    import shuffleprune
    result = shuffleprune.prune("meta-llama/Llama-2-7b-hf", recipe="balanced", out="pruned/")
    result = shuffleprune.prune(model, tokenizer=tokenizer)  # a transformers model in memory, pruned in place
    shuffleprune.export("pruned/", "deployed/")       # values + 2-bit positions + index maps
    model = shuffleprune.load("deployed/")             # compressed SparseLinear layers (or any pruned/HF dir)
    results = shuffleprune.evaluate(["pruned/"], tasks=["ppl"])
    results = shuffleprune.evaluate([result], tasks=["ppl"])  # a PruneResult or a model in memory (+ tokenizer=)
    report = shuffleprune.finetune("pruned/", "tuned/", data="wiki", steps=200)  # its zeros held; tuned/model
    sparsifier = shuffleprune.DynamicSparsifier(...)   # dynamic sparse training in your own loop
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shuffleprune.version import __version__

if TYPE_CHECKING:
    import torch


def load(path: str, dtype: str | torch.dtype = "auto", maps: str = "producer", fuse: bool = True, cslt: bool | None = None,
         device: str | None = None, *, attn_implementation: str | None = None, config: Any = None,
         trust_remote_code: bool = False):
    """Load a checkpoint written by ``shuffleprune export`` (linears as compressed ``SparseLinear``),
    by ``prune`` (a plain model; an older-layout ``--perm`` checkpoint put back in input order) or
    any HF model onto ``device`` (``cuda``, ``cuda:N``, ``cpu``, or ``auto``: the first CUDA GPU if there
    is one; ``None``, the default, leaves it where transformers loads it, the CPU); returns the model
    (``.eval()``), laid out for serving there (:func:`shuffleprune.deploy.serving.arrange_for_serving`).
    For a GPU, name it here: loaded on the CPU and moved with ``.to()`` afterwards, a model runs
    without cuSPARSELt's buffer (below).
    ``dtype``: ``auto`` (the checkpoint's), ``float32``, ``bfloat16``, ``float16`` or a torch dtype.
    ``maps="producer"`` (default) moves an export's shared index maps to the modules producing those
    layers' input (an RMSNorm writes its output permuted, in one fused kernel on CUDA); ``"kernel"``
    keeps them in the sparse layers. ``fuse`` runs the sparse layers that read one input tensor
    (q/k/v, gate/up) as one stacked layer. ``cslt`` holds each 2:4 16-bit layer (rows a multiple of
    64, columns of 32) as one cuSPARSELt buffer that the decode kernels read too, so prompts served
    with CUDA graphs run on the sparse tensor cores; ``None`` (default) does so on a Hopper GPU whose
    PyTorch has cuSPARSELt. On an H100, with CUDA graphs, this default decoded a LLaMA-2-7B shape at
    1.58× dense's tokens/s and prefilled 512 tokens in 0.83–0.98× its time, with 0.58× its weight
    memory (``scripts/results/bench_e2e.json``, README *Benchmarks → GPU*). ``attn_implementation``
    (``sdpa``, ``eager``, ``flash_attention_2``, …) and ``config`` (a transformers config to build the
    model from) go to transformers' ``from_pretrained``; ``trust_remote_code`` runs the model code a checkpoint
    ships (an export keeps its source model's). The tokenizer:
    ``transformers.AutoTokenizer.from_pretrained(path)``."""
    from shuffleprune.deploy.serving import arrange_for_serving, check_serving_options
    from shuffleprune.models import load_model
    from shuffleprune.runtime.devices import pick_device

    check_serving_options(maps, fuse, cslt)   # before the weights are read
    target = None if device is None else pick_device(str(device))
    model = load_model(path, dtype, config=config, attn_implementation=attn_implementation,
                       trust_remote_code=trust_remote_code).model
    if target is not None:
        model.to(target)
    arrange_for_serving(model, maps=maps, fuse=fuse, cslt=cslt)
    return model


def export(pruned: str | Path, out: str | Path, pattern: str | None = None, overwrite: bool = False, *,
           fold: bool = True, progress: bool = True, trust_remote_code: bool = False) -> dict:
    """Write the compressed, deployable checkpoint of a pruned one (a dir or hub id) to ``out``;
    returns its format dict (layers, folds, gathers). ``pattern``: for a checkpoint without a
    prune report (e.g. ``"2:4"``); ``fold=False`` keeps every index map as a runtime gather
    (the command line's ``--no-fold``); ``trust_remote_code`` for a model that ships its own code."""
    from shuffleprune.deploy.export import export_checkpoint
    from shuffleprune.errors import UserError

    if not isinstance(pruned, (str, Path)):
        raise UserError(f"export reads a pruned checkpoint from disk, not a {type(pruned).__name__}: prune with "
                        "out='DIR' and export 'DIR'")
    return export_checkpoint(pruned, out, pattern=pattern, fold=fold, overwrite=overwrite, progress=progress,
                             trust_remote_code=trust_remote_code)


def evaluate(models: list[Any] | Any, tasks: list[str] | str | None = None, out: str | Path | None = None, *,
             tokenizer: Any = None, progress: bool = False, **options: Any) -> dict:
    """Score ``models`` side by side (lm-eval tasks and ``ppl``, a list or ``"ppl,arc_easy"``);
    ``options`` as ``EvalConfig``'s fields.
    A model is a hub id, a directory, a ``.gguf``, None (the embedded default), a ``PruneResult``, or a
    transformers causal LM in memory with ``tokenizer`` (scored in eval mode on the device, or where
    its ``device_map`` dispatched it, then given back on its devices, in its dtypes and mode).
    ``ppl_text`` also takes documents in memory (a list of strings or a ``datasets.Dataset``), scored whole."""
    from shuffleprune.evaluation.config import DEFAULT_TASKS, EvalConfig
    from shuffleprune.evaluation.evaluate import evaluate_models
    from shuffleprune.models import in_memory

    if isinstance(models, (str, Path)) or not isinstance(models, (list, tuple)):
        models = [models]   # one model given alone
    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]   # "ppl,arc_easy" as on the command line
    specs: list[str | None] = []
    loaded = {}
    for item in models:
        if item is None or isinstance(item, (str, Path)):
            specs.append(None if item is None else str(item))
            continue
        from shuffleprune.prune.driver import PruneResult

        lm = in_memory(item.model, item.tokenizer, item.report) if isinstance(item, PruneResult) \
            else in_memory(item, tokenizer)
        spec, k = f"{lm.source} (in memory)", 2
        while spec in specs:
            spec, k = f"{lm.source} (in memory #{k})", k + 1
        specs.append(spec)
        loaded[spec] = lm
    from shuffleprune.calib import texts_in_memory

    documents = texts_in_memory(options, ("ppl_text",))
    config = EvalConfig(models=specs, tasks=list(DEFAULT_TASKS) if tasks is None else list(tasks), **options)
    return evaluate_models(config, out=Path(out) if out is not None else None, progress=progress, loaded=loaded,
                           documents=documents)


def __getattr__(name: str) -> Any:
    if name == "prune":  # the package shuffleprune.prune, which calling runs prune_model (see its docstring)
        import importlib

        return importlib.import_module("shuffleprune.prune")
    if name == "finetune":
        from shuffleprune.dst.finetune import finetune

        return finetune
    if name in ("DynamicSparsifier", "DSTConfig"):
        from shuffleprune import dst

        return getattr(dst, name)
    raise AttributeError(f"module 'shuffleprune' has no attribute '{name}'")
