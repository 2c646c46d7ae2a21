"""The transformers entry point of an export: ``AutoModelForCausalLM.from_pretrained(EXPORT,
trust_remote_code=True, **kwargs)`` runs the export's ``shuffleprune_hf.py``, which calls
:func:`load_for_transformers` here, so the installed shuffleprune decides how an export loads."""
from __future__ import annotations

import warnings
from pathlib import Path

from torch import nn

# from_pretrained arguments an export cannot honour, and the value that asks nothing of it
_NOT_FOR_EXPORTS = {"quantization_config": None, "gguf_file": None, "subfolder": "", "revision": "main",
                    "max_memory": None, "offload_folder": None, "tp_plan": None, "load_in_8bit": False,
                    "load_in_4bit": False, "output_loading_info": False}
# arguments about where the files come from or how transformers reads them: nothing to do for a local export
_HARMLESS = {"low_cpu_mem_usage", "use_safetensors", "cache_dir", "token", "local_files_only",
             "force_download", "proxies", "code_revision", "adapter_kwargs", "_from_auto", "_commit_hash"}
_HONOURED = {"dtype", "torch_dtype", "device_map", "config", "attn_implementation", "trust_remote_code"}


def load_for_transformers(path: str | Path, *args, **kwargs) -> nn.Module:
    """What ``AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True, **kwargs)`` runs (the
    export's ``shuffleprune_hf.py`` calls this): :func:`shuffleprune.load` with transformers' arguments.
    ``dtype``/``torch_dtype``, ``config`` (with what transformers put in it: ``attn_implementation``,
    config overrides), ``attn_implementation`` and ``trust_remote_code`` (the export of a model that ships its
    own code needs it for that code, as transformers asks it for this loader) are honoured; ``device_map`` must name one device
    (``"cuda"``, ``"cuda:N"``, an index, ``"cpu"``, ``"auto"`` or ``{"": DEVICE}`` as lm-eval passes it).
    Arguments an export cannot honour (quantization, another revision, offloading, …) are a
    ``ValueError`` naming them rather than silently ignored."""
    import shuffleprune

    if args:
        raise ValueError(f"a shuffleprune export takes no positional model arguments (got {len(args)})")
    refused = sorted(key for key, default in _NOT_FOR_EXPORTS.items() if kwargs.get(key, default) not in (default, None))
    if refused:
        fix = ("download that revision (hf download ID --revision R --local-dir DIR) and load DIR" if refused == ["revision"]
               else "load it without them")
        raise ValueError(f"a shuffleprune export cannot be loaded with {', '.join(refused)}: {fix}")
    dtype = kwargs.get("dtype") or kwargs.get("torch_dtype") or "auto"
    device = kwargs.get("device_map")   # one device ("auto": the first GPU); none: the CPU, as transformers
    one_device = ValueError("a shuffleprune export loads onto one device: "
                            "device_map='cuda', 'cuda:N', 'cpu', 'auto' or {'': DEVICE}")
    if isinstance(device, dict):
        if len({str(where) for where in device.values()}) != 1:
            raise one_device
        device = next(iter(device.values()))
    if device in ("balanced", "balanced_low_0", "sequential"):   # accelerate's ways of spreading a model over GPUs
        raise one_device
    if isinstance(device, int):
        device = f"cuda:{device}"
    ignored = sorted(key for key, value in kwargs.items()
                     if key not in _NOT_FOR_EXPORTS.keys() | _HARMLESS | _HONOURED and value is not None)
    if ignored:
        warnings.warn(f"shuffleprune.load ignores these from_pretrained arguments: {', '.join(ignored)}", stacklevel=2)
    return shuffleprune.load(str(path), dtype=dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
                             device=None if device is None else str(device), config=kwargs.get("config"),
                             attn_implementation=kwargs.get("attn_implementation"),
                             trust_remote_code=bool(kwargs.get("trust_remote_code")))
