"""One 2:4 buffer for cuSPARSELt and the decode kernels (``deploy/cslt_layout.py``): its metadata
order against the layout learned from ``torch._cslt_compress`` on an H100 (the committed probe
result), the Triton kernels reading it (``tiled``) against float64, and ``SparseLinear`` /
stacked layers holding one buffer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shuffleprune.deploy.cslt_layout import cslt_buffer, cslt_supported, cslt_words, row_words, split_buffer
from shuffleprune.deploy.format import compress
from shuffleprune.deploy.fused_inputs import FusedInputs
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.kernels.nm_decode import nm_decode
from shuffleprune.kernels.nm_gemm import nm_decompress_into, nm_gemm
from shuffleprune.kernels.nm_words import position_words
from shuffleprune.masks import nm_keep_mask

LEARNED = Path(__file__).resolve().parents[1] / "scripts" / "results" / "sparse_tc_layout.json"


def _weight(rows: int, cols: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return (w * nm_keep_mask(w.abs(), 2, 4)).to(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_metadata_order_is_the_layout_learned_from_cusparselt(dtype):
    """Every group's 4-bit code lies where the H100 probe found cuSPARSELt puts it (tile, strides, inner
    table and codes as learned at 256×512), and the values are the export's, first."""
    learned = json.loads(LEARNED.read_text())["layouts"][dtype]["learned"]
    layout = next(entry for entry in learned if (entry["rows"], entry["cols"]) == (256, 512))
    tile, codes = layout["tile"], {k: sum(b << i for i, b in enumerate(v)) for k, v in layout["codes"].items()}
    assert layout["values_at"] == "head"
    w = _weight(256, 512, getattr(torch, dtype))
    values, meta = compress(w, 2, 4)
    buf = cslt_buffer(values, position_words(meta))
    assert buf.shape == (256, 512 // 2 + 512 // 16) and torch.equal(buf.reshape(-1)[: values.numel()], values.reshape(-1))
    words = split_buffer(buf)[1].reshape(-1).to(torch.int64) & 0xFFFFFFFF
    bits = ((words[:, None] >> torch.arange(32)) & 1).reshape(-1)
    rows, groups = torch.meshgrid(torch.arange(256), torch.arange(128), indexing="ij")
    inner = torch.tensor(tile["inner"])
    first = ((rows // tile["rows"]) * tile["row_stride"] + (groups // tile["groups"]) * tile["group_stride"]
             + inner[rows % tile["rows"], groups % tile["groups"]])
    found = sum(bits[first + i] << i for i in range(4))
    kept = (w != 0).reshape(256, 128, 4)
    expected = torch.tensor([[codes["".join(str(j) for j in range(4) if kept[r, g, j])] for g in range(128)]
                             for r in range(256)])
    assert torch.equal(found, expected)


def test_metadata_order_round_trips_and_refuses_partial_bands():
    words = torch.randint(-2**31, 2**31 - 1, (128, 5), dtype=torch.int64).to(torch.int32)
    tiled = cslt_words(words)
    assert not torch.equal(tiled, words) and torch.equal(row_words(tiled), words)
    with pytest.raises(ValueError, match="bands of 64"):
        cslt_words(words[:96])
    assert cslt_supported(128, 96, 2, 4, torch.bfloat16)
    assert not cslt_supported(96, 96, 2, 4, torch.bfloat16)       # rows not whole bands
    assert not cslt_supported(128, 80, 2, 4, torch.bfloat16)      # columns not whole tiles
    assert not cslt_supported(128, 96, 4, 8, torch.bfloat16)      # cuSPARSELt's 16-bit layout is 2:4
    assert not cslt_supported(128, 96, 2, 4, torch.float32)


@pytest.mark.parametrize("tokens", [1, 2, 3, 24])
@pytest.mark.parametrize("mapped,bias", [(False, False), (True, True)])
def test_kernels_read_the_cusparselt_order(tokens, mapped, bias):
    """Decode (the select loop by group at 1–2 tokens, tensor cores from 3), the prefill GEMM and the
    decompression on the tiled words give what float64 gives for the same weight."""
    rows, cols = 128, 96
    w = _weight(rows, cols)
    values, meta = compress(w, 2, 4)
    tiled = cslt_words(position_words(meta))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, cols, generator=gen).bfloat16()
    perm = torch.randperm(cols, generator=gen).to(torch.int32) if mapped else None
    b = torch.randn(rows, generator=gen).bfloat16() if bias else None
    xp = x if perm is None else x[:, perm.long()]
    ref = xp.double() @ w.double().t() + (0 if b is None else b.double())
    if tokens <= 16:
        y = nm_decode(x, values, tiled, 2, 4, 2, perm, b, tiled=True)
    else:
        y = nm_gemm(xp, values, tiled, 2, 4, 2, b, tiled=True)
    assert (y.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    out = torch.empty(rows * cols, dtype=torch.bfloat16)
    assert torch.equal(nm_decompress_into(values, tiled, 2, 4, 2, cols, out, tiled=True), w)


def test_sparse_linear_holds_one_buffer_and_runs_every_path_on_it(monkeypatch):
    w = _weight(128, 64)
    values, meta = compress(w, 2, 4)
    perm, bias = torch.randperm(64), torch.randn(128).bfloat16()
    plain = SparseLinear(values, meta, 64, 2, 4, perm, bias)
    layer = SparseLinear(values.clone(), meta.clone(), 64, 2, 4, perm, bias)
    held = sum(t.numel() * t.element_size() for t in layer.buffers())
    assert layer.use_cslt_layout() and layer.tiled
    packed = layer._packed
    assert packed.shape == (128, 64 // 2 + 64 // 16)
    for t in (layer.values, layer.meta):   # both views of the one buffer, no second copy
        assert t.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert sum(t.numel() * t.element_size() for t in layer.buffers()) == held
    assert torch.equal(layer.export_meta(), meta) and torch.equal(layer.weight, plain.weight)
    x = torch.randn(2, 3, 64).bfloat16()
    for policy in ("decode", "decode_mapped", "decode_select", "gemm", "gemm_swap", "gemm_swap_tall", "scratch"):
        plain.policy = layer.policy = policy
        assert torch.equal(layer(x), plain(x)), policy
    x1 = x[:1, :1]   # one token: the select loop's other tiles read the cuSPARSELt order too (32 rows: 2 slices of 16)
    for policy in ("decode_shallow", "decode_tall", "decode_wide", "decode_mapped_tall", "decode_mapped_wide"):
        plain.policy = layer.policy = policy
        assert torch.equal(layer(x1), plain(x1)), policy
    # the weight written in the input's order reads the export's layout only: not a candidate here, refused if named
    assert "scratch_mapped" in plain.candidates(torch.randn(20, 64).bfloat16())
    assert "scratch_mapped" not in layer.candidates(torch.randn(20, 64).bfloat16())
    layer.policy = "scratch_mapped"
    with pytest.raises(ValueError, match="cuSPARSELt"):
        layer(x)

    # cuSPARSELt runs on the layer's own buffer: nothing is compressed again
    monkeypatch.setattr(torch, "_cslt_compress", lambda dense: pytest.fail("a second compressed copy was made"))
    monkeypatch.setattr(torch, "_cslt_sparse_mm_search", lambda a, b, bias, transpose_result: 0)
    monkeypatch.setattr(torch._C, "_cusparselt", None, raising=False)
    seen = []

    def sparse_mm(a, b, bias, alpha, out_dtype, transpose_result, alg_id):
        seen.append(a.untyped_storage().data_ptr())
        vals, words = split_buffer(a)
        dense = nm_decompress_into(vals, words, 2, 4, 2, 64, torch.empty(128 * 64, dtype=a.dtype), tiled=True)
        return (dense.double() @ b.double() + bias.double()[:, None]).t()

    monkeypatch.setattr(torch, "_cslt_sparse_mm", sparse_mm)
    layer.policy = "cslt"
    ref = x.double()[..., perm] @ w.double().t() + bias.double()
    assert (layer(x).double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert seen == [packed.untyped_storage().data_ptr()]

    assert not SparseLinear(*compress(_weight(96, 64), 2, 4), 64, 2, 4).use_cslt_layout()   # rows not whole bands


def test_stacked_layers_share_one_cusparselt_buffer():
    """q/k/v-like layers in cuSPARSELt's layout stack into one buffer (their bands in turn) that each
    member's values and positions are views of; outputs equal the unstacked layers'."""
    perm = torch.randperm(64)
    weights = [_weight(r, 64, seed=i) for i, r in enumerate((128, 64, 64))]
    layers = [SparseLinear(*compress(w, 2, 4), 64, 2, 4, perm, policy="decode") for w in weights]
    for layer in layers:
        assert layer.use_cslt_layout()
    x = torch.randn(1, 64).bfloat16()
    alone = [layer(x) for layer in layers]
    group = FusedInputs(layers)
    for layer in layers:
        layer.fused_inputs = group
    stacked = [layer(x) for layer in layers]
    assert all(torch.equal(a, b) for a, b in zip(alone, stacked))
    ptr = group.stacked._packed.untyped_storage().data_ptr()
    assert group.stacked.tiled and all(layer.values.untyped_storage().data_ptr() == ptr
                                       and layer.meta.untyped_storage().data_ptr() == ptr and layer._packed is None
                                       for layer in layers)


def test_use_cslt_layout_converts_the_layers_that_can_take_it():
    from torch import nn

    from shuffleprune.deploy.sparse_linear import use_cslt_layout

    model = nn.ModuleDict({
        "fits": SparseLinear(*compress(_weight(64, 32), 2, 4), 32, 2, 4),
        "rows_48": SparseLinear(*compress(_weight(48, 32), 2, 4), 32, 2, 4),
        "float32": SparseLinear(*compress(_weight(64, 32, torch.float32), 2, 4), 32, 2, 4),
        "dense": nn.Linear(32, 64),
    })
    assert use_cslt_layout(model) == ["fits"]
    assert model["fits"].tiled and not model["rows_48"].tiled and not model["float32"].tiled
    assert use_cslt_layout(model) == ["fits"]   # idempotent: an already converted layer stays as it is
