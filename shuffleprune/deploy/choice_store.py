"""``auto``'s measured choices kept on disk, so a restarted process does not measure them again.

``policy="auto"`` measures, once per kind of layer and token bucket, which implementation runs a
:class:`~shuffleprune.deploy.sparse_linear.SparseLinear` fastest (:mod:`.auto_choice`), cuSPARSELt's
configuration, which gather reads a mapped input (:mod:`.input_gather`) and how MoE experts run
(:mod:`.sparse_experts`). Each answer is also written here, one JSON file per kind of GPU and code:
``<cache>/auto_choices/<gpu name>-<fingerprint>.json`` (``<cache>`` is
:func:`shuffleprune.cache.cache_dir`). The fingerprint covers the GPU (name, compute capability, SM
count, memory), PyTorch, CUDA, Triton, this package's version and the source of its kernels and
runtime layers: change any of them and nothing stored applies (a new file is started). So a server
restarted on the same kind of GPU starts with the kernels it measured before, and runs the same ones
(its outputs do not change with timing noise between restarts).

Only CUDA devices store (elsewhere nothing is measured). ``SHUFFLEPRUNE_AUTO_STORE=0`` turns the store
off (every process measures anew); deleting the folder forgets it. An unreadable file is ignored with a
warning and written again; a folder that cannot be written is warned of once and the choices stay in
memory. Files are replaced whole (written aside, then renamed), so a reader never sees half a file;
two processes writing at once may each drop the other's newest answers, which are then measured again.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from shuffleprune.outdir import atomic_write
from shuffleprune.runtime.facts import package_version

STORE_ENV = "SHUFFLEPRUNE_AUTO_STORE"
FORMAT_NAME, FORMAT_VERSION = "shuffleprune.auto_choices", 1
TABLES = ("layers", "cslt", "gathers", "experts")   # auto_choice's two caches, input_gather's, sparse_experts'

_LOADED: dict[Path, dict[str, dict[str, Any]]] = {}   # store file → table → encoded key → value
_WARNED: set[Path] = set()                            # files whose failure was already warned of


def store_dir() -> Path:
    """The folder of the stored choices: ``auto_choices`` in the package's cache."""
    from shuffleprune.cache import cache_dir

    return cache_dir() / "auto_choices"


def enabled() -> bool:
    """Whether choices are stored: unless ``SHUFFLEPRUNE_AUTO_STORE`` is ``0``, ``off``, ``false`` or ``no``."""
    return os.environ.get(STORE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def recall(table: str, key: tuple) -> Any | None:
    """The stored answer of ``table`` (one of :data:`TABLES`) for ``key`` (its first element the device,
    the rest what the in-memory cache keys by), or None: none stored, the store off, or not a CUDA device.
    Lists come back as lists (the caller checks an answer still applies before using it)."""
    path = store_file(key[0])
    if path is None:
        return None
    return _tables(path).get(table, {}).get(encode_key(key[1:]))


def remember(table: str, key: tuple, value: Any) -> None:
    """Store ``value`` (JSON-able; tuples are kept as lists) as ``table``'s answer for ``key``: in memory,
    and in the device's file, merged with what other processes wrote there meanwhile."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; use one of {', '.join(TABLES)}")
    path = store_file(key[0])
    if path is None:
        return
    tables = _tables(path)
    tables.setdefault(table, {})[encode_key(key[1:])] = json.loads(json.dumps(value))
    for name, entries in _read(path, warn=False).items():   # another process's answers are kept
        for k, v in entries.items():
            tables.setdefault(name, {}).setdefault(k, v)
    _write(path, tables)


def stored_count(device: torch.device | str) -> int:
    """How many answers are stored for ``device`` (0 where nothing stores): what a benchmark records."""
    path = store_file(device)
    return 0 if path is None else sum(len(entries) for entries in _tables(path).values())


def forget_loaded() -> None:
    """Drop what was read from the files (the next lookup reads them again), as a new process starts."""
    _LOADED.clear()
    _WARNED.clear()


def store_file(device: torch.device | str) -> Path | None:
    """The file of ``device``'s choices (:func:`device_fingerprint`), or None where nothing is stored."""
    if not enabled():
        return None
    fingerprint = device_fingerprint(str(device))
    if fingerprint is None:
        return None
    try:
        return store_dir() / f"{fingerprint}.json"
    except OSError as exc:   # the cache folder cannot be made (a read-only home): choices stay in memory
        _warn_once(Path(fingerprint), f"cannot store kernel choices ({exc}); they are kept in memory only "
                                      f"(set SHUFFLEPRUNE_CACHE to a writable folder, or {STORE_ENV}=0)")
        return None


@functools.cache
def device_fingerprint(device: str) -> str | None:
    """``<gpu name>-<hash>`` of what decides which implementation is fastest on ``device`` (a CUDA device;
    None for any other): the GPU's name, compute capability, SM count and memory, PyTorch, CUDA and
    Triton versions, this package's version and :func:`code_fingerprint`."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(dev)
    facts = [props.name, props.major, props.minor, props.multi_processor_count, props.total_memory,
             getattr(props, "L2_cache_size", None), torch.__version__, torch.version.cuda,
             package_version("triton"), code_fingerprint()]
    return fingerprint_name(props.name, facts)


def fingerprint_name(name: str, facts: list) -> str:
    """``name`` made a file name's start (lower case, runs of other characters as ``-``), then 16 hex
    digits of the SHA-256 of ``facts``."""
    digest = hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:16]
    return f"{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-') or 'gpu'}-{digest}"


KERNEL_SOURCES = ("*.py", "*.cu", "*.cuh")   # the kernels' files: Python and Triton, and the CUDA text NVRTC compiles
RUNTIME_MODULES = ("timing", "faults", "graph_pools")   # shuffleprune.runtime's part in auto's choice


def fingerprinted_files() -> list[Path]:
    """The files whose text decides which implementation ``auto`` picks: the runtime's modules that time candidates,
    skip them and hold their state (:data:`RUNTIME_MODULES`), every kernel source (:data:`KERNEL_SOURCES`, CUDA
    included) and the deploy layers."""
    deploy = Path(__file__).parent
    runtime = deploy.parent / "runtime"
    kernels = Path(importlib.util.find_spec("shuffleprune.kernels").origin).parent
    return [*(runtime / f"{name}.py" for name in RUNTIME_MODULES),
            *sorted(p for pattern in KERNEL_SOURCES for p in kernels.glob(pattern)), *sorted(deploy.glob("*.py"))]


@functools.cache
def code_fingerprint() -> str:
    """SHA-256 of this package's version and the text of :func:`fingerprinted_files`: a change to any kernel
    (its CUDA text too) or to what ``auto`` weighs makes earlier answers inapplicable."""
    from shuffleprune.version import __version__

    digest = hashlib.sha256(__version__.encode())
    for path in fingerprinted_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def encode_key(key: tuple) -> str:
    """``key`` as a string: JSON of its elements, dtypes and devices by name, tuples as lists."""
    def plain(item: Any) -> Any:
        if isinstance(item, (torch.dtype, torch.device)):
            return str(item)
        if isinstance(item, (tuple, list)):
            return [plain(i) for i in item]
        return item

    return json.dumps(plain(key))


def _tables(path: Path) -> dict[str, dict[str, Any]]:
    if path not in _LOADED:
        _LOADED[path] = _read(path, warn=True)
    return _LOADED[path]


def _read(path: Path, warn: bool) -> dict[str, dict[str, Any]]:
    """The tables in ``path`` ({} where it does not exist, or cannot be read: warned of once)."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT_NAME or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"not {FORMAT_NAME} v{FORMAT_VERSION}")
        tables = data["tables"]
        if not all(isinstance(tables.get(t, {}), dict) for t in TABLES):
            raise ValueError("a table is not a mapping")
        return {t: dict(tables[t]) for t in TABLES if t in tables}
    except (FileNotFoundError, NotADirectoryError):   # nothing stored yet (a folder that cannot be one: at the write)
        return {}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        if warn:
            _warn_once(path, f"ignoring the stored kernel choices in '{path}' ({exc}); they are measured again "
                             "and the file rewritten")
        return {}


def _write(path: Path, tables: dict[str, dict[str, Any]]) -> None:
    """Replace ``path`` by ``tables`` whole (:func:`~shuffleprune.outdir.atomic_write`)."""
    text = json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "tables": tables}, indent=1,
                      sort_keys=True) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: tmp.write_text(text))
    except OSError as exc:
        _warn_once(path, f"cannot store kernel choices in '{path.parent}' ({exc}); they are kept in memory only "
                         f"(set {STORE_ENV}=0 to skip the store, or SHUFFLEPRUNE_CACHE to a writable folder)")


def _warn_once(path: Path, message: str) -> None:
    if path not in _WARNED:
        _WARNED.add(path)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
