"""The interpreter's checks (``interpret_checks``), which every kernel test runs under: a stray access is
refused, recorded even when caught, and masked-off or in-bounds accesses pass; a launch's programs run in a
shuffled order, each once, so a kernel relying on grid order fails here as it would on a GPU; two programs
storing to one address are refused, atomics and one program's own stores are not; and ``torch.empty`` and
its kin can be made to give poisoned memory, as the kernel tests run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import interpret_checks
from conftest import KERNELS_CHECKED

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(not KERNELS_CHECKED, reason="the kernels run compiled on a GPU here, not interpreted")


@triton.jit
def _copy(src, dst, n, EXTRA: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, 16)
    if MASKED:
        tl.store(dst + offs, tl.load(src + offs + EXTRA, mask=offs + EXTRA < n, other=0.0), mask=offs < n)
    else:
        tl.store(dst + offs, tl.load(src + offs + EXTRA))


@triton.jit
def _count(counter):
    tl.atomic_add(counter + 1, 1)


def test_a_read_past_a_tensor_is_refused_and_recorded_even_when_caught():
    src, dst = torch.randn(16), torch.empty(16)
    _copy[(1,)](src, dst, 16, EXTRA=0, MASKED=False)   # exactly the tensors: passes
    assert torch.equal(dst, src)
    before = len(interpret_checks.violations)
    with pytest.raises(Exception, match="outside its tensors"):
        _copy[(1,)](src, dst, 16, EXTRA=1, MASKED=False)   # the 17th element of src
    assert len(interpret_checks.violations) == before + 1 and "_copy" in interpret_checks.violations[-1]
    del interpret_checks.violations[before:]   # the fixture would fail this test for the refusal it provoked


def test_masked_off_lanes_and_a_view_read_within_its_span_pass_and_a_view_read_past_it_is_refused():
    src, dst = torch.randn(16), torch.empty(16)
    _copy[(1,)](src, dst, 16, EXTRA=3, MASKED=True)   # lanes past the end are masked off
    assert torch.equal(dst[:13], src[3:]) and not dst[13:].any()
    whole = torch.randn(40)
    view = whole[8:24]   # a view: the storage reaches past it, the kernel may not
    _copy[(1,)](view, dst, 16, EXTRA=0, MASKED=False)
    assert torch.equal(dst, view)
    before = len(interpret_checks.violations)
    with pytest.raises(Exception, match="outside its tensors"):
        _copy[(1,)](view, dst, 16, EXTRA=2, MASKED=False)
    del interpret_checks.violations[before:]


def test_an_atomic_past_its_tensor_is_refused():
    before = len(interpret_checks.violations)
    _count[(1,)](torch.zeros(2, dtype=torch.int32))   # element 1 of 2: fine
    with pytest.raises(Exception, match="outside its tensors"):
        _count[(1,)](torch.zeros(1, dtype=torch.int32))
    del interpret_checks.violations[before:]


@triton.jit
def _copy_tiles(desc, dst):
    tl.store(dst + tl.arange(0, 32), desc.load([0]))


def test_a_tensor_descriptor_declared_past_its_tensor_is_refused():
    """The TMA copies' emulation reads the descriptor's shape (clipping beyond it, as the hardware does):
    one within its tensor passes, one declared larger than its tensor is an out-of-bounds read."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    src, dst = torch.randn(32), torch.empty(32)
    _copy_tiles[(1,)](TensorDescriptor(src, [32], [1], [32]), dst)
    assert torch.equal(dst, src)
    _copy_tiles[(1,)](TensorDescriptor(src[:16], [16], [1], [32]), dst)   # clipped at its shape: zeros after
    assert torch.equal(dst[:16], src[:16]) and not dst[16:].any()
    before = len(interpret_checks.violations)
    with pytest.raises(Exception, match="outside its tensors"):
        _copy_tiles[(1,)](TensorDescriptor(src[:16], [32], [1], [32]), dst)
    del interpret_checks.violations[before:]


@triton.jit
def _zero_then_count(counter, seen):
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.atomic_add(seen + pid, 1)
    if pid == 0:   # wrong on a GPU: the other programs may have added already
        tl.store(counter, 0)
    else:
        tl.atomic_add(counter, 1)


def test_programs_run_once_each_in_a_shuffled_order_that_exposes_a_kernel_relying_on_grid_order():
    order = interpret_checks.shuffled_programs(4, 2, 1)
    assert sorted(order) == [(x, y, 0) for x in range(4) for y in range(2)] and order[0] != (0, 0, 0)
    counter, seen = torch.full((1,), 100, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    _zero_then_count[(4, 2)](counter, seen)
    assert seen.tolist() == [1] * 8   # each program once
    after_zero = 7 - order.index((0, 0, 0))   # only the programs run after program 0 are counted
    assert int(counter) == after_zero < 7   # in grid order it would have been 7


@triton.jit
def _store_at(dst, SHARED: tl.constexpr):
    pid = tl.program_id(0)
    where = 0 if SHARED else pid
    tl.store(dst + where, pid.to(tl.float32))
    tl.store(dst + where, pid.to(tl.float32) + 1)   # a program's own second store: no race
    tl.atomic_add(dst + 8, 1.0)                     # every program's atomic on one address: no race


def test_two_programs_storing_to_one_address_are_refused_and_atomics_are_not():
    dst = torch.zeros(9)
    _store_at[(8,)](dst, SHARED=False)
    assert dst.tolist() == [1.0 + p for p in range(8)] + [8.0]
    before = len(interpret_checks.violations)
    with pytest.raises(interpret_checks.Race, match="both store to"):
        _store_at[(8,)](dst, SHARED=True)
    del interpret_checks.violations[before:]
    assert interpret_checks.shared_stores([(np.array([8, 16], dtype=np.uint64), 0),
                                           (np.array([24, 16], dtype=np.uint64), 3)]) == (16, 0, 3)
    assert interpret_checks.shared_stores([(np.array([8, 8], dtype=np.uint64), 2)]) is None


def test_stray_addresses_need_each_element_whole_inside_one_span():
    spans = [(100, 116), (108, 120), (200, 208)]   # overlapping views, and a second tensor
    addresses = np.array([100, 112, 116, 118, 196, 200, 204, 206], dtype=np.uint64)
    assert interpret_checks.stray_addresses(addresses, 4, spans).tolist() == [118, 196, 206]
    column = torch.empty(3, 4)[:, 1]   # a strided view: from its first element to its last, nothing past it
    (start, end), = interpret_checks.tensor_spans([torch.empty(0), (column, 7)])   # empty tensors and ints: none
    assert start == column.data_ptr() and end - start == (2 * 4 + 1) * 4


@triton.jit
def _sum_parts(part, out, SPLIT: tl.constexpr):
    total = 0.0
    for s in tl.static_range(SPLIT):
        total += tl.load(part + s)
    tl.store(out, total)


def test_empties_are_poisoned_while_asked_so_a_read_of_memory_no_one_wrote_shows():
    originals = (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty)
    with interpret_checks.poisoned_empties():
        floats, ints = torch.empty(3), torch.empty(2, 2, dtype=torch.int32).new_empty(4)
        assert floats.isnan().all() and ints.tolist() == [2**31 - 1] * 4
        assert torch.empty_like(floats).isnan().all() and torch.empty_strided((2,), (1,)).isnan().all()
        part, out = torch.empty(3), torch.empty(1)   # partial sums of which one split wrote none
        part[:2] = 1.0
        _sum_parts[(1,)](part, out, SPLIT=3)
        assert out.isnan().all()   # fresh memory holding 0 would have given a plausible 2.0
    assert (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty) == originals   # restored


def test_a_triton_whose_interpreter_numpy_refuses_is_named_with_the_fix():
    from interpret_checks import interpreter_mismatch

    message = interpreter_mismatch("3.6.0", "2.4.6")   # seen: every kernel test failed on int(array) in Triton 3.6
    assert message and "pip install 'numpy<2.4' or 'triton>=3.7'" in message and "\n" not in message
    assert interpreter_mismatch("3.6.0", "2.3.5") is None       # the numpy it was written for
    assert interpreter_mismatch("3.7.0", "2.4.6") is None       # int(array.squeeze()) from 3.7 on
    assert interpreter_mismatch("3.10.0+git1a2b", "2.5.0rc1") is None   # 10, not 1: versions compared as numbers
    assert interpreter_mismatch("3.6.0", "2.10.1") is not None
