"""The model and tokenizer a ``dst`` run trains: a fresh model of a transformers config (a model type, or a
config dir / hub id, with overrides checked key by key) and the tokenizer it reads its text with."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from shuffleprune.dst.config import TrainConfig
from shuffleprune.errors import UserError, reason


def training_tokenizer(spec: str, train_docs: list[str], source_name: str = "", trust_remote_code: bool = False):
    """``default``: the embedded model's tokenizer; ``bpe:N``: a byte-level BPE with N tokens trained
    on the training split (deterministic); otherwise a tokenizer dir, a .gguf file or a hub id (whose
    tokenizer class, if it is code the tokenizer ships, runs only with ``trust_remote_code``)."""
    from transformers import PreTrainedTokenizerFast

    from shuffleprune.models import is_embedded, load_tokenizer, resolve_model_path

    if spec.startswith("bpe:"):
        from tokenizers import ByteLevelBPETokenizer

        vocab = int(spec[4:])   # TrainConfig.check refused any other bpe: value
        import hashlib

        from shuffleprune.cache import cache_dir

        key = hashlib.sha256(f"{source_name}|{len(train_docs)}|{sum(map(len, train_docs))}|{vocab}".encode()).hexdigest()[:16]
        cached = cache_dir() / "bpe" / key
        if (cached / "tokenizer.json").is_file():  # trained before on the same text
            return PreTrainedTokenizerFast.from_pretrained(cached)
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(train_docs, vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                                show_progress=False)
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                      pad_token="<|endoftext|>")
        tok.save_pretrained(cached)
        return tok
    if is_embedded(spec) or spec.endswith(".gguf"):   # a GGUF file's tokenizer, from its converted checkpoint
        return load_tokenizer(resolve_model_path(None if is_embedded(spec) else spec), spec)
    return load_tokenizer(spec, spec, trust_remote_code)


def special_token_id(tokenizer) -> int:
    """The id a fresh model's config takes for its bos/eos/pad ids: the tokenizer's end, start, unknown or
    padding token, the first it has, else 0. Never None: strict configs (CWM) refuse None for these ids."""
    ids = (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id)
    return next((i for i in ids if i is not None), 0)


def config_builder(arch: str, trust_remote_code: bool = False) -> Callable[[dict], object]:
    """``arch`` (a model type, or a config dir / hub id whose settings come first) as a function of the
    overrides that builds its transformers config; a model type transformers lacks is refused with
    the nearest ones. A config dir / hub id whose configuration class is code it ships (``auto_map``)
    builds with that code when ``trust_remote_code``, else is refused naming ``--trust-remote-code``."""
    import difflib

    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    from shuffleprune.models import untrusted_code

    if Path(arch).is_dir() or "/" in arch:
        base = dict(PretrainedConfig.get_config_dict(arch)[0])
        model_type = base.pop("model_type", None)
        if "AutoConfig" in (base.get("auto_map") or {}) and (trust_remote_code or model_type not in CONFIG_MAPPING):
            if not trust_remote_code:
                raise untrusted_code(arch)
            return lambda kw: AutoConfig.from_pretrained(arch, trust_remote_code=True, **kw)
        if model_type is None:
            raise ValueError("its config.json has no model_type")
    else:
        base, model_type = {}, arch
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        raise UserError(f"--arch {arch}: transformers {transformers.__version__} has no model type '{model_type}'"
                        + (f"; did you mean {' or '.join(close)}?" if close else
                           " (give one such as gpt2 or llama, a config dir or a hub id)"))
    return lambda kw: AutoConfig.for_model(model_type, **{**base, **kw})


def _has_setting(config, key: str) -> bool:
    try:
        getattr(config, key)
    except AttributeError:
        return False
    except Exception:   # a per-layer setting asked globally (heterogeneous configs) is a setting
        return True
    return True


def unknown_config_keys(config_of: Callable[[dict], object], config_kw: dict) -> dict[str, list[str]]:
    """The keys of ``config_kw`` the architecture does not take, each with the settings it may have
    meant: a key that is no setting of the default config and either stays an extra attribute
    (transformers keeps any key so: a misspelt ``n_layers=2`` for GPT-2 trained the default 12
    layers) or changes nothing (a config dir's ``rope_parameters`` win over ``rope_theta``). A key the
    config converts (``rope_theta`` into a model type's ``rope_parameters``) is taken."""
    import difflib

    default = config_of({})
    config = config_of(config_kw)
    unknown = {}
    for key in config_kw:
        if _has_setting(default, key):
            continue
        if key in vars(config) or config.to_dict() == config_of({k: v for k, v in config_kw.items() if k != key}).to_dict():
            known = sorted(k for k in default.to_dict() if not k.startswith("_"))
            unknown[key] = difflib.get_close_matches(key, known, n=3)
    return unknown


def model_config(cfg: TrainConfig):
    """The transformers config of ``cfg.arch`` (a model type, or a config dir / hub id) with
    ``cfg.config_kw`` (every key one the architecture takes); a one-line error when there is none."""
    from huggingface_hub.errors import StrictDataclassError

    from shuffleprune.models import warn_if_old_transformers

    warn_if_old_transformers()
    try:
        config_of = config_builder(cfg.arch, cfg.trust_remote_code)
        config = config_of(cfg.config_kw)
        unknown = unknown_config_keys(config_of, cfg.config_kw) if cfg.config_kw else {}
    except (ValueError, OSError, TypeError, StrictDataclassError) as exc:
        # transformers' config validation nests the reason under a header line: keep all of it, on one line
        raise UserError(f"cannot build a config for '{cfg.arch}': {reason(exc, 240)}") from exc
    if unknown:
        key, close = next(iter(unknown.items()))
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise UserError(f"--config-kw {key}: a '{config.model_type}' config has no setting '{key}' "
                        f"(it would change nothing){hint}")
    return config


def build_model(cfg: TrainConfig, vocab_size: int, special_id: int | None = None, config=None):
    """A fresh model of :func:`model_config` (or of ``config``, one it built already), its vocabulary and
    special ids the tokenizer's."""
    from transformers import AutoModelForCausalLM

    config = model_config(cfg) if config is None else config
    config.vocab_size = vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer's, not the architecture default
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):   # several ids (GLM's eos): those past the vocabulary become the tokenizer's
            ids = list(dict.fromkeys(special_id if i >= vocab_size else i for i in value if i is not None))
            setattr(config, key, [i for i in ids if i is not None] or None)
        elif value is not None and value >= vocab_size:
            setattr(config, key, special_id)
    for key in ("n_positions", "max_position_embeddings"):
        if hasattr(config, key) and getattr(config, key) < cfg.seq_len:
            setattr(config, key, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    try:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    except ValueError as exc:   # an encoder or encoder-decoder type (t5, bert …), or settings the model refuses
        if "Unrecognized configuration class" in str(exc):
            raise UserError(f"--arch {cfg.arch}: transformers has no causal-LM class for model type '{config.model_type}'; "
                            "dst trains decoder LLMs (AutoModelForCausalLM)") from exc
        raise UserError(f"cannot build a '{config.model_type}' model from --arch and --config-kw: {reason(exc)}") from exc
    if getattr(model, "loss_type", None) is None:   # a class name transformers does not map (GPT-2's): the loss
        model.loss_type = "ForCausalLM"             # it falls back to, set so that transformers does not warn
    return model
