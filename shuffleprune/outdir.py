"""Output directories: writable, never cleared when they hold the run's own inputs (a link to one, an
output dir on another disk, stays a link), with room for what a run writes there; a write that runs
out of space named as such."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

from shuffleprune.errors import UserError, reason


def holds(directory: str | Path, path: str | Path) -> bool:
    """Whether ``path`` is ``directory`` or lies inside it (neither needs to exist yet)."""
    top, inner = Path(directory).expanduser().resolve(), Path(path).expanduser().resolve()
    return inner == top or top in inner.parents


def _existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists."""
    place = Path(path).expanduser().absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    return place


def check_writable(directory: Path, flag: str, target: Path | None = None) -> None:
    """Refuse an output directory (the one ``target``, a file, goes in) that is a file or cannot be
    created or written in, before a run rather than after it: a file is made and removed in
    ``directory``, or in its nearest existing parent."""
    if target is None and Path(directory).exists() and not Path(directory).is_dir():
        raise UserError(f"{flag} '{directory}' is a file, not a directory; give a directory path")
    place = _existing(directory)
    try:
        if not place.is_dir():
            raise NotADirectoryError(f"'{place}' is a file")
        handle, name = tempfile.mkstemp(dir=place, prefix=".shuffleprune-write-check-")
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        raise UserError(f"{flag} '{target or directory}': cannot write in '{place}' "
                        f"({exc.strerror or reason(exc, 80)}); give a writable path") from None


def refuse_clearing_inputs(out: Path, inputs: Iterable[str | Path | None]) -> None:
    """Refuse to clear ``out`` when it is, or lies above, an existing local input (a model dir, a
    text file, earlier index maps): ``--overwrite`` would delete that input before it is read, or
    replace it with the result. Names that are no local path (hub ids, ``wiki``) are skipped."""
    for item in inputs:
        if item is None or str(item) == "" or not Path(item).expanduser().exists():
            continue
        if holds(out, item):
            what = "is" if holds(item, out) else "holds"
            raise UserError(f"--out '{out}' {what} the input '{item}': clearing it would delete that input; "
                            "give another --out")


def clear_dir(path: Path) -> None:
    """Empty ``path`` for a fresh run: the directory (or the one a symlink points to, the link kept)
    stays, and loses its contents (so the run's hold on it, :func:`held_alone`, holds on)."""
    if not path.exists():
        return
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


@contextmanager
def held_alone(out: Path, flag: str = "--out") -> Iterator[None]:
    """Hold the output directory ``out`` for this run alone (created if need be): a second run on it
    while this one goes on (another process on this host, or on one sharing the file system where
    it locks files) is refused, instead of both writing into it. The hold is a lock on the directory,
    released when the run ends or its process dies (a killed run never blocks its ``--resume``).
    Where ``out`` cannot be made or locked, the run goes on unguarded (its own checks say why)."""
    try:
        import fcntl
    except ImportError:   # not POSIX
        yield
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = os.open(out, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another run is writing in {flag} '{out}'; wait for it to end, or give another {flag}") from None
        except OSError:   # a file system without locks
            pass
        yield
    finally:
        os.close(handle)


def free_bytes(directory: Path) -> int:
    """Free bytes on the disk that ``directory`` (or its nearest existing parent) is on."""
    return shutil.disk_usage(_existing(directory)).free


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (through a link to a directory: what clearing it frees)."""
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def size_text(n: float) -> str:
    """``n`` bytes for a message: ``512 KiB``, ``3.4 GiB``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def check_free_space(out: Path, result: int, peak: int, flag: str = "--out", freed: int = 0,
                     shown: Path | None = None) -> None:
    """Refuse ``out`` when its disk cannot hold the run's ``result`` (the files it ends with), and warn
    when it has less than the run's ``peak`` (its work files beside them), before the run rather than
    hours into it; ``freed``: the bytes the run clears from ``out`` first; ``shown``: the path to name
    (by default ``out``)."""
    free = free_bytes(out) + freed
    if free < result:
        raise UserError(f"{flag} '{shown or out}': {size_text(free)} free on its disk, and what the run writes there takes "
                        f"about {size_text(result)}; free space or give another {flag}")
    if free < peak:
        warnings.warn(f"{flag} '{shown or out}': {size_text(free)} free on its disk, and the run may write up to about "
                      f"{size_text(peak)} there (its checkpoints along the way, then its result): it may run out of space",
                      UserWarning, stacklevel=2)


def out_of_space(exc: BaseException, directory: Path) -> bool:
    """Whether ``exc`` is a write that ran out of space in ``directory``: ENOSPC in its chain, or a write
    error while less than 16 MiB is free there (torch's serializer reports a short write as a position
    mismatch)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return free_bytes(directory) < 16 * 2**20
    except OSError:
        return False


@contextmanager
def space_errors(directory: Path, flag: str, shown: Path | None = None,
                 hint: Callable[[], str] = lambda: "") -> Iterator[None]:
    """Within the block, a write that runs out of space in ``directory`` (:func:`out_of_space`) is a
    one-line error naming where (``shown``, by default ``directory``), what to do (``flag``: the
    option that chose it) and ``hint()``, asked at once (before the caller removes its files)."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, UserError) or not out_of_space(exc, directory):
            raise
        raise UserError(f"ran out of disk space writing in '{shown or directory}' ({reason(exc, 100)}): free space "
                        f"or give another {flag}{hint()}") from exc


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` to a temporary file beside ``path``, named for this process and thread, then rename it onto
    ``path``: a reader finds it whole or not at all, two writers at once never write into one temporary
    file (the last rename wins), and a write that fails leaves no temporary file behind."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def written_beside(target: Path) -> Iterator[Path]:
    """A new directory beside ``target`` for the block to write in; when the block ends, it replaces
    ``target`` (which appears whole or not at all); when the block fails, it is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp-"))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
