"""What a document is, and how one is read from a dataset's row: text, or a conversation.

A row's document is its text field (:data:`TEXT_COLUMNS`), else its chat field (:data:`CHAT_FIELDS`:
``role``/``content`` messages, or ShareGPT's ``from``/``value``) as a :class:`Conversation`, else its
only string field (:func:`row_reader`). A conversation is rendered by the model's chat template when it
is tokenized (:func:`rendered`). :func:`with_text` is the one rule that leaves out documents without text, and
:func:`held_out_split` the one that splits a text's documents between fitting (``train``) and held-out
perplexity (``test``): every 10th held out.
"""
from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from shuffleprune.errors import UserError

TEXT_COLUMNS = ("text", "content", "document", "article", "body")
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


def with_text(docs: Iterable[str | None]) -> list[str]:
    """``docs`` but those without text (None, empty or whitespace only): the rule every reader of documents
    (files, hub rows, documents in memory) applies, so the same rows give the same documents wherever read."""
    return [d for d in docs if d is not None and d.strip()]


def documents_of_rows(rows: Iterable[dict], what: str, fix: str | None = None) -> list[str]:
    """The documents of a dataset's rows, each read as :func:`row_reader` reads the first (``what`` and ``fix``
    for its error); a row without one, or whose text is blank, is left out."""
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        return []
    read = row_reader(what, first, fix).read
    return with_text(map(read, itertools.chain([first], rows)))


def held_out_split(docs: list[str], split: str) -> list[str]:
    """One text's documents for ``split``: every 10th for ``test`` (held-out perplexity), the rest for ``train``."""
    return [d for i, d in enumerate(docs) if (i % 10 == 9) == (split == "test")]
