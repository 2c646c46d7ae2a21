"""What ``gpu_run.sh`` leaves out after its sparse-tensor-core steps (``scripts/leave_out.py``), and the tuning scripts'
hang check (``kernel_cases.checked_launch``) that names a launch that never finishes."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import kernel_cases  # noqa: E402
import leave_out  # noqa: E402

from shuffleprune.deploy.impls import (SPARSE_GEMM, SPARSE_MMA_DECODES, SPARSE_WGMMA,  # noqa: E402
                                       SPARSE_WGMMA_MAPPED)


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def _gemm_row(err: float, wgmma: bool, mapped: bool = False) -> dict:
    return {"impl": "sparse_gemm", "rel_err": err, "plan": {"wgmma": wgmma, "mapped": mapped}}


def test_a_form_whose_every_checked_launch_is_wrong_is_left_out_and_a_right_one_kept(tmp_path):
    _write(tmp_path / "tune_sparse_gemm.json", {"rows": [
        {"impl": "dense", "ms": 1.0}, _gemm_row(3e-3, False), _gemm_row(0.9, False),   # mma.sp: one right
        _gemm_row(0.7, True), _gemm_row(1.0, True),                                      # wgmma: all wrong
        _gemm_row(0.5, True, True)]})                                                    # its mapped decode too
    found = leave_out.left_out(tmp_path)
    assert set(found) == {SPARSE_WGMMA, SPARSE_WGMMA_MAPPED} and "least error 0.7" in found[SPARSE_WGMMA]
    _write(tmp_path / "tune_sparse_gemm.json", {"rows": [_gemm_row(0.7, True)]})   # its mapped decode not checked
    assert set(leave_out.left_out(tmp_path)) == {SPARSE_WGMMA, SPARSE_WGMMA_MAPPED}
    _write(tmp_path / "tune_sparse_gemm.json", {"rows": [_gemm_row(0.7, True), _gemm_row(1e-3, True, True)]})
    assert set(leave_out.left_out(tmp_path)) == {SPARSE_WGMMA}   # the mapped decode checked right itself


def test_a_probe_with_no_right_reading_leaves_out_the_decodes_and_the_mma_sp_gemm(tmp_path):
    rows = [{"impl": "sparse_mma", "rel_err": 0.6}, {"impl": "sparse_mma_tall", "rel_err": 0.4}]
    _write(tmp_path / "tune_sparse_mma.json", {"probe": [{"knobs": [], "right": False}], "reading": None, "rows": rows})
    assert set(leave_out.left_out(tmp_path)) == {*SPARSE_MMA_DECODES, SPARSE_GEMM}
    _write(tmp_path / "tune_sparse_mma.json", {"probe": [{"knobs": [], "right": True}], "reading": [], "rows": rows})
    assert leave_out.left_out(tmp_path) == {}   # a right reading: its wrong rows are the plans', not the fragments'


def test_a_kernel_right_in_its_check_but_wrong_in_every_timed_graph_is_left_out(tmp_path):
    def replayed(row: dict, err: float) -> dict:
        return {**row, "ms": 0.1, "replayed_rel_err": err}

    _write(tmp_path / "tune_sparse_gemm.json", {"rows": [
        replayed(_gemm_row(1e-3, False), 1e-3), replayed(_gemm_row(1e-3, False), 0.8),   # mma.sp: one graph right
        replayed(_gemm_row(2e-3, True), 0.5), replayed(_gemm_row(2e-3, True), 0.9)]})    # wgmma: every graph wrong
    found = leave_out.left_out(tmp_path)
    assert set(found) == {SPARSE_WGMMA, SPARSE_WGMMA_MAPPED}
    assert "all 2 timed CUDA graphs wrong as replayed (least error 0.5" in found[SPARSE_WGMMA]
    rows = [replayed({"impl": "sparse_mma", "rel_err": 1e-3}, 0.3),
            replayed({"impl": "sparse_mma_tall", "rel_err": 1e-3}, 1.0),
            {"impl": "sparse_mma", "rel_err": 0.9}]   # refused, never timed: no replayed error
    _write(tmp_path / "tune_sparse_mma.json", {"rows": rows})
    found = leave_out.left_out(tmp_path)
    assert set(SPARSE_MMA_DECODES) <= set(found) and "wrong as replayed in all 2 timed" in found[SPARSE_MMA_DECODES[0]]
    rows[0]["replayed_rel_err"] = 4e-3   # one graph right: the decodes stay
    _write(tmp_path / "tune_sparse_mma.json", {"rows": rows})
    assert not set(SPARSE_MMA_DECODES) & set(leave_out.left_out(tmp_path))


def test_a_hung_launch_leaves_out_its_kernel_and_files_of_an_earlier_call_are_not_read(tmp_path):
    gemm = tmp_path / "tune_sparse_gemm.json"
    _write(kernel_cases.hung_marker(gemm), {"kernel": "sparse_gemm", "plan": {"wgmma": True, "mapped": False}})
    _write(kernel_cases.hung_marker(tmp_path / "tune_sparse_mma.json"), {"kernel": "sparse_mma", "probe": []})
    found = leave_out.left_out(tmp_path)
    assert set(found) == {*SPARSE_MMA_DECODES, SPARSE_WGMMA, SPARSE_WGMMA_MAPPED}
    assert "hung in tune_sparse_gemm" in found[SPARSE_WGMMA]
    assert leave_out.left_out(tmp_path, since=time.time() + 60) == {}


def test_checked_launch_ends_the_process_naming_a_launch_that_never_finishes(monkeypatch, tmp_path):
    out = tmp_path / "tune_sparse_gemm.json"

    class Event:   # a kernel that finishes after `polls` queries (never: None)
        polls = None

        def record(self, stream=None):
            self.asked = 0

        def query(self):
            self.asked += 1
            return Event.polls is not None and self.asked >= Event.polls

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(os, "_exit", exit_now)
    y = SimpleNamespace(is_cuda=True)   # a launch's output on the GPU
    Event.polls = 3
    assert kernel_cases.checked_launch(lambda: y, {"kernel": "sparse_gemm"}, out, limit_s=5) is y
    assert not kernel_cases.hung_marker(out).exists()
    Event.polls = None
    with pytest.raises(SystemExit) as ended:
        kernel_cases.checked_launch(lambda: y, {"kernel": "sparse_gemm", "plan": {"wgmma": True}}, out, limit_s=0.05)
    assert ended.value.code == kernel_cases.HUNG_EXIT
    assert json.loads(kernel_cases.hung_marker(out).read_text()) == {"kernel": "sparse_gemm", "plan": {"wgmma": True},
                                                                       "seconds": 0.05}


def test_checked_timing_ends_the_process_naming_a_launch_that_hangs_only_as_timed(monkeypatch, tmp_path):
    from shuffleprune.runtime import timing
    from shuffleprune.runtime.faults import DeviceFault

    out = tmp_path / "tune_sparse_mma.json"
    asked = {}

    def timer(calls, reps, outputs=None, what="", limit_s=None, **kw):
        asked.update(what=what, limit_s=limit_s)
        if limit_s < 1:
            raise DeviceFault(f"{what} did not finish in {limit_s:g} s on this GPU")
        outputs.append("y")
        return 0.25, "cuda_graph"

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(timing, "cuda_graph_ms", timer)
    monkeypatch.setattr(os, "_exit", exit_now)
    label, outputs = {"kernel": "sparse_mma", "tokens": 16}, []
    assert kernel_cases.checked_timing([], 3, label, out, outputs, limit_s=5) == 0.25 and outputs == ["y"]
    assert json.loads(asked["what"]) == label and not kernel_cases.hung_marker(out).exists()
    with pytest.raises(SystemExit) as ended:
        kernel_cases.checked_timing([], 3, label, out, [], limit_s=0.05)
    assert ended.value.code == kernel_cases.HUNG_EXIT
    assert json.loads(kernel_cases.hung_marker(out).read_text()) == {**label, "timed": True, "seconds": 0.05}
