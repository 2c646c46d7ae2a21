"""``auto``'s measured choices kept on disk (``deploy/choice_store.py``): a restarted process takes them
instead of measuring, per kind of GPU and code, and a bad or unwritable store never stops a model."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from shuffleprune.deploy import auto_choice, choice_store, input_gather, sparse_experts
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.deploy.format import compress
from shuffleprune.masks import nm_keep_mask


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store in ``tmp_path`` that takes every device (the CPU stands in for a GPU here) and a fresh
    process's memory: nothing measured, nothing read yet."""
    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(tmp_path))
    monkeypatch.delenv(choice_store.STORE_ENV, raising=False)
    monkeypatch.setattr(choice_store, "device_fingerprint", lambda device: "test-gpu-0123456789abcdef")
    restart()
    yield tmp_path / "auto_choices" / "test-gpu-0123456789abcdef.json"
    restart()


def restart() -> None:
    """What a new process starts from: no choice in memory, no store file read."""
    auto_choice.release_choices()
    sparse_experts.release_mode_choices()
    choice_store.forget_loaded()


def _layer(rows: int = 24, cols: int = 64, mapped: bool = True) -> SparseLinear:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, cols, generator=g)
    values, meta = compress((w * nm_keep_mask(w.abs(), 2, 4)).half(), 2, 4)
    perm = torch.randperm(cols, generator=g) if mapped else None
    return SparseLinear(values, meta, cols, 2, 4, perm=perm)


def test_a_restarted_process_takes_the_stored_choice_instead_of_measuring(store, monkeypatch):
    """The first process measures each kind of layer and bucket once and writes the answer; after a
    restart a layer of that kind takes it unmeasured (both of the pair, in order); another bucket, or
    a stored answer this layer no longer weighs, is measured and written again."""
    measured = []

    def fake_measure(layer, x, candidates):
        measured.append(x.shape[-2])
        return candidates[-1], candidates[0] + "+pdl"

    monkeypatch.setattr(auto_choice, "measure", fake_measure)
    x1 = torch.randn(1, 1, 64).half()
    first = _layer()
    want = (first.candidates(x1)[-1], first.candidates(x1)[0] + "+pdl")
    assert first._choice(x1) == want[1] and first.choices[1] == want[0] and measured == [1]
    data = json.loads(store.read_text())
    assert data["format"] == "shuffleprune.auto_choices" and list(data["tables"]["layers"].values()) == [list(want)]

    restart()
    again = _layer()
    assert again._choice(x1) == want[1] and again.choices[1] == want[0] and measured == [1]   # not measured
    assert _layer(mapped=False)._choice(x1) and measured == [1, 1]   # another kind: measured and stored
    x5 = torch.randn(1, 5, 64).half()
    again._choice(x5)
    assert measured == [1, 1, 5] and len(json.loads(store.read_text())["tables"]["layers"]) == 3

    data = json.loads(store.read_text())
    for key in data["tables"]["layers"]:
        data["tables"]["layers"][key] = ["decode_withdrawn", "scratch"]   # an implementation no longer weighed
    store.write_text(json.dumps(data))
    restart()
    assert _layer()._choice(x1) == want[1] and measured == [1, 1, 5, 1]
    assert list(json.loads(store.read_text())["tables"]["layers"].values()).count(list(want)) == 1


def test_gathers_cslt_configs_and_experts_modes_are_stored_too(store, monkeypatch):
    """The input gathers' measured order, cuSPARSELt's searched configuration and the experts' mode
    come back from the store after a restart, unmeasured; a stored gather this input cannot take is
    measured again."""
    ran = []
    monkeypatch.setattr(input_gather, "_measure", lambda x, perm: ran.append("gather") or ("columns", "index_select"))
    monkeypatch.setattr(auto_choice, "cslt_search", lambda packed, xt, bias: ran.append("cslt") or (7, 2, 1))
    monkeypatch.setattr(sparse_experts, "measure_experts_mode", lambda *a: ran.append("experts") or "grouped")
    monkeypatch.setattr(sparse_experts, "grouped_runs_on", lambda x: True)
    projection = SimpleNamespace(mode="auto", kernels_apply=lambda: True, kind=lambda: (4, 32, 16, 64, 2, 4, True))
    module = SimpleNamespace(has_gate=True, nm_experts={"gate_up_proj": projection, "down_proj": projection})
    x, perm = torch.randn(3, 64), torch.randperm(64).int()
    hidden, top, weights = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)

    def everything() -> tuple:
        return (input_gather.gather_order(x, perm), auto_choice.cslt_config(None, x.T, None, rows=32),
                sparse_experts.experts_mode(module, hidden, top, weights))

    assert everything() == (("columns", "index_select"), (7, 2, 1), "grouped") and ran == ["gather", "cslt", "experts"]
    restart()
    assert everything() == (("columns", "index_select"), (7, 2, 1), "grouped") and len(ran) == 3
    data = json.loads(store.read_text())
    data["tables"]["gathers"] = {key: ["a_gather_of_another_version"] for key in data["tables"]["gathers"]}
    store.write_text(json.dumps(data))
    restart()
    assert everything()[0] == ("columns", "index_select") and ran[3:] == ["gather"]


def test_answers_other_processes_wrote_meanwhile_are_kept(store):
    """Each write merges the file's current answers: two processes measuring different layers at once
    both end up stored."""
    key = ("cuda:0", torch.bfloat16, 4096, 4096, 2, 4, 64, False, False)
    choice_store.remember("layers", (*key, 1), ["decode", "decode"])
    first_process = dict(choice_store._LOADED)
    choice_store.forget_loaded()                                       # a second process
    choice_store.remember("layers", (*key, 2), ["decode_swap", "decode_swap"])
    choice_store._LOADED.clear()
    choice_store._LOADED.update(first_process)                         # the first one writes again
    choice_store.remember("cslt", ("cuda:0", torch.bfloat16, 4096, 4096, False, 512), [3, 1, 0])
    choice_store.forget_loaded()
    assert [choice_store.recall("layers", (*key, b)) for b in (1, 2, 4)] == [["decode", "decode"],
                                                                         ["decode_swap", "decode_swap"], None]
    assert choice_store.recall("cslt", ("cuda:1", torch.bfloat16, 4096, 4096, False, 512)) == [3, 1, 0]
    assert choice_store.stored_count("cuda:0") == 3
    assert [p.name for p in store.parent.iterdir()] == [store.name]    # no temporary file left beside it


def test_an_unreadable_or_unwritable_store_is_warned_of_and_the_choices_kept_in_memory(store, tmp_path,
                                                                                     monkeypatch):
    """A corrupt file is ignored (one warning) and written whole again at the next answer; a store
    folder that cannot be made is warned of once, the answers kept for this process; the store
    turned off reads and writes nothing."""
    key = ("cuda:0", torch.float16, 32, 2, 1)
    store.parent.mkdir(parents=True)
    store.write_text('{"format": "shuffleprune.auto_choices", "version": 1, "tables": {"layers": ')   # cut short
    with pytest.warns(RuntimeWarning, match="ignoring the stored kernel choices"):
        assert choice_store.recall("gathers", key) is None
    choice_store.remember("gathers", key, ("rows",))
    choice_store.forget_loaded()
    assert choice_store.recall("gathers", key) == ["rows"]

    restart()
    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(tmp_path / "a_file"))
    (tmp_path / "a_file").mkdir()
    (tmp_path / "a_file" / "auto_choices").write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="cannot store kernel choices") as seen:
        choice_store.remember("gathers", key, ("columns",))
        choice_store.remember("gathers", (*key[:-1], 2), ("rows",))
    assert len(seen) == 1 and choice_store.recall("gathers", key) == ["columns"]
    with pytest.raises(ValueError, match="unknown table 'kernels'"):
        choice_store.remember("kernels", key, "decode")

    restart()
    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(tmp_path / "a_file" / "auto_choices" / "below"))   # cannot be made
    with pytest.warns(RuntimeWarning, match="cannot store kernel choices") as seen:
        assert choice_store.recall("gathers", key) is None
        choice_store.remember("gathers", key, ("rows",))
    assert len(seen) == 1

    restart()
    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(tmp_path / "off"))
    monkeypatch.setenv(choice_store.STORE_ENV, "0")
    choice_store.remember("gathers", key, ("rows",))
    assert choice_store.recall("gathers", key) is None and not (tmp_path / "off" / "auto_choices").exists()


def test_the_store_file_names_the_gpu_and_changes_with_anything_that_decides_speed(monkeypatch):
    """One file per kind of GPU and software: the name starts with the GPU's, and any fact that decides
    which kernel is fastest (compute capability, SMs, versions, the kernels' source) makes another
    file. A CPU device stores nothing (nothing is measured there)."""
    facts = ["NVIDIA H100 80GB HBM3", 9, 0, 132, 85e9, 50 * 2**20, "2.11.0", "12.8", "3.6.0", "abc"]
    name = choice_store.fingerprint_name(facts[0], facts)
    assert name.startswith("nvidia-h100-80gb-hbm3-") and len(name.rsplit("-", 1)[1]) == 16
    assert choice_store.fingerprint_name(facts[0], list(facts)) == name
    for i in range(1, len(facts)):
        changed = facts[:i] + ["other"] + facts[i + 1:]
        assert choice_store.fingerprint_name(facts[0], changed) != name
    assert choice_store.device_fingerprint("cpu") is None and choice_store.store_file(torch.device("cpu")) is None
    assert choice_store.stored_count("cpu") == 0
    code = choice_store.code_fingerprint()
    assert len(code) == 64 and code == choice_store.code_fingerprint()


def test_the_code_fingerprint_reads_the_cuda_text_of_the_kernels_too(monkeypatch, tmp_path):
    """The sparse-MMA kernels are CUDA text NVRTC compiles: a change to it, or to a header both share, must make
    earlier answers inapplicable like a change to any Python kernel."""
    names = {p.name for p in choice_store.fingerprinted_files()}
    assert {"nm_sparse_mma.cu", "nm_sparse_gemm.cu", "nm_sparse_common.cuh", "nm_sparse_gemm.py", "timing.py",
            "faults.py"} <= names
    assert all(p.is_file() for p in choice_store.fingerprinted_files())
    kernel = tmp_path / "k.cu"
    kernel.write_text("one text")
    monkeypatch.setattr(choice_store, "fingerprinted_files", lambda: [kernel])
    before = choice_store.code_fingerprint.__wrapped__()
    kernel.write_text("another text")
    assert choice_store.code_fingerprint.__wrapped__() != before
