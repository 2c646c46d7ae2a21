"""The 2:4 layout learner (shuffleprune/deploy/sparse_layout.py) against compressors whose layout is
known: the export's own (row-major positions), PyTorch's CUTLASS conversion (tiled, reordered
metadata, written independently of this project) and ones it must refuse."""
import pytest
import torch
from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

from shuffleprune.deploy.format import compress
from shuffleprune.deploy.sparse_layout import (PATTERNS, LayoutError, dense_from_patterns, layout_at, learn_layout, linear_map,
                                               pattern_ids, random_24)


def _as_bytes(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def export_layout(dense: torch.Tensor) -> torch.Tensor:
    values, meta = compress(dense, 2, 4)
    return _as_bytes(values, meta)


def cutlass_layout(dense: torch.Tensor) -> torch.Tensor:
    values, meta = sparse_semi_structured_from_dense_cutlass(dense)
    return _as_bytes(values, meta)


def test_patterns_round_trip():
    ids = torch.randint(6, (8, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(pattern_ids(dense_from_patterns(ids, torch.float16)), ids)
    with pytest.raises(ValueError, match="exactly two"):
        pattern_ids(torch.ones(2, 8))


def test_export_layout_is_row_major_with_the_formats_codes():
    layout = learn_layout(export_layout, 64, 128)
    assert layout.values_at == "head" and layout.meta_bytes == 64 * 128 // 8 and layout.contiguous
    # 2-bit positions, the first kept one in the low bits: code of (a, b) = a | b << 2, LSB first
    for a, b in PATTERNS:
        assert layout.codes[(a, b)] == tuple((a | b << 2) >> i & 1 for i in range(4))
    tile = layout.tile
    assert (tile.rows, tile.groups, tile.row_stride, tile.group_stride, tile.offset) == (1, 1, 128, 4, 0)
    dense = random_24(64, 128, torch.bfloat16, seed=3)
    assert torch.equal(layout.encode(dense), export_layout(dense))


def test_cutlass_layout_learned_tiled_and_extended_to_a_new_shape():
    learned = [learn_layout(cutlass_layout, r, c, dtype=torch.float16) for r, c in [(64, 128), (128, 128), (64, 256)]]
    first = learned[0]
    assert first.values_at == "head" and first.contiguous and first.tile is not None
    assert (first.tile.rows, first.tile.groups) == (32, 8)   # one 32×32 block of metadata per 128 bytes
    assert first.tile.row_stride == 32 * 32                  # the next 32 rows' block follows
    assert [l.tile.group_stride for l in learned] == [64 * 32, 128 * 32, 64 * 32]  # column blocks: all rows' first
    bit_map = linear_map(first.tile, 4)
    assert bit_map is not None and sorted(bit_map["rows"] + bit_map["groups"]) == [1 << i for i in range(8)]
    for layout in learned:
        dense = random_24(layout.rows, layout.cols, torch.float16, seed=5)
        assert torch.equal(layout.encode(dense), cutlass_layout(dense))
    wider = layout_at(learned, 192, 384)                      # a shape never probed
    dense = random_24(192, 384, torch.float16, seed=7)
    assert torch.equal(wider.encode(dense), cutlass_layout(dense))


def test_values_after_the_metadata():
    def meta_first(dense):
        values, meta = compress(dense, 2, 4)
        return _as_bytes(meta, values)

    layout = learn_layout(meta_first, 32, 64)
    assert layout.values_at == "tail" and layout.tile.offset == 0
    dense = random_24(32, 64, torch.bfloat16, seed=1)
    assert torch.equal(layout.encode(dense), meta_first(dense))


def test_refuses_what_it_cannot_describe():
    def reversed_values(dense):
        values, meta = compress(dense, 2, 4)
        return _as_bytes(values.flip(1), meta)

    def mixed_groups(dense):  # each metadata byte XORed with the next one: a bit depends on two groups
        values, meta = compress(dense, 2, 4)
        return _as_bytes(values, meta ^ meta.roll(-1, dims=1))

    def pattern_blind(dense):  # the same code for every pattern
        values, meta = compress(dense, 2, 4)
        return _as_bytes(values, torch.zeros_like(meta))

    with pytest.raises(LayoutError, match="kept values"):
        learn_layout(reversed_values, 32, 64)
    with pytest.raises(LayoutError, match="more than one group"):
        learn_layout(mixed_groups, 32, 64)
    with pytest.raises(LayoutError):
        learn_layout(pattern_blind, 32, 64)
    with pytest.raises(ValueError, match="16-bit"):
        learn_layout(export_layout, 32, 64, dtype=torch.float32)
