"""Text sources for calibration and perplexity, by name (``--calib`` / ``--eval-text`` / ``--ppl-text``
/ ``--data``, or documents passed in memory), and which part of each a run reads.

Sources:

- ``c4``, ``wikitext2``, ``wikitext103`` and any hub dataset ``OWNER/NAME[:CONFIG][@SPLIT[START:STOP]]``:
  from the hub (:mod:`shuffleprune.calib.hub_data`).
- ``wiki``, ``brown``: offline corpora (:mod:`shuffleprune.calib.corpora`).
- a path: a local ``.txt``, ``.jsonl``, ``.json`` or ``.parquet`` file (:mod:`shuffleprune.calib.files`),
  or a directory of them (every such file under it, in path order), or ``DIR@SPLIT[START:STOP]``: a
  dataset downloaded from the hub, one split's rows read as the hub's are.

The offline sources are split deterministically: every 10th document is held out for perplexity
(``split="test"``), the rest is for calibration (``split="train"``). A local file, documents in memory
and a hub split's rows are used whole on either side; only when one serves both sides
(``get_source(name, shared=True)``: prune's ``--calib`` and ``--eval-text`` the same, ``dst --data``)
are its documents split the same way (a text of one document: its last tenth held out). How windows
are drawn from a source is :mod:`shuffleprune.calib.sampling`'s.
"""
from __future__ import annotations

import hashlib
import itertools
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from shuffleprune.calib.corpora import brown_documents, wiki_documents
from shuffleprune.calib.documents import as_conversations, documents_of_rows, held_out_split, with_text
from shuffleprune.calib.files import TEXT_FILES, file_documents, text_file_kind
from shuffleprune.calib.hub_data import (C4_EVAL_WINDOWS, HUB_DATASET_DOCS, HUB_SOURCES, HubDataset, hub_dataset_id,
                                         hub_dataset_name, hub_splits, load_hub_dataset, load_paper_text)
from shuffleprune.errors import UserError

OFFLINE_SOURCES = ("wiki", "brown")


@dataclass(frozen=True)
class TextSource:
    """A named text source; ``documents(split)`` returns its documents for ``train`` or ``test``."""

    name: str
    loader: Callable[[str], list[str]]
    joiner: str = "\n\n"
    doc_windows: bool = False  # c4 recipe: windows inside single long documents
    eval_windows: int | None = None   # c4 recipe: perplexity on this many windows of the context at most
    calib_joiner: str | None = None   # WikiText-2 recipe: calibration joins the train split with spaces

    def joined(self, docs: list[str], calibration: bool = False) -> str:
        """The documents as one text, joined as the recipe joins that side."""
        return (self.calib_joiner if calibration and self.calib_joiner is not None else self.joiner).join(docs)

    def documents(self, split: str) -> list[str]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', not {split!r}")
        docs = self.loader(split)
        if not docs:
            raise UserError(f"text source '{self.name}' has no {split} documents")
        return docs


def _hub_split_loader(hub: HubDataset, shared: bool) -> Callable[[str], list[str]]:
    """The loader of a hub dataset's named split: its rows on either side, or, when they serve both
    fitting and held-out perplexity, every 10th held out (as a local file's documents); streamed once."""
    @lru_cache(maxsize=1)
    def loader() -> Callable[[str], list[str]]:
        return _local(hub_dataset_name(hub), tuple(load_hub_dataset(hub, "train")), shared)

    return lambda split: loader()(split)


def _last_tenth(doc: str) -> tuple[str, str] | None:
    """One document as two for a split: its first nine tenths and the rest, cut at the first line
    break (else space) from 90 % of it on, or right there in a text without either; None when too short."""
    cut = int(len(doc) * 0.9)
    for at in (doc.find("\n", cut), doc.find(" ", cut), cut):
        if at > 0 and doc[:at].strip() and doc[at:].strip():
            return doc[:at], doc[at:]
    return None


def _local(path: Path | str, docs: tuple[str, ...], split_docs: bool) -> Callable[[str], list[str]]:
    """The loader of a text held whole (a file's, or documents passed in memory): as given, or split
    when it serves both fitting and held-out perplexity."""
    if not docs:
        raise UserError(f"'{path}' holds no text")   # (documents in memory are refused empty before)
    if split_docs and len(docs) == 1:
        docs = _last_tenth(docs[0])
        if docs is None:
            raise UserError(f"'{path}' is too short to split into text to fit on and held-out text; give a longer text"
                            " (prune: or another one as --eval-text)")

    def load(split: str) -> list[str]:
        if not split_docs:
            return list(docs)  # a file is used as given
        # one file for both sides: every 10th document held out (at least one on each side; one document
        # is cut into its first nine tenths and the rest)
        if len(docs) >= 10:
            return held_out_split(list(docs), split)
        return list(docs[-1:]) if split == "test" else list(docs[:-1])
    return load


MEMORY_PREFIX = "documents:"   # a text passed to the Python API as documents, named by their digest


def as_documents(value: Any, key: str) -> tuple[str, ...]:
    """Documents passed in memory (a list or tuple of strings or of conversations, a ``datasets.Dataset``,
    the first :data:`HUB_DATASET_DOCS` rows of an ``IterableDataset`` (a streamed one), or a pandas
    ``DataFrame``; a table's text or chat column picked as a hub dataset's) as a tuple of non-empty strings;
    a one-line error otherwise."""
    kind = type(value).__name__
    if kind in ("DatasetDict", "IterableDatasetDict"):
        splits = list(value)
        raise UserError(f"'{key}' is a {kind} of splits ({', '.join(splits)}); pass one of them, e.g. "
                        f"{key}=dataset[{(splits or ['train'])[0]!r}]")
    rows = None
    if kind in ("Dataset", "IterableDataset") and hasattr(value, "features"):
        rows = itertools.islice(value, HUB_DATASET_DOCS) if kind == "IterableDataset" else iter(value)
    elif kind == "DataFrame" and hasattr(value, "to_dict"):   # pandas: its rows, read as a dataset's
        rows = iter(value.to_dict("records"))
    if rows is not None:
        value = documents_of_rows(rows, f"the {key} dataset", "rename its text column 'text' or pass a list of strings")
    elif isinstance(value, (list, tuple)):
        value = as_conversations(value) or value   # conversations: lists of role/content messages
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, str) for d in value):
        raise UserError(f"'{key}' takes a text source name, a {TEXT_FILES} path, a list of strings or of conversations "
                        f"(role/content messages), a datasets.Dataset or IterableDataset or a pandas DataFrame; "
                        f"got {type(value).__name__}")
    docs = tuple(with_text(value))
    if not docs:
        raise UserError(f"'{key}' holds no text")
    return docs


def documents_name(docs: tuple[str, ...]) -> str:
    """The name that stands for ``docs`` in a run's config and report: their count and digest (the
    same documents, the same name; a resumed run passes them again)."""
    digest = hashlib.sha256("\0".join(docs).encode()).hexdigest()[:16]
    return f"{MEMORY_PREFIX}{len(docs)}:{digest}"


def documents_source(name: str, docs: tuple[str, ...], shared: bool = False) -> TextSource:
    """The :class:`TextSource` of documents passed in memory (used whole, or split when ``shared``)."""
    return TextSource(name, _local(f"the documents of '{name}'", docs, shared))


def texts_in_memory(options: dict[str, Any], keys: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The texts of a Python call's ``options`` at ``keys`` given as documents in memory: each replaced
    in ``options`` by its name (:func:`documents_name`) and returned under it; a ``Path`` is taken as
    its string."""
    documents = {}
    for key in keys:
        value = options.get(key)
        if isinstance(value, Path):
            options[key] = str(value)
        elif value is not None and not isinstance(value, str):
            docs = as_documents(value, key)
            options[key] = documents_name(docs)
            documents[options[key]] = docs
    return documents


def open_text(name: str, documents: dict[str, tuple[str, ...]], shared: bool = False) -> TextSource:
    """A text by name: documents passed in memory under that name (:func:`texts_in_memory`), else
    :func:`get_source`'s."""
    return documents_source(name, documents[name], shared) if name in documents else get_source(name, shared)


def is_text_path(name: str) -> bool:
    """Whether ``name`` is a local text: a text file (:func:`text_file_kind`), or a directory of them (a
    named source of the same name comes first)."""
    if name in OFFLINE_SOURCES or name in HUB_SOURCES:
        return False
    path = Path(name).expanduser()
    return text_file_kind(path) is not None or path.is_dir()


def is_local_source(name: str) -> bool:
    """Whether :func:`get_source` reads ``name`` without the hub (an offline source, a text file or
    directory, a dataset directory's split, documents in memory)."""
    if name in OFFLINE_SOURCES or is_text_path(name) or name.startswith(MEMORY_PREFIX):
        return True
    hub = _named_split(name)
    return hub is not None and hub.local


def _named_split(name: str | None) -> HubDataset | None:
    """The hub dataset ``name`` reads a named split of, else None (a local text's name included)."""
    hub = None if name is None else hub_dataset_id(name)
    return hub if hub is not None and hub.split is not None else None


def same_text(a: str | None, b: str | None) -> bool:
    """Whether two ``--calib`` / ``--eval-text`` values name the same local file (or the same
    documents passed in memory, or the same rows of a hub dataset's split)."""
    if a is not None and a.startswith(MEMORY_PREFIX):
        return a == b
    hub_a, hub_b = _named_split(a), _named_split(b)
    if hub_a is not None:
        return hub_b is not None and hub_a.same_split(hub_b) and hub_a.rows == hub_b.rows
    if a is None or b is None or not is_text_path(a) or not is_text_path(b):
        return False
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def text_contains(a: str | None, b: str | None) -> bool:
    """Whether text ``a`` holds text of ``b``: the same file or documents, a directory with ``b`` (a
    file or a directory) under it, or rows of a hub dataset's split that ``b`` reads too."""
    if same_text(a, b):
        return True
    hub_a, hub_b = _named_split(a), _named_split(b)
    if hub_a is not None and hub_b is not None:
        return hub_a.same_split(hub_b) and max(hub_a.rows.start, hub_b.rows.start) < min(hub_a.rows.stop, hub_b.rows.stop)
    if a is None or b is None or not is_text_path(a) or not is_text_path(b) or not Path(a).expanduser().is_dir():
        return False
    return Path(b).expanduser().resolve().is_relative_to(Path(a).expanduser().resolve())


# a dataset split's file, as the hub names them: train_sft-00000-of-00003.parquet, or test.jsonl
_SPLIT_SHARD = re.compile(r"(?P<split>[A-Za-z]\w*?)-\d{5}-of-\d{5}|(?P<named>train|test|validation|valid|dev)\.")


def _warn_if_splits_mixed(name: str, files: list[Path]) -> None:
    """Warn when a directory read whole is a dataset snapshot of several splits (its files named as the
    hub names a split's shards): they are all read, mixed; ``DIR@SPLIT`` reads one."""
    splits = sorted({m["split"] or m["named"] for f in files if (m := _SPLIT_SHARD.match(f.name))})
    if len(splits) > 1:
        one = "train" if "train" in splits else next((s for s in splits if s.startswith("train")), splits[0])
        warnings.warn(f"'{name}' holds the files of several dataset splits ({', '.join(splits)}), all read as one "
                      f"text; to read one, give {name.rstrip('/')}@SPLIT, e.g. @{one} (rows too: @{one}[:512])",
                      stacklevel=3)


def get_source(name: str, shared: bool = False) -> TextSource:
    """Resolve a ``--calib`` / ``--eval-text`` value. ``shared``: a local file that serves both
    calibration and evaluation, whose documents are then split."""
    if not name.strip():   # Path("") would be the current directory, read as a directory of texts
        raise UserError(f"a text source is empty; use {', '.join(HUB_SOURCES[:2] + OFFLINE_SOURCES)}, a hub dataset "
                        f"OWNER/NAME or a {TEXT_FILES} file")
    if name == "c4":
        return TextSource("c4", lambda s: load_paper_text("c4", s), joiner=" ", doc_windows=True,
                          eval_windows=C4_EVAL_WINDOWS)
    if name in ("wikitext2", "wikitext103"):
        return TextSource(name, lambda s: load_paper_text(name, s), joiner="\n\n", calib_joiner=" ")
    if name == "wiki":
        return TextSource("wiki", lambda s: held_out_split(list(wiki_documents()), s))
    if name == "brown":
        return TextSource("brown", lambda s: held_out_split(list(brown_documents()), s))
    path = Path(name).expanduser()
    if text_file_kind(path) is not None:
        if not path.is_file():
            raise UserError(f"text file '{name}' " + (f"is a directory; give a {TEXT_FILES} file in it" if path.is_dir()
                                                     else "does not exist"))
        docs = file_documents(path)   # bad bytes or lines are refused now, not after the model is loaded
        return TextSource(str(path), _local(path, docs, shared))
    if path.is_dir():   # every text file under it, in path order (hidden ones left out)
        files = sorted(p for p in path.rglob("*") if text_file_kind(p) is not None and p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError(f"directory '{name}' holds no {TEXT_FILES} file")
        _warn_if_splits_mixed(name, files)
        return TextSource(str(path), _local(path, tuple(d for f in files for d in file_documents(f)), shared))
    if name.startswith(MEMORY_PREFIX):
        raise UserError(f"'{name}' stands for documents passed in memory to the Python API; pass them again "
                        "(calib=[...] / eval_text=[...]), or give a text source or file")
    hub = hub_dataset_id(name)
    if hub is not None and hub.split is not None:
        hub_splits(hub)   # a split the dataset lacks is refused now, not after the model is loaded
        return TextSource(name, _hub_split_loader(hub, shared))
    if hub is not None:
        return TextSource(name, lambda s: load_hub_dataset(hub, s))
    if name.partition("@")[0] in HUB_SOURCES + OFFLINE_SOURCES:
        raise UserError(f"'{name}': {name.partition('@')[0]} is read with its own fixed splits; for other rows give a "
                        "hub dataset with a split, e.g. allenai/c4:en@validation[:1100]")
    raise UserError(f"unknown text source '{name}'; use c4, wikitext2, wikitext103, wiki, brown, a hub dataset "
                    f"OWNER/NAME[:CONFIG][@SPLIT[START:STOP]], a {TEXT_FILES} file or a directory of such files")


def held_out_part(name: str, split_from_shared: bool = False) -> str:
    """Which part of a held-out text perplexity reads, for tables and model cards: a corpus's test
    split, or a local file (documents in memory) whole (``--eval-text``, ``--ppl-text``) or its
    held-out part (one text split between fitting and evaluation: ``--calib`` and ``--eval-text`` the
    same, ``dst --data``)."""
    hub = _named_split(name)
    if split_from_shared and (name.startswith(MEMORY_PREFIX) or is_text_path(name) or hub is not None):
        return "its held-out part"
    if hub is not None:
        return f"{hub.split} split, rows {hub.rows.start}:{hub.rows.stop}"
    if name.startswith(MEMORY_PREFIX):
        return "all of them"
    if name == "c4":
        return "validation split"
    if is_text_path(name):
        return "the whole file" if text_file_kind(Path(name)) is not None else "all of its files"
    return "test split"


def default_eval_source(calib: str) -> str:
    """Held-out ppl text that is not the calibration source: wikitext2 for hub sources (hub datasets
    too), else the other offline one."""
    if calib in HUB_SOURCES or (not is_local_source(calib) and hub_dataset_id(calib) is not None):
        return "wikitext2"
    return "brown" if calib == "wiki" else "wiki"
