"""One 2:4 weight buffer that cuSPARSELt multiplies from and the decode kernels read (prefill on
Hopper's sparse tensor cores without a second copy).

cuSPARSELt's compressed buffer for a 16-bit ``[R, C]`` 2:4 weight is ``[values | metadata]``, shaped
``[R, C/2 + C/16]``. Its values are the export's ``values`` (row-major kept values); its metadata
holds the export's 4-bit group codes (``a | b << 2``) in a tiled order, learned on an H100 from
``torch._cslt_compress`` by :mod:`shuffleprune.deploy.sparse_layout` (``scripts/probe_sparse_tc.py``,
``scripts/results/sparse_tc_layout.json``) and checked there at shapes never probed, bit for bit,
and by cuSPARSELt multiplying from a buffer built here:

- 64-row bands, one after another (``64·C`` bits each); in a band, 8-group (32-column) tiles of
  2048 bits, left to right;
- in a tile, row ``16a + 8b + c`` lies in the 64-bit pair ``8a + c``: in its low nibbles for
  ``b = 0``, its high ones for ``b = 1``, its 8 groups in the order 0 4 1 5 (low word) 2 6 3 7
  (high word).

:func:`cslt_words` writes the export's position words in that order (:func:`row_words` reads them
back); the Triton kernels read it with ``tiled=True`` (``kernels/nm_words.py``: ``_cslt_pair`` for the
address, ``_cslt_positions`` in the select loop, ``_cslt_words_slices`` elsewhere).
"""
from __future__ import annotations

import torch

TILE_ROWS = 64     # rows per band of the metadata
TILE_COLS = 32     # dense columns (8 groups of 4) per tile: one position word of the export per row


def cslt_supported(rows: int, cols: int, n: int, m: int, dtype: torch.dtype) -> bool:
    """Whether a ``[rows, cols]`` ``n:m`` weight of ``dtype`` has this layout: 2:4, 16-bit, whole tiles."""
    return ((n, m) == (2, 4) and dtype in (torch.float16, torch.bfloat16)
            and rows % TILE_ROWS == 0 and cols % TILE_COLS == 0)


def cslt_words(words: torch.Tensor) -> torch.Tensor:
    """The export's 2:4 position words ``[R, C/32]`` (int32, group ``g`` of a word in bits ``4g…``)
    → cuSPARSELt's metadata as int32 ``[R, C/32]`` (the same count, in its order; ``R % 64 == 0``)."""
    rows, width = words.shape
    if rows % TILE_ROWS:
        raise ValueError(f"cuSPARSELt's 2:4 layout needs rows in whole bands of {TILE_ROWS}, got {rows}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    g = [(w >> (4 * k)) & 0xF for k in range(8)]
    low = g[0] | g[4] << 8 | g[1] << 16 | g[5] << 24     # the low word's bytes: groups 0 4 1 5
    high = g[2] | g[6] << 8 | g[3] << 16 | g[7] << 24    # the high word's: 2 6 3 7
    shape = (rows // TILE_ROWS, 4, 2, 8, width)           # row = band·64 + 16a + 8b + c
    low, high = low.reshape(shape), high.reshape(shape)
    pairs = torch.stack([low[:, :, 0] | low[:, :, 1] << 4, high[:, :, 0] | high[:, :, 1] << 4], dim=-1)
    flat = pairs.permute(0, 3, 1, 2, 4).reshape(-1)       # [band, tile, a, c, low/high]
    flat = flat - ((flat >> 31) & 1) * (1 << 32)          # as signed 32-bit
    return flat.to(torch.int32).reshape(rows, width)


def cslt_buffer(values: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """cuSPARSELt's compressed 2:4 weight ``[R, C/2 + C/16]`` (the values' dtype) from the export's
    ``values`` ``[R, C/2]`` and position words: what ``torch._cslt_compress`` returns for that weight."""
    return join_buffer(values, cslt_words(words))


def join_buffer(values: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
    """``values`` ``[R, C/2]`` and metadata already in cuSPARSELt's order (int32 ``[R, C/32]``) as one
    new ``[R, C/2 + C/16]`` buffer (the inverse of :func:`split_buffer`)."""
    return torch.cat([values.reshape(-1), tiled.reshape(-1).view(values.dtype)]).view(values.shape[0], -1)


def split_buffer(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a :func:`cslt_buffer`: values ``[R, C/2]`` and metadata words ``[R, C/32]`` (int32)."""
    rows, width = buffer.shape                            # width = C/2 + C/16 = 9·C/16
    kept = width * 8 // 9
    flat = buffer.reshape(-1)
    return flat[: rows * kept].view(rows, kept), flat[rows * kept:].view(torch.int32).view(rows, -1)


def row_words(tiled: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`cslt_words`: cuSPARSELt's metadata ``[R, C/32]`` → the export's position
    words ``[R, C/32]`` (int32, row by row)."""
    rows, width = tiled.shape
    pairs = (tiled.to(torch.int64) & 0xFFFFFFFF).reshape(rows // TILE_ROWS, width, 4, 8, 2)
    pairs = pairs.permute(0, 2, 3, 1, 4)                  # [band, a, c, tile, low/high]
    halves = torch.stack([pairs & 0x0F0F0F0F, (pairs >> 4) & 0x0F0F0F0F], dim=2)   # b = 0, 1 → [band, a, b, c, …]
    low, high = halves[..., 0].reshape(rows, width), halves[..., 1].reshape(rows, width)
    byte = [(low >> s) & 0xF for s in (0, 8, 16, 24)] + [(high >> s) & 0xF for s in (0, 8, 16, 24)]
    order = (0, 2, 4, 6, 1, 3, 5, 7)                      # group g's byte: groups 0 4 1 5 | 2 6 3 7
    w = sum(byte[order[g]] << (4 * g) for g in range(8))
    w = w - ((w >> 31) & 1) * (1 << 32)
    return w.to(torch.int32)
