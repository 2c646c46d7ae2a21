"""``SparseLinear``: the deployed form of a pruned (and possibly permuted) linear layer.

``y = W_p · x[perm] + b`` with ``W_p`` held compressed (``values`` + packed ``meta``, see
:mod:`sparse_format`) and ``perm`` the input index map (``None`` when the layer reads its input in
order). Which implementation runs is chosen per call shape:

- CUDA, few tokens (decode): the Triton kernel of ``kernels/nm_matmul.py`` — gathers ``x`` at the
  permuted addresses inside the kernel;
- CUDA, many tokens (prefill): PyTorch's semi-structured 2:4 matmul — ``semi_structured`` (its
  default backend, cuSPARSELt where present) or ``semi_cutlass`` (its CUTLASS backend) — when it
  exists for this dtype and pattern, with the gather applied once, else a dense matmul of the
  decompressed weight — the fastest as measured on the first call per token count;
- CPU: plain PyTorch (the decompressed weight, built once and kept).

``policy`` may also name one implementation (``triton`` also runs on the CPU under
``TRITON_INTERPRET=1``). With ``policy="auto"`` on CUDA the first call for each token-count bucket times every applicable
implementation and keeps the fastest (``self.choices`` records it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shuffleprune.deploy.format import decompress, meta_bits

IMPLS = ("triton", "semi_structured", "semi_cutlass", "dense")


class SharedGather:
    """One gathered input ``x[..., perm]`` shared by the layers of a group that read the same input
    through the same index map (q/k/v, gate/up): the first layer gathers, the others reuse it while
    the input tensor is the same object, unmodified."""

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None  # held, so its memory cannot be reused by another tensor
        self._version = -1
        self._value: torch.Tensor | None = None

    def get(self, x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        if x is not self._source or x._version != self._version:
            self._source, self._version, self._value = x, x._version, x.index_select(-1, perm)
        return self._value


def _bucket(tokens: int) -> int:
    """Token counts grouped by powers of two (1, 2, 4, …): one measured choice per bucket."""
    return 1 << max(0, (tokens - 1).bit_length())


class SparseLinear(nn.Module):
    """A compressed N:M linear layer with an optional input index map."""

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, in_features: int, n: int, m: int,
                 perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, policy: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = in_features, values.shape[0]
        self.n, self.m, self.bits = n, m, meta_bits(m)
        self.register_buffer("values", values)
        self.register_buffer("meta", meta)
        self.register_buffer("perm", None if perm is None else perm.to(torch.int32))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.policy = policy
        self.shared_gather: SharedGather | None = None  # set by export's loader for layers sharing a map
        self.choices: dict[int, str] = {}
        self._dense: torch.Tensor | None = None
        self._semi: dict[str, object] = {}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.n}:{self.m}, "
                f"perm={'yes' if self.perm is not None else 'no'}, bias={self.bias is not None}")

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight in the *original* input order (zeros where pruned) — for inspection and
        for code that reads ``.weight``; the forward pass never uses it."""
        w = self.dense_permuted()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm.long()] = w
        return out

    def dense_permuted(self) -> torch.Tensor:
        """``W_p`` decompressed (cached; invalidated when the module moves)."""
        if self._dense is None or self._dense.device != self.values.device or self._dense.dtype != self.values.dtype:
            self._dense = decompress(self.values, self.meta, self.n, self.m, self.in_features)
        return self._dense

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is None:
            return x
        if self.shared_gather is not None:
            return self.shared_gather.get(x, self.perm.long())
        return x.index_select(-1, self.perm.long())

    def _run(self, impl: str, x: torch.Tensor) -> torch.Tensor:
        if impl == "triton":
            from shuffleprune.kernels.nm_matmul import nm_gather_matmul

            return nm_gather_matmul(x, self.values, self.meta, self.n, self.m, self.bits, self.perm, self.bias)
        if impl in ("semi_structured", "semi_cutlass"):
            if impl not in self._semi:
                from torch.sparse import SparseSemiStructuredTensorCUTLASS, to_sparse_semi_structured

                w = self.dense_permuted()
                self._semi[impl] = (to_sparse_semi_structured(w) if impl == "semi_structured"
                                    else SparseSemiStructuredTensorCUTLASS.from_dense(w))
            xg = self._gathered(x)
            y = F.linear(xg.reshape(-1, xg.shape[-1]), self._semi[impl]).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(self._gathered(x), self.dense_permuted(), self.bias)

    def _candidates(self, x: torch.Tensor) -> list[str]:
        from shuffleprune.kernels.nm_matmul import available

        out = ["dense"]
        if available() and x.is_cuda:
            out.insert(0, "triton")
        if x.is_cuda and (self.n, self.m) == (2, 4) and x.dtype in (torch.float16, torch.bfloat16):
            out.append("semi_structured")
            if torch.cuda.get_device_capability(x.device)[0] == 8:  # PyTorch's CUTLASS 2:4 path: Ampere only
                out.append("semi_cutlass")
        return out

    def _measure(self, x: torch.Tensor, candidates: list[str]) -> str:
        best, best_ms = "dense", float("inf")
        for impl in candidates:
            try:
                for _ in range(3):  # compile / plan / decompress, then warm
                    self._run(impl, x)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    self._run(impl, x)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end) / 20
            except (RuntimeError, NotImplementedError):  # e.g. no cuSPARSELt for this shape/GPU
                continue
            if ms < best_ms:
                best, best_ms = impl, ms
        return best

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.policy != "auto":  # an explicit choice (tests and benchmarks), on any device
            return self._run(self.policy, x)
        if not x.is_cuda:
            return self._run("dense", x)
        tokens = x.numel() // x.shape[-1]
        key = _bucket(tokens)
        if key not in self.choices:
            self.choices[key] = self._measure(x, self._candidates(x))
            self._release_unused()
        return self._run(self.choices[key], x)

    def _release_unused(self) -> None:
        """Drop the forms built while measuring that no token count uses (a decompressed dense copy,
        semi-structured copies), so the layer holds only what it runs."""
        chosen = set(self.choices.values())
        for impl in [i for i in self._semi if i not in chosen]:
            del self._semi[impl]
        if "dense" not in chosen:
            self._dense = None
