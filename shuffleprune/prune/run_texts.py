"""A prune run's texts: ``--calib`` and the held-out text opened before the model loads, then cut into
calibration windows and held-out tokens with the model's tokenizer."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from shuffleprune.calib import (TextSource, bos_token, calibration_windows, default_eval_source, eval_tokens, open_text,
                               same_text, text_contains)
from shuffleprune.prune.config import PruneConfig


@dataclass
class RunTexts:
    """The run's texts, opened (a local file read and parsed) before the model loads."""

    calib: TextSource
    eval: TextSource | None
    eval_name: str | None
    shared: bool   # one local file split between calibration and evaluation


def eval_name(config: PruneConfig) -> str | None:
    """The held-out text: ``--eval-text``, the default for the calibration source, or None."""
    if config.eval_text is None:
        return None
    return default_eval_source(config.calib) if config.eval_text == "auto" else config.eval_text


def open_texts(config: PruneConfig, documents: dict[str, tuple[str, ...]]) -> RunTexts:
    """Open ``--calib`` and the held-out text (a name in ``documents``: those passed in memory): an
    unknown, missing or unreadable text fails here, before the model is loaded, and a local file is
    read once for the run."""
    held_name = eval_name(config)
    shared = same_text(config.calib, held_name)
    if not shared and text_contains(config.calib, held_name):
        warnings.warn(f"the perplexity text '{held_name}' is part of the calibration text '{config.calib}': its "
                      "perplexity is not held out (give --eval-text a text outside it, or the same directory to split "
                      "it)", stacklevel=2)
    calib = open_text(config.calib, documents, shared)
    held = None if held_name is None else (calib if shared else open_text(held_name, documents))
    return RunTexts(calib, held, held_name, shared)


def run_tokens(config: PruneConfig, texts: RunTexts, tokenizer, seqlen: int,
               ctx: int) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Calibration windows, held-out tokens, and what was used of each text (documents, tokens, BOS)."""
    tokenizer_bos = bos_token(tokenizer)
    bos = tokenizer_bos if config.bos == "window" else None
    special = config.bos == "text"   # each text encoded as the tokenizer encodes it alone, as the papers' loaders
    calib_info: dict = {}
    tokens = calibration_windows(texts.calib, tokenizer, config.nsamples, seqlen, config.seed, bos=bos, info=calib_info,
                                 special_tokens=special)
    eval_info: dict = {}
    held_out = (eval_tokens(texts.eval, tokenizer, config.eval_tokens, eval_info, ctx, special)
                if texts.eval is not None else None)
    info = {"eval_text": texts.eval_name, "shared_file_split": texts.shared, "bos": bos is not None,
            "bos_mode": config.bos if tokenizer_bos is not None else None,   # None: the tokenizer adds no BOS
            "calib": calib_info,   # documents, tokens (and conversations, chat_template for chat data)
            "eval": None if held_out is None else {**eval_info, "tokens_read": int(held_out.numel())}}
    return tokens, held_out, info
