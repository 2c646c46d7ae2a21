"""Facts a run reports about where it ran: memory high-water marks."""
from __future__ import annotations

import os

import pytest
import torch

from shuffleprune.errors import UserError
from shuffleprune.runtime.determinism import deterministic_algorithms
from shuffleprune.runtime.memory import peak_memory_mb, peak_rss_mb, reset_peak_memory


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
    from shuffleprune.runtime.devices import pick_device

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
    (``torch.cuda.max_memory_allocated()`` without a device read cuda:0's), and the CPU none; the peak is
    the whole run's, not the last stage's since its reset."""
    from shuffleprune.runtime import memory
    from shuffleprune.runtime.facts import gpu_facts

    peaks = {0: 7 * 2**20, 1: 3 * 2**30}
    names = {0: "first GPU", 1: "second GPU"}
    index = lambda device=None: 0 if device is None else torch.device(device).index   # noqa: E731
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks[index(device)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[index(device)])
    assert gpu_facts(torch.device("cuda", 1)) == {"gpu": "second GPU", "peak_cuda_mb": 3072.0}
    assert gpu_facts(torch.device("cpu")) == {}
    # a stage's reset of the mark (the driver's, per stage) does not lose the run's peak from the report
    monkeypatch.setattr(memory, "_CUDA_PEAK_BEFORE_RESET", {})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peaks.update({index(device): 0}))
    memory.reset_peak_memory(torch.device("cuda", 1))
    peaks[1] = 2**30   # the next stage's own, lower peak
    assert memory.peak_memory_mb(torch.device("cuda", 1)) == 1024.0   # the stage's mark: since the reset
    assert gpu_facts(torch.device("cuda", 1))["peak_cuda_mb"] == 3072.0 and peaks[0] == 7 * 2**20
    memory.start_run_peak(torch.device("cuda", 1))   # a second run in the process: its own peak only
    peaks[1] = 2**29
    assert gpu_facts(torch.device("cuda", 1))["peak_cuda_mb"] == 512.0


def test_deterministic_algorithms_are_strict_inside_and_restored(monkeypatch):
    """Strict, not warn-only (where SDPA's flash and memory-efficient backward keep their atomic sums),
    cuBLAS's fixed workspace unless one is set, no NaN fill of every ``torch.empty``; a caller's own
    settings come back on exit."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with deterministic_algorithms(False) as on:
        assert not on and not torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms(True) as on:
        assert on and torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert torch.utils.deterministic.fill_uninitialized_memory is True
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic_algorithms(True):
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_an_op_without_a_deterministic_implementation_is_a_one_line_error_naming_the_fix():
    x = torch.zeros(4)
    with pytest.raises(UserError, match=r"^put_ has no deterministic implementation .*; run without --deterministic$"):
        with deterministic_algorithms(True):
            x.put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))   # no deterministic form on any device
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="^something else$"):   # other errors pass through unchanged
        with deterministic_algorithms(True):
            raise RuntimeError("something else")


def test_run_to_fault_ends_a_gpu_script_at_once_on_a_device_fault(tmp_path):
    """A GPU script's ``DeviceFault`` (a kernel that faulted or hung the GPU) is printed and the process ends with
    status 1 without the interpreter's cleanup (here an atexit handler), which could wait on the stuck GPU; any
    other error ends it as Python does."""
    import subprocess
    import sys

    script = tmp_path / "gpu_script.py"
    script.write_text(
        "import atexit, sys\n"
        "from shuffleprune.runtime.faults import DeviceFault, run_to_fault\n"
        "atexit.register(lambda: print('cleanup ran', flush=True))\n"
        "def main():\n"
        "    raise (DeviceFault if sys.argv[1] == 'fault' else ValueError)('decode_x hung')\n"
        "run_to_fault(main)\n")
    fault = subprocess.run([sys.executable, str(script), "fault"], capture_output=True, text=True)
    assert fault.returncode == 1 and "DeviceFault: decode_x hung" in fault.stderr and "cleanup ran" not in fault.stdout
    other = subprocess.run([sys.executable, str(script), "other"], capture_output=True, text=True)
    assert other.returncode == 1 and "ValueError: decode_x hung" in other.stderr and "cleanup ran" in other.stdout


class _TimedGpu:
    """torch.cuda's streams, graphs and events as ``cuda_graph_ms`` uses them, with no GPU: each event recorded
    after ``hang_from`` graph replays (None: never) never completes; a completed timing pair spans 2 ms."""

    def __init__(self, monkeypatch, hang_from: int | None = None):
        import contextlib

        gpu = self
        self.replays, self.hang_from = 0, hang_from

        class Event:
            def __init__(self, enable_timing=False):
                self.hung = False

            def record(self, stream=None):
                self.hung = gpu.hang_from is not None and gpu.replays >= gpu.hang_from

            def query(self):
                return not self.hung

            def elapsed_time(self, end):
                return 2.0

        class Graph:
            def replay(self):
                gpu.replays += 1

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: type("S", (), {"wait_stream": lambda s, o: None})())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", lambda graph, stream=None: contextlib.nullcontext())


def test_a_timed_call_that_never_finishes_as_replayed_is_a_device_fault_naming_it(monkeypatch):
    """Each wait of the CUDA-graph timer polls with a limit: a kernel whose eager check finished but that never
    returns in the graph's replays ends the timing with a DeviceFault naming the candidate, not a process hung
    until its step's time limit; one that finishes is timed, and its last two outputs come back."""
    from shuffleprune.runtime.faults import DeviceFault
    from shuffleprune.runtime.timing import cuda_graph_ms

    _TimedGpu(monkeypatch)
    outputs: list = []
    calls = [lambda i=i: torch.full((1,), float(i)) for i in range(4)]
    assert cuda_graph_ms(calls, reps=3, outputs=outputs, limit_s=0.05) == (0.5, "cuda_graph")   # 2 ms over 4 calls
    assert [int(y) for y in outputs] == [2, 3]
    gpu = _TimedGpu(monkeypatch, hang_from=1)   # the first replay never ends
    with pytest.raises(DeviceFault, match=r"^decode \(64x64, 1 tokens\) did not finish in 0.05 s on this GPU.*"
                                          r"SHUFFLEPRUNE_SKIP_IMPLS=decode$"):
        cuda_graph_ms(calls, reps=3, what="decode (64x64, 1 tokens)", fix="SHUFFLEPRUNE_SKIP_IMPLS=decode",
                      limit_s=0.05)
    assert gpu.replays == 1   # stopped at the first wait after it
    _TimedGpu(monkeypatch, hang_from=0)   # already in the eager warm rounds
    with pytest.raises(DeviceFault, match=r"^a timed call did not finish in 0.05 s"):
        cuda_graph_ms(calls, reps=3, limit_s=0.05)


def test_a_wait_for_the_gpu_spins_before_it_sleeps(monkeypatch):
    """A timed replay's wait ends as the GPU does, not up to a millisecond's sleep later (about 25 s over the
    kernel table): ``wait_or_fault`` queries without sleeping for ``SPIN_S``, then sleeps between queries."""
    import time

    from shuffleprune.runtime import faults

    class Event:   # done after `after` queries
        def __init__(self, after):
            self.after, self.asked = after, 0

        def query(self):
            self.asked += 1
            return self.asked > self.after

    slept = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    faults.wait_or_fault(Event(50), "a timed call")
    assert slept == []   # done within the spin: no sleep at all
    monkeypatch.setattr(faults, "SPIN_S", 0.0)
    faults.wait_or_fault(Event(3), "a timed call")
    assert slept == [0.001] * 3   # past the spin: a millisecond between queries


def test_a_synchronisation_with_a_limit_spins_as_asked_and_names_a_step_that_never_ends(monkeypatch):
    """``sync_or_fault`` (bench_e2e's wall-clock timer waits through it): it waits for the current stream's work
    without a sleep where ``spin_s`` covers the wait (the wall time ends with the GPU), synchronises the device
    after, and a step that never ends is a DeviceFault naming it, with no device synchronise (that would hang)."""
    import time

    from shuffleprune.runtime import faults
    from shuffleprune.runtime.faults import DeviceFault

    class Gpu:
        def __init__(self, busy_for):
            self.busy_for, self.synced = busy_for, 0

    gpu = Gpu(200)

    class Event:
        def record(self, stream=None):
            self.asked = 0

        def query(self):
            self.asked += 1
            return self.asked > gpu.busy_for

    slept = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    monkeypatch.setattr(faults, "SPIN_S", 0.0)   # only spin_s keeps it from sleeping
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: setattr(gpu, "synced", gpu.synced + 1))
    faults.sync_or_fault("a prompt", limit_s=5.0, spin_s=5.0)
    assert slept == [] and gpu.synced == 1
    faults.sync_or_fault("a prompt", limit_s=5.0)   # the default spin (0 here): sleeps between queries
    assert slept == [0.001] * 200 and gpu.synced == 2
    gpu.busy_for = 10**12
    with pytest.raises(DeviceFault, match=r"^a decode did not finish in 0.02 s on this GPU.*; try X$"):
        faults.sync_or_fault("a decode", "try X", limit_s=0.02, spin_s=0.02)
    assert gpu.synced == 2
