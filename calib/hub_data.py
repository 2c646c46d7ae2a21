"""Text from the Hugging Face hub: the papers' corpora read as their loaders read them, and any hub
dataset, ``OWNER/NAME[:CONFIG][@SPLIT[START:STOP]]`` (:class:`HubDataset`), streamed.

- ``c4``        allenai/c4, en, train shard 00000 (calibration) / validation shard 00000 (ppl: its first
                1100 documents, at most 256 windows of the context, as SparseGPT and Wanda score it).
- ``wikitext2`` Salesforce/wikitext, wikitext-2-raw-v1 train (calibration) / test (ppl), joined with blank
                lines (the papers' ``wikitext`` under the id it has moved to: the bare name is reported
                not to resolve with newer ``huggingface_hub`` releases).
- ``wikitext103`` Salesforce/wikitext, wikitext-103-raw-v1 train / test (the DST papers' training text).
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import NamedTuple

from shuffleprune.calib.documents import documents_of_rows, held_out_split
from shuffleprune.calib.files import TEXT_FILES, text_file_kind
from shuffleprune.errors import UserError, reason
from shuffleprune.hub import looks_like_hub_id

HUB_SOURCES = ("c4", "wikitext2", "wikitext103")
WIKITEXT_REPO = "Salesforce/wikitext"
_C4_FILES = {"train": "en/c4-train.00000-of-01024.json.gz",
             "test": "en/c4-validation.00000-of-00008.json.gz"}
# SparseGPT's and Wanda's C4 perplexity: the first 1100 validation documents joined with spaces, and
# of those the first 256 windows of the context
C4_EVAL_DOCUMENTS, C4_EVAL_WINDOWS = 1100, 256
HUB_DATASET_DOCS = 20_000   # documents streamed from a hub dataset's split (calibration picks among them)


def _hub_unreachable(name: str, exc: Exception) -> UserError:
    """The one-line error for a hub text ``datasets`` could not load (no network, no such dataset …)."""
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return UserError(
        f"cannot load '{name}' from the Hugging Face hub ({why}); offline sources: "
        f"wiki, brown or a {TEXT_FILES} file (for --calib, --eval-text, --ppl-text or --data)")


def _unreadable(hub: HubDataset, exc: Exception) -> UserError:
    """The one-line error for a hub dataset, or a dataset directory, ``datasets`` could not read."""
    if not hub.local:
        return _hub_unreachable(hub.dataset, exc)
    return UserError(f"cannot read {hub.what} as a dataset ({reason(exc, 160)}); give one of its files instead")


def load_paper_text(name: str, split: str) -> list[str]:
    """The ``train`` or ``test`` documents of ``c4``, ``wikitext2`` or ``wikitext103``, as the papers' loaders read them."""
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


class HubDataset(NamedTuple):
    """A ``--calib OWNER/NAME[:CONFIG][@SPLIT[START:STOP]]`` value: a hub dataset, and the rows of one
    of its splits when one is named (``split`` None: ``train`` and its held-out pair, see
    :func:`load_hub_dataset`); or, ``local``, ``DIR@SPLIT[START:STOP]``: a dataset's files on this
    machine (a snapshot downloaded from the hub, ``data/train_sft-00000-of-00003.parquet`` …)."""

    repo: str                 # OWNER/NAME, or the directory's resolved path
    config: str | None = None
    split: str | None = None
    start: int = 0
    stop: int | None = None   # with a split and no stop: HUB_DATASET_DOCS rows from start
    local: bool = False

    @property
    def dataset(self) -> str:
        """``OWNER/NAME[:CONFIG]``, or the directory."""
        return self.repo if self.config is None else f"{self.repo}:{self.config}"

    @property
    def what(self) -> str:
        """How messages name it."""
        return f"dataset directory '{self.repo}'" if self.local else f"hub dataset '{self.dataset}'"

    @property
    def rows(self) -> range:
        """The rows an explicit split is read at."""
        return range(self.start, self.stop if self.stop is not None else self.start + HUB_DATASET_DOCS)

    def same_split(self, other: HubDataset) -> bool:
        """Whether ``other`` reads the same split of the same dataset (its rows may differ)."""
        return (self.repo, self.config, self.split, self.local) == (other.repo, other.config, other.split, other.local)


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
    if hub.split is None:
        return hub.dataset
    rows = "" if hub.start == 0 and hub.stop is None else f"[{hub.start or ''}:{hub.stop or ''}]"
    return f"{hub.dataset}@{hub.split}{rows}"


def hub_dataset_id(name: str) -> HubDataset | None:
    """The :class:`HubDataset` of ``--calib OWNER/NAME``, ``OWNER/NAME:CONFIG`` and either with
    ``@SPLIT`` or ``@SPLIT[START:STOP]`` (any hub dataset with a text or chat column), or of a local
    directory with ``@SPLIT[START:STOP]``; None for anything else, a local path or a text file's name
    (``a/b@c.jsonl``) included. A malformed split is a :class:`UserError`."""
    if Path(name).expanduser().exists() or text_file_kind(Path(name)) is not None:   # a local text's name, not an id
        return None
    base, at, split = name.rpartition("@") if "@" in name else (name, "", "")
    if at and Path(base).expanduser().is_dir():
        return HubDataset(str(Path(base).expanduser().resolve()), None, *_split_rows(name, split), local=True)
    repo, _, config = base.partition(":")
    owner, _, dataset = repo.partition("/")
    if not (owner and dataset and looks_like_hub_id(repo)):
        return None
    if not at:
        return HubDataset(repo, config or None)
    return HubDataset(repo, config or None, *_split_rows(name, split))


def hub_splits(hub: HubDataset) -> list[str]:
    """The names of a hub dataset's splits (one the user named among them, else a one-line error naming them)."""
    import datasets

    from shuffleprune.hub import hub_reachable

    if not hub.local:
        hub_reachable()  # offline: fail fast from the local cache
    try:
        splits = list(datasets.get_dataset_split_names(hub.repo, hub.config))
    except Exception as exc:  # datasets raises many types for "no network" or "no such dataset"
        raise _unreadable(hub, exc) from exc
    if hub.split is not None and hub.split not in splits:
        raise UserError(f"{hub.what} has no split '{hub.split}'; its splits: {', '.join(splits)}")
    return splits


def load_hub_dataset(hub: HubDataset, split: str) -> list[str]:
    """Documents of a hub dataset, streamed (nothing else downloaded). With a split named: the rows
    asked for (:func:`hub_splits` checks the split when the source is named). Else up to
    :data:`HUB_DATASET_DOCS`: calibration reads its ``train`` split (else its first: ``train_sft``); held-out
    text its ``test`` or ``validation`` split (or the one paired with the first: ``test_sft``), or every 10th
    document of the calibration split when it has none. Rows are read by :func:`row_reader`: a text column,
    or a chat column (``messages``) as conversations."""
    import datasets

    splits = [] if hub.split else hub_splits(hub)
    try:
        held_out = None
        if hub.split:
            read, rows = hub.split, hub.rows
        else:
            train = "train" if "train" in splits else splits[0]
            paired = [train.replace("train", side, 1) for side in ("test", "validation")] if train.startswith("train") else []
            held_out = next((s for s in ("test", "validation", *paired) if s in splits), None)   # train_sft: test_sft
            read, rows = (held_out if split == "test" and held_out else train), range(HUB_DATASET_DOCS)
        stream = datasets.load_dataset(hub.repo, hub.config, split=read, streaming=True)
        docs = documents_of_rows(itertools.islice(stream, rows.start, rows.stop), hub.what,
                                 "write the text to a .jsonl file with a 'text' field and pass that instead")
    except UserError:
        raise
    except Exception as exc:  # datasets raises many types for "no network" or "no such dataset"
        raise _unreadable(hub, exc) from exc
    # a named split is used whole; one split for both sides: every 10th document held out
    return docs if hub.split or held_out else held_out_split(docs, split)
