"""What makes a run repeat: a seed in range, PyTorch's deterministic algorithms, one thread for CPU factorizations."""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from contextlib import contextmanager
from typing import Iterator

import torch

from shuffleprune.errors import UserError


def check_seed(seed: int) -> None:
    """Refuse a seed outside ``0 … 2**32 − 1`` (what every generator a run seeds accepts, offsets added)."""
    if not 0 <= seed < 2**32:
        raise UserError(f"--seed must be in 0 … {2**32 - 1}, got {seed}")


_NO_DETERMINISTIC = re.compile(r"(\S+) does not have a deterministic implementation")
CUBLAS_WORKSPACE = ":4096:8"   # cuBLAS's fixed workspace that deterministic mode asks for (CUDA >= 10.2)


@contextmanager
def deterministic_algorithms(enabled: bool, hint: Callable[[], str] = lambda: "") -> Iterator[bool]:
    """With ``enabled``, while inside: PyTorch's deterministic algorithms, strict (an op that has none
    raises, here as a one-line :class:`UserError` naming ``--deterministic`` and ``hint()``; in warn-only
    mode the flash and memory-efficient attention backward would keep their atomic, run-to-run varying
    sums), cuBLAS on a fixed workspace (``CUBLAS_WORKSPACE_CONFIG`` unless set, read at the process's
    first cuBLAS call) and ``torch.empty`` left unfilled (nothing reads uninitialized memory). All
    restored on exit; yields whether it is on. CPU runs repeat bit for bit without it; on a GPU it is
    what should make a run's repeat do so (not yet run on one: README, *Same command, same checkpoint*)."""
    if not enabled:
        yield False
        return
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield True
    except RuntimeError as exc:
        found = _NO_DETERMINISTIC.search(str(exc))
        if found is None:
            raise
        raise UserError(f"{found.group(1)} has no deterministic implementation in PyTorch {torch.__version__} "
                        f"on this device; run without --deterministic{hint()}") from exc
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


@contextmanager
def one_cpu_thread(device: torch.device | str) -> Iterator[None]:
    """Run CPU LAPACK factorizations on one thread while inside: MKL's multi-threaded Cholesky sums
    in an order that depends on the thread count, which changes SparseGPT's masks (and so a
    checkpoint) between machines, loads and ``OMP_NUM_THREADS`` settings. No effect on CUDA."""
    if torch.device(device).type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
