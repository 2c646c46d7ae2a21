"""The compressed N:M weight format of exported checkpoints.

A weight ``W_p`` ``[R, C]`` that is exactly N:M in memory order (every group of ``M`` consecutive
columns of a row holds at most ``N`` non-zeros; in a ``--perm`` checkpoint ``W_p = W[:, perm]``) is
stored as

- ``values`` ``[R, C·N/M]`` in the model dtype: the kept entries of each group, in column order
  (a group with fewer than ``N`` non-zeros keeps some zeros, so every group has exactly ``N`` slots);
- ``meta`` ``uint8`` ``[R, C·N/M·b/8]``: the in-group position (0…M−1) of each kept value as a
  ``b``-bit field (``b = ⌈log₂ M⌉`` rounded up to 1, 2, 4 or 8), little-endian within each byte (2:4: four 2-bit positions per byte,
  value ``k`` of a row in bits ``2(k mod 4)…2(k mod 4)+1`` of byte ``k // 4``).

``compress``/``decompress`` are exact inverses on N:M tensors; ``check_compressed`` validates
shapes, dtypes and positions (strictly increasing within a group) so a corrupted file is refused.
"""
from __future__ import annotations

import math

import torch

from shuffleprune.errors import UserError
from shuffleprune.masks import satisfies_nm


def meta_bits(m: int) -> int:
    """Bits per in-group position: ⌈log₂ M⌉ rounded up to 1, 2, 4 or 8 so fields never straddle a
    byte (2 for 2:4, 4 for 4:8)."""
    need = max(1, math.ceil(math.log2(m)))
    for bits in (1, 2, 4, 8):
        if bits >= need:
            return bits
    raise UserError(f"M={m} is too large for the export format (M ≤ 256)")


def _per_byte(m: int) -> int:
    return 8 // meta_bits(m)


def compress(weight: torch.Tensor, n: int, m: int, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, meta)`` of an N:M weight ``[R, C]`` (raises if it is not N:M in memory order)."""
    rows, cols = weight.shape
    if cols % m or not satisfies_nm(weight, n, m):
        raise UserError(f"'{name}' is not {n}:{m} in memory order; export needs a checkpoint pruned with --pattern {n}:{m} "
                        "(one fine-tuned after pruning keeps its zeros under DynamicSparsifier(DSTConfig(method='keep')))")
    groups = weight.reshape(rows, cols // m, m)
    nonzero = groups != 0
    # kept slots: the non-zeros first (stable, in column order), padded with zeros' positions
    order = torch.argsort((~nonzero).to(torch.int8), dim=-1, stable=True)[..., :n]
    pos = order.sort(dim=-1).values                                         # [R, G, N] increasing
    values = torch.gather(groups, -1, pos).reshape(rows, cols // m * n)
    return values.contiguous(), pack_positions(pos.reshape(rows, -1), m)


def pack_positions(pos: torch.Tensor, m: int) -> torch.Tensor:
    """``[R, K]`` positions in ``0…M−1`` → ``uint8`` ``[R, ⌈K/per_byte⌉]`` (little-endian bit fields)."""
    per, bits = _per_byte(m), meta_bits(m)
    rows, k = pos.shape
    pad = -k % per  # the last byte of a row is zero-padded
    p = torch.nn.functional.pad(pos.to(torch.int32), (0, pad)).reshape(rows, (k + pad) // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=pos.device) * bits
    return (p << shifts).sum(-1).to(torch.uint8)


def unpack_positions(meta: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_positions`: ``uint8`` ``[R, B]`` → int64 ``[R, B·per_byte]``."""
    per, bits = _per_byte(m), meta_bits(m)
    shifts = torch.arange(per, dtype=torch.int32, device=meta.device) * bits
    fields = (meta.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(meta.shape[0], -1).long()


def decompress(values: torch.Tensor, meta: torch.Tensor, n: int, m: int, cols: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense ``[R, C]`` weight (zeros elsewhere) of a compressed N:M weight; written into the
    first ``R·C`` elements of ``out`` when given (a shared scratch buffer)."""
    rows = values.shape[0]
    pos = unpack_positions(meta, m)[:, : values.shape[1]].reshape(rows, cols // m, n)
    if out is None:
        dense = torch.zeros(rows, cols // m, m, dtype=values.dtype, device=values.device)
    else:
        dense = out.reshape(-1)[: rows * cols].view(rows, cols // m, m).zero_()
    dense.scatter_(-1, pos.to(values.device), values.reshape(rows, cols // m, n))
    return dense.reshape(rows, cols)


def check_compressed(name: str, values: torch.Tensor, meta: torch.Tensor, shape: tuple[int, int], n: int, m: int) -> None:
    """Refuse a compressed weight whose shapes or positions are not a valid N:M encoding."""
    rows, cols = shape
    kept = cols // m * n
    per = _per_byte(m)
    if cols % m or tuple(values.shape) != (rows, kept):
        raise UserError(f"corrupt sparse tensor '{name}': values {tuple(values.shape)}, expected {(rows, kept)} "
                        f"for a {rows}×{cols} {n}:{m} weight")
    if meta.dtype != torch.uint8 or tuple(meta.shape) != (rows, -(-kept // per)):
        raise UserError(f"corrupt sparse tensor '{name}': metadata {meta.dtype} {tuple(meta.shape)}, "
                        f"expected uint8 {(rows, -(-kept // per))}")
    pos = unpack_positions(meta, m)[:, :kept].reshape(rows, cols // m, n)
    if (pos >= m).any() or (n > 1 and (pos[..., 1:] <= pos[..., :-1]).any()):
        raise UserError(f"corrupt sparse tensor '{name}': in-group positions are not {n} distinct slots of {m}")


def check_index_map(name: str, perm: torch.Tensor | None, cols: int) -> None:
    """Refuse a stored index map that is not a permutation of the layer's ``cols`` inputs."""
    if perm is not None and (perm.numel() != cols or not torch.equal(perm.long().sort().values, torch.arange(cols, device=perm.device))):
        raise UserError(f"corrupt sparse tensor '{name}.perm': not a permutation of {cols} inputs")
