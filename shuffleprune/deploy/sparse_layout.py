"""Learn a 2:4 compressor's storage layout from probes.

cuSPARSELt, the library behind PyTorch's 2:4 tensors and the only sparse-tensor-core GEMM for
Hopper that PyTorch reaches, packs a 2:4 matrix into one buffer whose layout NVIDIA does not
document. A layer can run both the decode kernels (:mod:`kernels.nm_decode`) and such a GEMM from
*one* copy of its weight only if both read the same bytes, so the layout has to be known.
:func:`learn_layout` finds it for any black box ``compress(dense [R, C]) -> tensor`` of 16-bit
elements by compressing chosen patterns:

- where the kept values lie: first or last in the buffer, row by row, as in the export's
  ``values`` (then ``values`` can be that part of the buffer and only the metadata differs);
- for every group of four columns, the bits of the buffer that depend on its pattern (each group's
  bits must depend on that group alone), and the code each of the six patterns writes there (the
  same for every group);
- whether the groups' first bits repeat in tiles, ``first(r, g) = (r // TR)·row_stride +
  (g // TG)·group_stride + inner[r % TR, g % TG]`` — the form a kernel would compute.

The last probe compresses random patterns and values and checks that :meth:`Layout24.encode`
rebuilds the compressor's buffer bit for bit, so a partial or wrong reading raises
:class:`LayoutError` rather than being reported as a layout. :func:`layout_at` extends a tiled
layout learned on small shapes to any shape (strides fitted as ``a + b·R + c·C``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from shuffleprune.deploy.format import compress as export_compress

PATTERNS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))  # a 2:4 group's kept positions
BASE = 0  # every probe starts from all groups keeping positions 0 and 1

Compressor = Callable[[torch.Tensor], torch.Tensor]


class LayoutError(ValueError):
    """The compressor's buffer is not a per-group layout this module can describe."""


@dataclass
class Tile:
    """``first(r, g) = offset + (r // rows)·row_stride + (g // groups)·group_stride + inner[r % rows][g % groups]``
    (bit indices counted from the start of the metadata: the buffer without its values)."""
    rows: int
    groups: int
    row_stride: int
    group_stride: int
    offset: int
    inner: list[list[int]]

    def first_bits(self, rows: int, groups: int) -> torch.Tensor:
        """The first bit of every group of a ``rows × 4·groups`` matrix, ``[rows, groups]``."""
        r = torch.arange(rows)[:, None]
        g = torch.arange(groups)[None, :]
        inner = torch.tensor(self.inner, dtype=torch.int64)
        return (self.offset + (r // self.rows) * self.row_stride + (g // self.groups) * self.group_stride
                + inner[r % self.rows, g % self.groups])


@dataclass
class Layout24:
    """Where a compressor puts a 2:4 matrix of ``rows × cols`` 16-bit elements (see the module docstring)."""
    rows: int
    cols: int
    buffer_bytes: int
    values_at: str                      # "head" or "tail": the kept values, row-major, as the export's
    codes: dict[tuple[int, int], tuple[int, ...]]   # pattern → its bits, in the order of the group's bit indices
    group_bits: torch.Tensor            # [rows·cols/4, bits per group] bit indices, ascending per group
    template: torch.Tensor              # the buffer's bits that no probe changed (uint8 bits)
    contiguous: bool                    # each group's bits are consecutive
    tile: Tile | None = None
    extra: dict = field(default_factory=dict)

    @property
    def meta_bytes(self) -> int:
        return self.buffer_bytes - self.rows * self.cols  # the values take cols/2 two-byte elements per row

    @property
    def meta_start_bit(self) -> int:
        """Where the metadata begins in the buffer (after the values when they come first)."""
        return self.rows * self.cols * 8 if self.values_at == "head" else 0

    def encode(self, dense: torch.Tensor) -> torch.Tensor:
        """The buffer the compressor would write for the 2:4 matrix ``dense`` (uint8 ``[buffer_bytes]``)."""
        values, _ = export_compress(dense, 2, 4)
        bits = self.template.clone()
        start = 0 if self.values_at == "head" else self.buffer_bytes * 8 - values.numel() * 16
        bits[start:start + values.numel() * 16] = _bits(values)
        pattern = pattern_ids(dense).reshape(-1)
        table = torch.tensor([self.codes[p] for p in PATTERNS], dtype=torch.uint8)
        bits[self.group_bits.reshape(-1)] = table[pattern].reshape(-1)
        return _bytes(bits)

    def describe(self) -> dict:
        """A JSON-ready summary (the per-group bit table itself is left out: the tile describes it)."""
        return {"rows": self.rows, "cols": self.cols, "buffer_bytes": self.buffer_bytes, "values_at": self.values_at,
                "meta_bytes": self.meta_bytes, "bits_per_group": self.group_bits.shape[1],
                "contiguous": self.contiguous,
                "codes": {f"{a}{b}": list(code) for (a, b), code in self.codes.items()},
                "tile": None if self.tile is None else vars(self.tile),
                "tile_bit_map": None if self.tile is None else linear_map(self.tile, self.group_bits.shape[1]),
                **self.extra}


def pattern_ids(dense: torch.Tensor) -> torch.Tensor:
    """Each group's index into :data:`PATTERNS` ``[R, C/4]`` (every group must keep exactly two)."""
    nz = (dense != 0).reshape(dense.shape[0], -1, 4)
    if not bool((nz.sum(-1) == 2).all()):
        raise ValueError("every group of four must keep exactly two nonzero values")
    code = (nz.to(torch.int64) * torch.tensor([1, 2, 4, 8])).sum(-1)
    lookup = torch.full((16,), -1, dtype=torch.int64)
    for i, (a, b) in enumerate(PATTERNS):
        lookup[(1 << a) | (1 << b)] = i
    return lookup[code]


def dense_from_patterns(ids: torch.Tensor, dtype: torch.dtype, values: torch.Tensor | None = None) -> torch.Tensor:
    """The ``[R, 4·G]`` matrix whose groups keep :data:`PATTERNS` ``[ids]`` (ones, or ``values`` ``[R, 2·G]``)."""
    rows, groups = ids.shape
    keep = torch.zeros(len(PATTERNS), 4, dtype=torch.bool)
    for i, (a, b) in enumerate(PATTERNS):
        keep[i, [a, b]] = True
    mask = keep[ids].reshape(rows, 4 * groups)
    out = torch.zeros(rows, 4 * groups, dtype=dtype)
    out[mask] = 1 if values is None else values.reshape(-1).to(dtype)
    return out


def random_24(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A ``rows × cols`` matrix of random 2:4 patterns whose kept values are random and nonzero
    (magnitudes 0.5–1.5, both signs)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(PATTERNS), (rows, cols // 4), generator=gen)
    values = (torch.rand(rows, cols // 2, generator=gen) + 0.5) * torch.where(
        torch.rand(rows, cols // 2, generator=gen) < 0.5, -1.0, 1.0)
    return dense_from_patterns(ids, dtype, values)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as bits, little-endian within each byte (uint8 0/1)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return ((raw[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)


def _bytes(bits: torch.Tensor) -> torch.Tensor:
    return (bits.reshape(-1, 8).to(torch.int32) << torch.arange(8)).sum(1).to(torch.uint8)


def _owners(run: Callable[[torch.Tensor], torch.Tensor], rows: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every bit of the buffer: the group whose pattern it depends on (−1: none), and the bits of
    the all-base probe. Each of the five patterns other than the base is swapped in, per bit ``b``
    of the group index, for the groups with that bit set and, separately, for the others: a bit owned
    by group ``j`` flips in exactly one of the two, and the ones it flips in spell ``j``. Every bit
    that depends on its group's pattern flips for at least one of the five (they connect all six
    patterns to the base)."""
    n = rows * groups
    index = torch.arange(n).reshape(rows, groups)
    base = run(torch.full((rows, groups), BASE))
    owner = torch.full_like(base, -1, dtype=torch.int64)
    for p in range(len(PATTERNS)):
        if p == BASE:
            continue
        spelled = torch.zeros_like(base, dtype=torch.int64)
        flips = []
        for b in range(max(1, (n - 1).bit_length())):
            chosen = ((index >> b) & 1).bool()
            on = run(torch.where(chosen, p, BASE)) != base
            off = run(torch.where(chosen, BASE, p)) != base
            if bool((on & off).any()):
                raise LayoutError("a bit changes with the patterns of more than one group")
            flips.append(on | off)
            spelled |= on.to(torch.int64) << b
        seen = flips[0]
        if any(bool((f != seen).any()) for f in flips[1:]):
            raise LayoutError("a bit changes with the patterns of more than one group")
        clash = seen & (owner >= 0) & (owner != spelled)
        if bool(clash.any()):
            raise LayoutError("a bit changes with the patterns of more than one group")
        owner = torch.where(seen, spelled, owner)
    if bool((owner >= n).any()):
        raise LayoutError("a bit's owner is not a group of the matrix")
    return owner, base


def _group_bits(owner: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, bits per group]``: each group's bit indices, ascending."""
    idx = torch.nonzero(owner >= 0).reshape(-1)
    counts = torch.bincount(owner[idx], minlength=n)
    if counts.numel() != n or bool((counts != counts[0]).any()) or int(counts[0]) == 0:
        raise LayoutError("the groups do not all own the same number of bits")
    order = torch.argsort(owner[idx] * owner.numel() + idx)
    return idx[order].reshape(n, int(counts[0]))


def fit_tile(first: torch.Tensor) -> Tile | None:
    """The smallest ``(TR, TG)`` tiling (powers of two, then the fewest rows) that describes the first
    bits ``[R, G]``, or None."""
    rows, groups = first.shape
    pow2 = lambda n: [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0]
    for tr, tg in sorted(((a, b) for a in pow2(rows) for b in pow2(groups)), key=lambda t: (t[0] * t[1], t[0])):
        origin = first[0, 0]
        tile = Tile(tr, tg, int(first[tr, 0] - origin) if rows > tr else 0,
                    int(first[0, tg] - origin) if groups > tg else 0, int(origin), (first[:tr, :tg] - origin).tolist())
        if torch.equal(tile.first_bits(rows, groups), first):
            return tile
    return None


def linear_map(tile: Tile, bits_per_group: int) -> dict[str, list[int]] | None:
    """The tile's inner table as a map of index bits, if it is one: the slot ``inner[r][g] / bits``
    equals the XOR of ``rows[i]`` over the set bits ``i`` of ``r`` and of ``groups[j]`` over those of
    ``g`` (a permutation of the index bits, possibly with swaps, is such a map; a kernel can then
    bring a tile's metadata into row order with reshapes and permutes instead of a lookup table)."""
    inner = torch.tensor(tile.inner, dtype=torch.int64)
    if bool((inner % bits_per_group).any()) or int(inner[0, 0]):
        return None
    slot = inner // bits_per_group
    rows = [int(slot[1 << i, 0]) for i in range(tile.rows.bit_length() - 1)]
    groups = [int(slot[0, 1 << j]) for j in range(tile.groups.bit_length() - 1)]
    want = torch.zeros_like(slot)
    for i, image in enumerate(rows):
        want ^= ((torch.arange(tile.rows)[:, None] >> i) & 1) * image
    for j, image in enumerate(groups):
        want ^= ((torch.arange(tile.groups)[None, :] >> j) & 1) * image
    return {"rows": rows, "groups": groups} if torch.equal(want, slot) else None


def learn_layout(compress: Compressor, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> Layout24:
    """The layout ``compress`` writes for ``rows × cols`` 2:4 matrices of ``dtype`` (16-bit), checked on a
    random matrix; raises :class:`LayoutError` where the buffer is not of that form."""
    if torch.finfo(dtype).bits != 16 or cols % 4:
        raise ValueError("learn_layout takes 16-bit dtypes and a column count divisible by 4")
    groups = cols // 4
    run = lambda ids: _bits(compress(dense_from_patterns(ids, dtype)))
    sample = random_24(rows, cols, dtype, seed)
    out = _bits(compress(sample))
    kept = _bits(export_compress(sample, 2, 4)[0])
    if torch.equal(out[:kept.numel()], kept):
        values_at = "head"
    elif torch.equal(out[out.numel() - kept.numel():], kept):
        values_at = "tail"
    else:
        raise LayoutError("the kept values are not first or last in the buffer, row by row")
    owner, base = _owners(run, rows, groups)
    group_bits = _group_bits(owner, rows * groups)
    codes = {}
    for p, pattern in enumerate(PATTERNS):
        seen = run(torch.full((rows, groups), p))[group_bits]
        if bool((seen != seen[0]).any()):
            raise LayoutError(f"pattern {pattern} is not written with the same code in every group")
        codes[pattern] = tuple(int(v) for v in seen[0])
    if len(set(codes.values())) != len(PATTERNS):
        raise LayoutError("two patterns share a code")
    layout = Layout24(rows, cols, out.numel() // 8, values_at, codes, group_bits, base.clone(),
                      bool((group_bits - group_bits[:, :1] == torch.arange(group_bits.shape[1])).all()))
    if not torch.equal(_bits(layout.encode(sample)), out):
        raise LayoutError("the learned layout does not rebuild the compressor's buffer")
    layout.tile = fit_tile(group_bits[:, 0].reshape(rows, groups) - layout.meta_start_bit)
    return layout


def layout_at(learned: list[Layout24], rows: int, cols: int) -> Layout24:
    """A layout for ``rows × cols`` from tiled ``learned`` ones of other shapes (same tile, inner table,
    codes and values' place; offset and strides fitted as ``a + b·R + c·C`` on three of them, checked
    on the rest). Its ``template`` is zero outside the values and the group bits (the compressor's
    other bits, if any, are unknown at a new shape)."""
    if len(learned) < 3 or any(l.tile is None or not l.contiguous for l in learned):
        raise LayoutError("layout_at needs at least three tiled layouts with consecutive group bits")
    first = learned[0]
    same = lambda l: (l.tile.rows, l.tile.groups, l.tile.inner, l.codes, l.values_at) == (
        first.tile.rows, first.tile.groups, first.tile.inner, first.codes, first.values_at)
    if not all(same(l) for l in learned):
        raise LayoutError("the learned shapes do not share one tile, code and values' place")
    ratios = {l.meta_bytes / (l.rows * l.cols) for l in learned}
    if len(ratios) != 1:
        raise LayoutError("the learned shapes' metadata is not one fixed number of bytes per element")
    design = torch.tensor([[1.0, l.rows, l.cols] for l in learned], dtype=torch.float64)
    fitted = {}
    for name in ("offset", "row_stride", "group_stride"):
        target = torch.tensor([float(getattr(l.tile, name)) for l in learned], dtype=torch.float64)
        coef = torch.linalg.lstsq(design, target[:, None]).solution.reshape(-1)
        if not torch.allclose(design @ coef, target, atol=1e-6):
            raise LayoutError(f"the {name} of the learned shapes is not of the form a + b·R + c·C")
        fitted[name] = round(float(coef @ torch.tensor([1.0, rows, cols], dtype=torch.float64)))
    buffer_bytes = rows * cols + round(ratios.pop() * rows * cols)
    tile = Tile(first.tile.rows, first.tile.groups, fitted["row_stride"], fitted["group_stride"], fitted["offset"],
                first.tile.inner)
    if rows % tile.rows or (cols // 4) % tile.groups:
        raise LayoutError(f"{rows}×{cols} is not a whole number of {tile.rows}×{4 * tile.groups} tiles")
    layout = Layout24(rows, cols, buffer_bytes, first.values_at, first.codes, torch.empty(0, 1, dtype=torch.int64),
                      torch.zeros(buffer_bytes * 8, dtype=torch.uint8), True, tile,
                      {"fitted_from": [[l.rows, l.cols] for l in learned]})
    starts = tile.first_bits(rows, cols // 4).reshape(-1, 1) + layout.meta_start_bit
    layout.group_bits = starts + torch.arange(first.group_bits.shape[1])
    return layout
