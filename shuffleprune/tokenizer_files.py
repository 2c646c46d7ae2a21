"""A checkpoint's tokenizer as its files say it is.

transformers 5 builds a tokenizer from the class its ``model_type`` (or ``tokenizer_config.json``) names and
rebuilds that class's normalizer and pre-tokenizer, where transformers 4 read ``tokenizer.json`` as written.
For checkpoints whose ``tokenizer.json`` is not the class's default (a LLaMA-typed model with a byte-level
BPE, for one: huggingface/transformers#48206) the rebuilt tokenizer drops spaces or words, and calibration,
perplexity and lm-eval then run on other text than the papers'. Two rules keep the files' tokenizer:

- :func:`as_its_file`: where the class's encoding of a probe text differs from ``tokenizer.json``'s, the
  tokenizer is read from ``tokenizer.json`` alone (``PreTrainedTokenizerFast``, as transformers 4 did), with a warning;
- :func:`save_tokenizer`: a tokenizer read from files, and not changed since, is written into a pruned checkpoint,
  an export or a dst model as those very files (copied byte for byte), so every client sees the tokenizer the
  source had.
"""
from __future__ import annotations

import shutil
import warnings
import weakref
from pathlib import Path

from transformers import PreTrainedTokenizerFast

TOKENIZER_FILES = ("*tokenizer*", "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken",
                   "*tekken*.json")   # the last: Mistral's own format, which transformers 5 reads alone
# the files one of which a cached hub repo's tokenizer has, whatever its format (looked up by exact name)
NAMED_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tekken.json", "tokenizer.model", "vocab.json",
                         "vocab.txt")
_WRITTEN_WITH = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                 "tokenization_*.py")   # beside the tokenizer files: its special tokens, chat templates, remote code
_TEMPLATES_DIR = "additional_chat_templates"

# spaces, tabs, newlines, digits, punctuation, accents, CJK and code: where tokenizer rebuilds differ
PROBE = ("We need to add 9 and 6, then  double-space.\n\n\tIndented: naïve café, Straße — 東京 42.5%\n"
         "def f(x):\n    return x ** 2  # don't\n")

_files_of: "weakref.WeakKeyDictionary[object, tuple[Path, tuple]]" = weakref.WeakKeyDictionary()


def _settings(tokenizer) -> tuple:
    """What a caller may change on a loaded tokenizer that its files would then not hold: its vocabulary size
    (added tokens), special tokens, chat template, padding side and length limit."""
    return (len(tokenizer), repr(tokenizer.special_tokens_map), repr(getattr(tokenizer, "chat_template", None)),
            tokenizer.padding_side, tokenizer.model_max_length)


def tokenizer_folder(path: str | Path) -> Path | None:
    """The folder holding the tokenizer files of a local dir or of a hub id's cached snapshot, or None."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import try_to_load_from_cache

    for name in NAMED_TOKENIZER_FILES:
        cached = try_to_load_from_cache(str(path), name)
        if isinstance(cached, str):
            return Path(cached).parent
    return None


def tokenizer_file_names(folder: Path) -> list[Path]:
    """The files of ``folder`` that make up its tokenizer (top level, plus its extra chat templates)."""
    names = {p for pattern in (*TOKENIZER_FILES, *_WRITTEN_WITH) for p in folder.glob(pattern) if p.is_file()}
    names |= {p for p in (folder / _TEMPLATES_DIR).glob("*") if p.is_file()}
    return sorted(names)


def _file_probe_ids(folder: Path) -> list[int] | None:
    """How ``folder/tokenizer.json`` encodes :data:`PROBE`; None without that file or where this ``tokenizers``
    cannot read it (a newer format): nothing to compare with."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file)).encode(PROBE, add_special_tokens=False).ids
    except Exception:
        return None


def _probe_ids(tokenizer) -> list[int]:
    return list(tokenizer(PROBE, add_special_tokens=False)["input_ids"])


def as_its_file(tokenizer, folder: Path | None, name: str):
    """``tokenizer``, or where its class encodes otherwise than ``folder``'s ``tokenizer.json``, the tokenizer
    that file holds (with one warning naming both); either is remembered as read from ``folder``."""
    if folder is None:
        return tokenizer
    written = None if type(tokenizer) is PreTrainedTokenizerFast else _file_probe_ids(folder)
    if written is not None and _probe_ids(tokenizer) != written:
        from_file = PreTrainedTokenizerFast.from_pretrained(str(folder))
        if _probe_ids(from_file) == written:
            import transformers

            warnings.warn(f"the tokenizer of '{name}': transformers {transformers.__version__}'s "
                          f"{type(tokenizer).__name__} encodes text otherwise than its tokenizer.json (the class rebuilds "
                          "that file's normalizer and pre-tokenizer); shuffleprune reads tokenizer.json as written, as "
                          "transformers 4 did (PreTrainedTokenizerFast.from_pretrained loads it so)", stacklevel=3)
            tokenizer = from_file
    if tokenizer_file_names(folder):
        _files_of[tokenizer] = (folder, _settings(tokenizer))
    return tokenizer


def save_tokenizer(tokenizer, out: Path) -> None:
    """Write ``tokenizer`` into ``out``: a tokenizer read from files, and not changed since, as a copy of those
    files; any other one (built in memory, a caller's own, or given tokens or a template after loading) with its
    ``save_pretrained``."""
    folder, settings = _files_of.get(tokenizer, (None, None))
    if folder is None or not folder.is_dir() or _settings(tokenizer) != settings:
        tokenizer.save_pretrained(out)
        return
    for file in tokenizer_file_names(folder):
        target = out / file.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target)   # a hub snapshot's links are followed: the file itself is written
