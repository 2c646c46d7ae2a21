"""Local text files: ``.txt`` (documents separated by blank lines), ``.jsonl`` / ``.json`` (JSON lines,
or one array; each row read as a hub dataset's is), ``.csv`` / ``.tsv`` (a header, then rows; the text
column) and ``.parquet`` (its text or chat column); all but ``.parquet`` also gzip-compressed (``.gz``,
as C4's ``.json.gz`` shards). Bad bytes or lines are a
one-line error naming the place.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from shuffleprune.calib.documents import as_conversations, row_reader, with_text
from shuffleprune.errors import UserError, reason

TEXT_FILE_KINDS = (".txt", ".jsonl", ".json", ".csv", ".tsv", ".parquet")   # all but .parquet gzip-compressed too
TEXT_FILES = ".txt, .jsonl, .json, .csv, .tsv or .parquet"                    # as messages name them


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
    would be read from (:func:`row_reader` of the first line); blank ones left out, as the hub's rows."""
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
    return with_text(docs)


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
        return with_text(rows)
    conversations = as_conversations(rows)   # an array of conversations (message lists)
    if conversations is not None:
        return conversations
    return _jsonl_docs(path, "\n".join(json.dumps(r) for r in rows))


def _table_docs(path: Path, kind: str, read: Callable[[], Any]) -> list[str]:
    """The documents of a table file ``read`` reads with pyarrow: its text (or chat) column, picked as
    :func:`row_reader` picks its first row's; empty cells left out. A file it cannot read is a one-line error."""
    import pyarrow as pa

    try:
        table = read()
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"cannot read '{path}' as {kind}: {reason(exc, 120)}") from None
    rows = table.slice(0, 1).to_pylist()
    if not rows:
        return []
    reader = row_reader(f"'{path}'", rows[0])
    return with_text(map(reader.read, table.select([reader.field]).to_pylist()))


def _csv_docs(path: Path, delimiter: str) -> list[str]:
    """A ``.csv`` / ``.tsv`` file's documents (its first line names the columns; quoted cells may hold
    line breaks; every column read as text: "007" stays "007")."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    parse = pa_csv.ParseOptions(delimiter=delimiter, newlines_in_values=True)

    def read():
        names = pa_csv.open_csv(path, parse_options=parse).schema.names
        as_text = pa_csv.ConvertOptions(column_types={n: pa.string() for n in names})
        return pa_csv.read_csv(path, parse_options=parse, convert_options=as_text)
    return _table_docs(path, "TSV" if delimiter == "\t" else "CSV", read)


def _parquet_docs(path: Path) -> list[str]:
    """A ``.parquet`` file's documents."""
    import pyarrow.parquet as pq

    return _table_docs(path, "Parquet", lambda: pq.read_table(path))


def file_documents(path: Path) -> tuple[str, ...]:
    """The documents of a local text file (:func:`text_file_kind`: ``.txt``, blank-line separated;
    ``.jsonl`` / ``.json``; ``.csv`` / ``.tsv``; ``.parquet``), read and parsed when the source is named
    (bad bytes or lines are a one-line error naming the place) and held by its :class:`TextSource` only,
    so a large training text is freed with it."""
    kind = text_file_kind(path)
    if kind == ".parquet":
        return tuple(_parquet_docs(path))
    if kind in (".csv", ".tsv"):
        return tuple(_csv_docs(path, "," if kind == ".csv" else "\t"))
    text = read_text_file(path)
    if kind == ".jsonl":
        return tuple(_jsonl_docs(path, text))
    if kind == ".json":
        return tuple(_json_docs(path, text))
    return tuple(with_text(re.split(r"\n\s*\n", text)))
