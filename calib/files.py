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


_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"),
         (b"\xfe\xff", "utf-16"))   # UTF-32's before UTF-16's: FF FE 00 00 begins with UTF-16 LE's mark


def _bom_encoding(data: bytes) -> str | None:
    """The encoding a UTF-16 or UTF-32 byte-order mark at the start of ``data`` names, or None."""
    return next((name for bom, name in _BOMS if data.startswith(bom)), None)


def _convert_hint(path: Path) -> str:
    """How to make ``path`` UTF-8, for a message."""
    return f"convert it first, e.g. iconv -f latin1 -t utf-8 '{path}' > utf8{path.suffix}"


def _unreadable_bytes(path: Path, exc: UnicodeDecodeError, encoding: str | None, packed: bool) -> UserError:
    """The one-line error for a file whose bytes are not text in the encoding read (UTF-8 unless a mark said
    otherwise)."""
    where = f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start}" + (" after decompressing" if packed else "")
    if encoding:
        return UserError(f"'{path}' begins with a {encoding.upper()} byte-order mark but is not {encoding.upper()} text "
                         f"({where}): cut short? write it again, as UTF-8")
    if packed:
        return UserError(f"'{path}' does not hold UTF-8 text ({where})")
    return UserError(f"'{path}' is not UTF-8 text ({where}); {_convert_hint(path)}")


def read_text_file(path: Path) -> str:
    """A text file's contents (a ``.gz`` file decompressed): UTF-8, or UTF-16 / UTF-32 where a byte-order mark
    says so (Windows editors' "Unicode"); a leading mark dropped. Other bytes, and a damaged archive, are
    refused."""
    import gzip
    import zlib

    packed = path.suffix == ".gz"
    try:
        data = gzip.decompress(path.read_bytes()) if packed else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        damaged = " (a damaged or truncated gzip file?)" if packed else ""
        raise UserError(f"cannot read '{path}': {reason(exc)}{damaged}") from None
    encoding = _bom_encoding(data)
    try:
        return data.decode(encoding or "utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _unreadable_bytes(path, exc, encoding, packed) from None


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
        rows = table.slice(0, 1).to_pylist()
        if not rows:
            return []
        reader = row_reader(f"'{path}'", rows[0])
        return with_text(map(reader.read, table.select([reader.field]).to_pylist()))
    except (OSError, pa.ArrowException) as exc:
        if "invalid UTF8" in str(exc):
            raise UserError(f"'{path}' is not UTF-8 text ({reason(exc, 120)}); {_convert_hint(path)}") from None
        raise UserError(f"cannot read '{path}' as {kind}: {reason(exc, 120)}") from None
    except UnicodeDecodeError as exc:   # a CSV's cells, read as UTF-8
        raise _unreadable_bytes(path, exc, None, path.suffix == ".gz") from None


def _first_bytes(path: Path) -> bytes:
    """A file's first 4 bytes (decompressed, for a ``.gz`` one; none where it cannot be read: the reader
    then says why)."""
    import gzip
    import zlib

    try:
        with (gzip.open(path) if path.suffix == ".gz" else open(path, "rb")) as f:
            return f.read(4)
    except (OSError, EOFError, zlib.error):
        return b""


def _csv_docs(path: Path, delimiter: str) -> list[str]:
    """A ``.csv`` / ``.tsv`` file's documents (its first line names the columns; quoted cells may hold
    line breaks; every column read as text: "007" stays "007")."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    parse = pa_csv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    encoding = _bom_encoding(_first_bytes(path))
    options = pa_csv.ReadOptions(encoding=encoding or "utf8")

    def read():
        names = pa_csv.open_csv(path, read_options=options, parse_options=parse).schema.names
        as_text = pa_csv.ConvertOptions(column_types={n: pa.string() for n in names})
        return pa_csv.read_csv(path, read_options=options, parse_options=parse, convert_options=as_text)
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
