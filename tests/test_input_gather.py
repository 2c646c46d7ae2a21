"""How a mapped layer's input is gathered (``shuffleprune/deploy/input_gather.py``): the measured order
of the three ways, kept per device, dtype, width and token bucket; a dependent launch's Triton gather;
what a capture gets; and that ``SparseLinear`` and ``MappedOutput`` gather through it. The GPU's
timer is faked (the kernels run under ``TRITON_INTERPRET=1``); which way is really fastest on an H100
is what ``scripts/bench_kernel.py`` measures (``norm_rows``)."""
from __future__ import annotations

import pytest
import torch

from shuffleprune.deploy import input_gather
from shuffleprune.deploy.format import compress
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.masks import nm_keep_mask


@pytest.fixture
def timed(monkeypatch):
    """Gathers measured on the CPU: each way's faked CUDA-graph time is ``times[way]``; returns
    ``(times, measured, ran, sizes)``: each way as it is timed, each way as it runs, and the calls in
    each timed graph."""
    times = {"index_select": 3.0, "columns": 2.0, "rows": 1.0}
    measured: list[str] = []

    def graph_timer(calls, reps, warm=2):
        before = list(ran)
        calls[0]()
        measured.append(ran[len(before)])
        sizes.append(len(calls))
        return times[measured[-1]], "cuda_graph"

    ran: list[str] = []
    sizes: list[int] = []
    real_run = input_gather.run_gather

    def run(how, x, perm, pdl=False):
        ran.append(how)
        return real_run(how, x, perm, pdl)

    input_gather.release_gather_choices()
    monkeypatch.setattr(input_gather, "measured_here", lambda x: True)
    monkeypatch.setattr(input_gather, "cuda_graph_ms", graph_timer)
    monkeypatch.setattr(input_gather, "run_gather", run)
    yield times, measured, ran, sizes
    input_gather.release_gather_choices()


def _input(tokens: int, width: int, dtype=torch.float16):
    g = torch.Generator().manual_seed(tokens * 1000 + width)
    return torch.randn(tokens, width, generator=g).to(dtype), torch.randperm(width, generator=g).to(torch.int32)


def test_the_fastest_way_gathers_and_is_measured_once_per_kind_of_input(timed):
    """The first gather of a width, dtype and token bucket times every way; later ones of that kind
    (3 and 4 tokens share a bucket) run the fastest without timing; another bucket, width or dtype
    measures again, and so does any after ``release_choices``. Every answer is ``x[..., perm]``."""
    times, measured, ran, sizes = timed
    x, perm = _input(3, 40)
    assert torch.equal(input_gather.gather_input(x, perm), x[..., perm.long()])
    assert sorted(measured) == ["columns", "index_select", "rows"] and ran[-1] == "rows"
    assert sizes == [8, 8, 8]   # each way timed as 8 calls in one graph
    assert input_gather.gather_orders() == input_gather.gather_orders("cpu") == {(40, 4, None): ("rows", "columns",
                                                                                                "index_select")}
    assert input_gather.gather_orders("cuda:0") == {}
    x4, _ = _input(4, 40)
    assert torch.equal(input_gather.gather_input(x4, perm), x4[..., perm.long()])
    assert len(measured) == 3 and ran[-1] == "rows"
    times.update(rows=5.0)
    x5, _ = _input(5, 40)                       # bucket 8: measured again, now columns is fastest
    input_gather.gather_input(x5, perm)
    assert len(measured) == 6 and ran[-1] == "columns"
    input_gather.gather_input(x4.float(), perm)          # another dtype
    input_gather.gather_input(*_input(3, 48))           # another width
    assert len(measured) == 12
    from shuffleprune.deploy.auto_choice import release_choices

    release_choices()                                   # forgetting auto's choices forgets the gathers' too
    input_gather.gather_input(x4, perm)
    assert len(measured) == 15


def test_no_tokens_are_gathered_without_measuring_and_have_no_bucket_of_their_own(timed):
    """An empty input (no tokens: an expert nothing was routed to) is gathered as it is and times
    nothing, so no order is kept for it; before, its bucket was that of two tokens, and an empty
    input's timings would have chosen their gather."""
    times, measured, ran, sizes = timed
    assert [input_gather.token_bucket(t) for t in (0, 1, 2, 3, 4, 5, 17)] == [0, 1, 2, 4, 4, 8, 32]
    x, perm = _input(0, 40)
    for empty in (x, x.view(2, 0, 40)):
        y = input_gather.gather_input(empty, perm)
        assert y.shape == empty.shape and measured == [] and input_gather.gather_orders() == {}


def test_a_dependent_launch_takes_the_fastest_triton_gather(timed):
    """With ``pdl`` the gather is the fastest of the Triton ones, even where ``index_select`` is faster
    (it cannot let the next kernel start early)."""
    times, measured, ran, sizes = timed
    times.update(index_select=0.5, columns=2.0, rows=1.0)
    x, perm = _input(2, 64)
    input_gather.gather_input(x, perm)
    assert ran[-1] == "index_select"
    assert torch.equal(input_gather.gather_input(x, perm, pdl=True), x[..., perm.long()]) and ran[-1] == "rows"


def test_a_way_that_disagrees_or_cannot_run_is_dropped(timed, monkeypatch):
    """A gather whose output differs from ``index_select`` is dropped with a warning; one that raises
    what a kernel that cannot run on this device raises is dropped silently; the others are timed."""
    times, measured, ran, sizes = timed
    real = input_gather.run_gather

    def flawed(how, x, perm, pdl=False):
        if how == "rows":
            return real(how, x, perm, pdl) + 1
        if how == "columns":
            raise RuntimeError("out of resources")
        return real(how, x, perm, pdl)

    monkeypatch.setattr(input_gather, "run_gather", flawed)
    x, perm = _input(16, 24)
    with pytest.warns(RuntimeWarning, match="rows gather of 24 columns differs"):
        assert input_gather.gather_order(x, perm) == ("index_select",)


def test_a_capture_with_nothing_measured_takes_index_select_without_keeping_it(timed, monkeypatch):
    """Inside a CUDA graph capture nothing is timed: ``index_select`` (the column kernel for a dependent
    launch), and the next gather outside a capture measures."""
    times, measured, ran, sizes = timed
    monkeypatch.setattr(input_gather, "capturing", lambda x: True)
    x, perm = _input(8, 32)
    assert torch.equal(input_gather.gather_input(x, perm), x[..., perm.long()]) and ran[-1] == "index_select"
    input_gather.gather_input(x, perm, pdl=True)
    assert ran[-1] == "columns" and measured == []
    monkeypatch.setattr(input_gather, "capturing", lambda x: False)
    input_gather.gather_input(x, perm)
    assert len(measured) == 3 and ran[-1] == "rows"


def test_a_long_prompts_gather_is_timed_over_fewer_calls():
    """The timed graph holds at most 1 GiB of gathered outputs: 8 calls of a decode's input, fewer of a
    long prompt's, one of anything larger."""
    assert input_gather.timed_calls(2 * 14336) == 8
    assert input_gather.timed_calls(32768 * 4096 * 2) == 4
    assert input_gather.timed_calls(32768 * 14336 * 2) == 1 == input_gather.timed_calls(10**12)


def test_rows_is_not_a_way_for_rows_too_wide_for_its_shared_memory():
    """Only the ways that apply are timed: no row gather past 64 KiB of row."""
    assert input_gather.gather_ways(torch.zeros(2, 100, dtype=torch.float16)) == ["index_select", "columns", "rows"]
    assert input_gather.gather_ways(torch.zeros(2, 16385)) == ["index_select", "columns"]
    with pytest.raises(ValueError, match="unknown gather"):
        input_gather.run_gather("scatter", torch.zeros(1, 4), torch.arange(4, dtype=torch.int32))


def test_off_the_gpu_a_gather_is_index_select_and_nothing_is_measured(monkeypatch):
    """On the CPU (no measured choice) the gather is ``index_select`` and nothing is timed."""
    monkeypatch.setattr(input_gather, "cuda_graph_ms", lambda *a, **k: pytest.fail("timed on the CPU"))
    x, perm = _input(5, 30)
    assert not input_gather.measured_here(x)
    assert torch.equal(input_gather.gather_input(x, perm), x[..., perm.long()])


def test_sparse_linear_and_mapped_norms_gather_through_the_measured_way(timed):
    """A mapped ``SparseLinear`` gathers its input the measured way (here the row kernel) and gives the
    reference output; a ``MappedOutput`` over a module that is no RMSNorm gathers the same way."""
    from shuffleprune.deploy.producer_maps import MappedOutput

    times, measured, ran, sizes = timed
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g)
    w = w * nm_keep_mask(w.abs(), 2, 4).float()
    values, meta = compress(w, 2, 4)
    perm = torch.randperm(64, generator=g)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, policy="scratch")
    x = torch.randn(2, 5, 64, generator=g)
    assert torch.allclose(layer(x), x[..., perm] @ w.T, atol=1e-5) and ran[-1] == "rows"
    relu = MappedOutput(torch.nn.ReLU(), perm)
    assert torch.equal(relu(x), torch.relu(x)[..., perm]) and ran[-1] == "rows"
    # both measured under the map's span (a random map over 64 columns: 64), once for the two
    assert len(measured) == 3 and set(input_gather.gather_orders()) == {(64, 16, 64)}


def test_map_span_is_how_far_a_map_moves_an_index_in_aligned_blocks():
    """The smallest power-of-two block that holds every move: 1 for the identity, the block of a
    block-diagonal map (prune's: 64), the width rounded up for a map over all columns."""
    from shuffleprune.perm.core import random_block_perm

    g = torch.Generator().manual_seed(0)
    assert input_gather.map_span(torch.arange(4096)) == 1
    assert input_gather.map_span(torch.tensor([1, 0, 2, 3])) == 2
    assert input_gather.map_span(torch.tensor([0, 1, 3, 2, 4])) == 2
    assert input_gather.map_span(torch.tensor([0, 2, 1, 3])) == 4   # 1 and 2 lie in different blocks of 2
    assert input_gather.map_span(random_block_perm(4096, 64, g)) == 64
    assert input_gather.map_span(random_block_perm(11008, 64, g).to(torch.int32)) == 64   # int32, as layers hold maps
    assert input_gather.map_span(random_block_perm(100, 64, g)) == 64   # a tail block of 36
    assert input_gather.map_span(torch.randperm(4096, generator=g)) == 4096
    assert input_gather.map_span(torch.randperm(11008, generator=g)) == 16384
    assert input_gather.map_span(torch.zeros(0, dtype=torch.long)) == 1


def test_maps_of_another_span_measure_their_own_gather(timed):
    """A gather given its map's span measures apart from another span's: a map within blocks of 64
    columns reads the input nearly in order and may want another way than one over all columns."""
    from shuffleprune.perm.core import random_block_perm

    times, measured, ran, sizes = timed
    x, perm = _input(3, 128)
    block = random_block_perm(128, 64, torch.Generator().manual_seed(1)).to(torch.int32)
    input_gather.gather_input(x, perm, span=input_gather.map_span(perm))
    input_gather.gather_input(x, perm, span=input_gather.map_span(perm))
    assert len(measured) == 3
    times.update(rows=5.0)
    assert torch.equal(input_gather.gather_input(x, block, span=64), x[..., block.long()])
    assert len(measured) == 6 and ran[-1] == "columns"
    assert input_gather.gather_orders() == {(128, 4, 128): ("rows", "columns", "index_select"),
                                            (128, 4, 64): ("columns", "index_select", "rows")}
