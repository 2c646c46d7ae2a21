"""What result files and reports record of the machine: package versions, CPU and GPU."""
from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from shuffleprune.runtime.memory import run_peak_cuda_bytes


def package_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def transformers_release() -> tuple[int, ...]:
    """The installed transformers' release numbers: ``(5, 24, 0)`` for 5.24.0, 5.24.0rc1 or 5.24.0.dev0."""
    import transformers
    from packaging.version import Version   # transformers' own dependency

    return Version(transformers.__version__).release


def versions(*packages: str) -> dict[str, str | None]:
    """Python, torch and transformers versions plus any extra ``packages``."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": package_version("transformers")}
    out.update({p: package_version(p) for p in packages})
    return out


def machine() -> dict:
    """CPU/GPU description for result files."""
    info = {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cpu_count": _cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def gpu_facts(device: torch.device) -> dict:
    """What a report records of a CUDA compute device, the one named (``cuda:1`` too, not the current
    device): its name and the peak memory allocated on it since :func:`.memory.start_run_peak` (else over this
    process's life), in MB, the per-stage marks of :func:`.memory.reset_peak_memory` included; for any other
    device, nothing."""
    if device.type != "cuda":
        return {}
    peak = run_peak_cuda_bytes(device)
    return {"gpu": torch.cuda.get_device_name(device), "peak_cuda_mb": round(peak / 2**20, 1)}


def cpu_facts() -> dict:
    """The CPU's model and the vector ISA torch's kernels use: float results (and so masks) can
    differ between hosts whose ISA differs (AVX-512 vs AVX2), not with the thread count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}
