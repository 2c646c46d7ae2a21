"""Facts a run reports about where it ran: memory high-water marks."""
from __future__ import annotations

import torch

from shuffleprune.runtime import peak_memory_mb, peak_rss_mb, reset_peak_memory


def test_a_per_stage_memory_reset_keeps_the_process_peak():
    big = torch.ones(64 * 2**20)  # 256 MB, touched
    big.add_(1.0)
    high = peak_rss_mb()
    del big
    reset_peak_memory(torch.device("cpu"))  # a stage starts: its own mark restarts (where Linux allows)
    assert peak_memory_mb(torch.device("cpu")) > 0
    # but the process's peak, which reports and bench rows give, is kept (within 1 MB: Linux updates
    # its RSS counters lazily per thread; without the fix it drops by the 256 MB freed above)
    assert peak_rss_mb() >= high - 1.0


def test_devices_are_checked_against_the_machine(monkeypatch):
    """`cuda:N` beyond the GPUs there are, and a malformed name, are one-line errors naming the device
    (`cuda:3` on a one-GPU machine passed and failed later in CUDA; `cuda:x` was a RuntimeError)."""
    import pytest

    from shuffleprune.errors import UserError
    from shuffleprune.runtime import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    for name in ("cuda:x", "gpu", "cuda:", "cpu:0"):
        with pytest.raises(UserError, match=rf"unknown --device '{name}'"):
            pick_device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"--device cuda:1 was asked for but no CUDA GPU"):
        pick_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda", 1) and pick_device("cuda") == torch.device("cuda")
    with pytest.raises(UserError, match=r"--device cuda:2: this machine has 2 CUDA GPUs \(cuda:0 … cuda:1\)"):
        pick_device("cuda:2")


def test_a_gpu_run_reports_the_gpu_it_ran_on_and_its_own_peak(monkeypatch):
    """A report of a run on ``cuda:1`` names that GPU and its peak memory, not the current device's
    (``torch.cuda.max_memory_allocated()`` without a device read cuda:0's), and the CPU none."""
    from shuffleprune.runtime import gpu_facts

    peaks = {0: 7 * 2**20, 1: 3 * 2**30}
    names = {0: "first GPU", 1: "second GPU"}
    index = lambda device=None: 0 if device is None else torch.device(device).index   # noqa: E731
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks[index(device)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[index(device)])
    assert gpu_facts(torch.device("cuda", 1)) == {"gpu": "second GPU", "peak_cuda_mb": 3072.0}
    assert gpu_facts(torch.device("cpu")) == {}
