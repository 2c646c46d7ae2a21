"""Token windows from a text source: calibration windows and held-out perplexity tokens, as the
papers sample them.

Where a model's tokenizer starts every text with a BOS token (LLaMA, Gemma, …), each calibration
and perplexity window starts with it too by default (``bos_token``), as lm-eval does; with
``special_tokens`` a text is instead encoded once as the tokenizer encodes it alone (BOS at its
start only) and the windows cut from that, as SparseGPT's and Wanda's loaders do (``--bos text``).

Recipes: ``c4`` follows the SparseGPT/Wanda calibration loader exactly (random document longer than
``seqlen``, random window inside it, Python ``random`` seeded with ``seed``); every other source uses
their WikiText-2 loader (documents joined, with spaces for WikiText's train split as theirs, tokenized
once, random windows). Perplexity follows their
evaluation loaders: WikiText-2's whole test split; c4's first 1100 validation documents, joined with
spaces, scored on at most 256 windows of the context.
"""
from __future__ import annotations

import random
import warnings

import torch

from shuffleprune.calib.documents import Conversation, rendered
from shuffleprune.calib.sources import TextSource
from shuffleprune.errors import UserError, check_values

BOS_MODES = ("window", "text")   # where a tokenizer's BOS goes: every window (lm-eval), or each text's start


def check_bos_mode(mode: str, flag: str) -> None:
    if mode not in BOS_MODES:
        raise UserError(f"{flag} must be window (every window starts with BOS, as lm-eval) or text (BOS only at the "
                        f"start of each text, as SparseGPT's and Wanda's loaders), not {mode!r}")


def bos_token(tokenizer) -> int | None:
    """The BOS id when ``tokenizer`` starts an encoded text with it (LLaMA, Gemma, …), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if ids and ids[0] == bos and plain[:1] != [bos] else None


def encode(tokenizer, text: str, special_tokens: bool = False) -> torch.Tensor:
    """``text`` as token ids (with the tokenizer's special tokens when ``special_tokens``)."""
    return torch.tensor(tokenizer(text, add_special_tokens=special_tokens)["input_ids"], dtype=torch.long)


def calibration_windows(source: TextSource, tokenizer, nsamples: int, seqlen: int, seed: int,
                        bos: int | None = None, info: dict | None = None, special_tokens: bool = False) -> torch.Tensor:
    """``[nsamples, seqlen]`` token windows from the source's train split, reproducible from ``seed``.
    With ``bos``, each window is that token followed by ``seqlen − 1`` tokens of text; with
    ``special_tokens``, each text is encoded as the tokenizer encodes it alone (a BOS at its start:
    SparseGPT's and Wanda's loaders). ``info`` (a dict) receives the number of documents and tokens
    drawn from (and of conversations, with whether a chat template rendered them)."""
    shortest = 2 + (bos is not None)
    why = "the model's BOS token and two tokens of text" if bos is not None else "two tokens of text"
    check_values(("--nsamples", nsamples, nsamples >= 1, ">= 1"),
                 ("--seqlen", seqlen, seqlen >= shortest, f">= {shortest} ({why})"))
    docs = source.documents("train")
    chats = sum(isinstance(d, Conversation) for d in docs)
    docs = rendered(docs, tokenizer)
    text_len = seqlen - (bos is not None)
    rng = random.Random(seed)
    rows = []
    if source.doc_windows:
        for _ in range(nsamples):
            for _attempt in range(100_000):
                ids = encode(tokenizer, docs[rng.randint(0, len(docs) - 1)], special_tokens)
                if ids.numel() > text_len:
                    break
            else:
                raise UserError(f"'{source.name}' has no documents longer than --seqlen {seqlen}")
            start = rng.randint(0, ids.numel() - text_len - 1)
            rows.append(ids[start:start + text_len])
        tokens = None
    else:
        stream = encode(tokenizer, source.joined(docs, calibration=True), special_tokens)
        if stream.numel() <= text_len:
            count = f"{stream.numel()} token" + ("" if stream.numel() == 1 else "s")
            raise UserError(f"'{source.name}' has only {count}; need more than --seqlen {seqlen}")
        if nsamples * text_len > stream.numel():
            warnings.warn(f"'{source.name}' has {stream.numel()} calibration tokens, fewer than the {nsamples} windows of "
                          f"{text_len} ask ({nsamples * text_len}): the windows overlap; give a longer text or fewer "
                          "--nsamples", stacklevel=2)
        for _ in range(nsamples):
            start = rng.randint(0, stream.numel() - text_len - 1)
            rows.append(stream[start:start + text_len])
        tokens = int(stream.numel())
    if info is not None:
        info.update({"documents": len(docs), "tokens": tokens})
        if chats:   # how the conversations were read: through the tokenizer's chat template, or as plain lines
            info.update({"conversations": chats, "chat_template": bool(getattr(tokenizer, "chat_template", None))})
    windows = torch.stack(rows)
    if bos is not None:
        windows = torch.cat([torch.full((nsamples, 1), bos, dtype=windows.dtype), windows], dim=1)
    return windows


def eval_tokens(source: TextSource, tokenizer, max_tokens: int | None = None, info: dict | None = None,
                ctx: int | None = None, special_tokens: bool = False) -> torch.Tensor:
    """The source's test split as one token stream ``[1, T]`` (encoded with the tokenizer's special
    tokens when ``special_tokens``), truncated to ``max_tokens`` and, for a source scored on a set
    number of windows as the papers do (c4: 256), to that many windows of ``ctx`` tokens; ``info``
    (a dict) receives the number of documents and of tokens before truncation."""
    docs = rendered(source.documents("test"), tokenizer)
    stream = encode(tokenizer, source.joined(docs), special_tokens)
    if info is not None:
        info.update({"documents": len(docs), "tokens_available": int(stream.numel())})
    caps = [max_tokens, source.eval_windows * ctx if source.eval_windows and ctx else None]
    caps = [c for c in caps if c is not None]
    if caps:
        stream = stream[:min(caps)]
    return stream.unsqueeze(0)
