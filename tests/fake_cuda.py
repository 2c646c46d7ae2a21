"""A CUDA device emulated on the CPU, to find device mix-ups in code that has only run on the CPU.

Inside :func:`fake_cuda`, ``torch.cuda.is_available()`` is true and a tensor put on ``"cuda"`` is a
:class:`OnCuda` wrapper: it reports ``device == cuda:0`` and computes on a CPU tensor inside. Every
ATen op on such tensors checks PyTorch's CUDA rule: all tensor operands on one device, except CPU
scalars (0-dim tensors) and the exceptions CUDA allows (copies between devices, CPU index tensors).
An op that mixes a "CUDA" tensor with a CPU one raises the error a real GPU would, so a path that
forgets a ``.to(device)`` fails here as it would on a GPU. Outputs of ops on "CUDA" tensors are
"CUDA" tensors; ``.cpu()`` / ``.to("cpu")`` give plain CPU tensors back.

The wrapper is a CPU tensor to C++ (so the autograd engine and composite ops never ask for a CUDA
runtime this build lacks) and ``cuda:0`` to Python; SDPA runs the CPU's kernels, forward and backward,
so a run here computes the CPU run's numbers bit for bit.

What it does not emulate: Triton kernels, CUDA graphs, streams' concurrency (streams and events are
no-ops), nondeterminism, memory limits (memory queries answer fixed sizes).
"""
from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten
# ops CUDA runs with a CPU tensor among its operands
CROSS_DEVICE = {aten._to_copy.default, aten.copy_.default, aten.index.Tensor, aten.index_put_.default,
                aten.index_put.default, aten._index_put_impl_.default, aten.lift_fresh.default,
                aten._local_scalar_dense.default}
# x.new_*(…): the device is x's unless one is named. C++ names it from x's options, which say CPU for the
# wrapper (autograd's AccumulateGrad makes a gradient laid out as its parameter so); Python naming the CPU
# is answered in _Functions
NEW_OF_SELF = {aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default,
               aten.new_ones.default, aten.new_full.default}


class DeviceMixError(RuntimeError):
    """What a real GPU raises for an op whose tensors sit on different devices."""


class OnCuda(torch.Tensor):
    """A tensor on the emulated CUDA device: a CPU tensor inside, ``cuda:0`` outside."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool | None = None):
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=inner.device, layout=inner.layout,   # the CPU to C++ (no CUDA runtime asked), CUDA to Python
            requires_grad=inner.requires_grad if requires_grad is None else requires_grad)
        out.inner = inner
        return out

    device = property(lambda self: CUDA)
    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)

    def get_device(self) -> int:   # noqa: D102
        return 0

    def data_ptr(self) -> int:   # noqa: D102  (code that tells tensors apart by address sees the real one)
        return self.inner.data_ptr()

    def untyped_storage(self):   # noqa: D102
        return self.inner.untyped_storage()

    def __repr__(self) -> str:   # noqa: D105
        return f"OnCuda({self.inner!r})"

    def __reduce_ex__(self, protocol):   # torch.save of a CUDA tensor: loads back on the CPU here
        return (torch.Tensor.clone, (self.inner.detach(),))

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def tree_map(fn, x):
    """``fn`` on every leaf of nested tuples, lists and dicts (pytree's, without its cost per op)."""
    if isinstance(x, (tuple, list)):
        return type(x)(tree_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def _leaves(x, out: list) -> list:
    if isinstance(x, (tuple, list)):
        for v in x:
            _leaves(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _leaves(v, out)
    else:
        out.append(x)
    return out


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _on_cpu(x) -> bool:
    """A CPU operand that CUDA refuses beside a CUDA one (not a 0-dim scalar)."""
    return isinstance(x, torch.Tensor) and not isinstance(x, OnCuda) and x.dim() > 0


def _refuse_mix(what, operands: list) -> None:
    """PyTorch's CUDA rule: raise where ``operands`` hold a "CUDA" tensor and a CPU one."""
    cpu = [x for x in operands if _on_cpu(x)]
    if cpu and any(isinstance(x, OnCuda) for x in operands):
        raise DeviceMixError(f"Expected all tensors to be on the same device, but found at least two devices, "
                             f"cuda:0 and cpu! ({what}: CPU operands {[tuple(t.shape) for t in cpu]})")


def _unwrap(x):
    """The CPU tensor inside; a conjugate or negative view made by a CPU op (``x.conj()`` in a complex
    backward) resolved, since a kernel called from ``__torch_dispatch__`` reads such bits as plain data."""
    if not isinstance(x, OnCuda):
        return x
    inner = x.inner
    return inner.resolve_conj().resolve_neg() if inner.is_conj() or inner.is_neg() else inner


def _wrap(x):
    return OnCuda(x) if isinstance(x, torch.Tensor) and not isinstance(x, OnCuda) else x


def _run(func, args, kwargs):
    """``func`` on the inner CPU tensors, after PyTorch's CUDA device check; "CUDA" outputs wrapped."""
    leaves = _leaves((args, kwargs), [])
    on_cuda = [x for x in leaves if isinstance(x, OnCuda)]
    target = kwargs.get("device")
    if func in NEW_OF_SELF and isinstance(args[0], OnCuda):
        target = CUDA
    if _is_cuda(target) and getattr(kwargs.get("generator"), "device", CUDA).type != "cuda":
        raise DeviceMixError(f"Expected a 'cuda' device type for generator but found 'cpu' ({func})")
    if not on_cuda and not _is_cuda(target):
        return func(*args, **kwargs)
    if func not in CROSS_DEVICE:
        _refuse_mix(func, leaves)
    if target is not None:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if func is aten.histc.default and not args[0].dtype.is_floating_point:   # CUDA's histc counts integers
        args = (args[0].to(torch.float32), *args[1:])
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if func is aten.copy_.default:      # in place: the destination keeps its device
        return args[0]
    if func is aten._local_scalar_dense.default:
        return out
    if _is_cuda(target) or (target is None and on_cuda):   # asked for the device, or kept there (a dtype change too)
        return tree_map(_wrap, out)
    return out


class _Dispatch(TorchDispatchMode):
    """Factory ops asked for ``device="cuda"`` (no tensor operand carries the device)."""

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _to(t: torch.Tensor, *args, **kwargs):
    """``Tensor.to`` with the device part done here (C++ refuses a CUDA device on a CPU build)."""
    copy = kwargs.pop("copy", False)
    if args and isinstance(args[0], torch.Tensor):   # .to(other): other's device as Python sees it, and dtype
        device, dtype = args[0].device, args[0].dtype
    else:
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    dtype = None if dtype == t.dtype else dtype
    target = device if device is not None else t.device
    if _is_cuda(target) and isinstance(t, OnCuda):   # staying on the device: a dtype change or a copy, with autograd
        if dtype is not None:
            return torch.ops.aten._to_copy.default(t, dtype=dtype)
        return t.clone() if copy else t
    inner = _unwrap(t)
    if dtype is not None:
        inner = inner.to(dtype)
    elif copy:
        inner = inner.clone()
    if _is_cuda(target):   # from the CPU: a copy onto the device, keeping the autograd history
        if t.requires_grad and torch.is_grad_enabled():
            return _ToDevice.apply(t, inner.dtype)
        return OnCuda(inner.detach() if inner is not t else inner.detach().clone(), requires_grad=False)
    if isinstance(t, OnCuda):
        return inner.clone() if inner is t.inner else inner   # to the CPU: a copy
    return inner


class _ToDevice(torch.autograd.Function):
    """``x.to("cuda", dtype)`` of a CPU tensor needing grad: the gradient comes back to the CPU in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return OnCuda(x.detach().to(dtype, copy=True))

    @staticmethod
    def backward(ctx, grad):
        return _unwrap(grad).to(ctx.dtype), None


NEW_FROM_PYTHON = {torch.Tensor.new_empty_strided, torch.Tensor.new_empty, torch.Tensor.new_zeros,
                   torch.Tensor.new_ones, torch.Tensor.new_full}


class _Functions(TorchFunctionMode):
    """Entry points whose C++ argument parsing would refuse a CUDA device on a CPU build."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            return _to(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return _to(args[0], "cuda")
        if func is torch.Tensor.cpu:
            return _to(args[0], "cpu")
        if (func is torch.tensor or func is torch.as_tensor) and _is_cuda(kwargs.get("device")):
            return OnCuda(func(*args, **{**kwargs, "device": "cpu"}))   # another device (meta, cpu) is kept
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], OnCuda):
            return _indexing(func, args)
        if func in NEW_FROM_PYTHON and isinstance(args[0], OnCuda) and not _is_cuda(kwargs.get("device", CUDA)):
            return func(args[0].inner, *args[1:], **kwargs)   # x.new_zeros(…, device="cpu"): on the CPU
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.nn.functional.one_hot and isinstance(args[0], OnCuda):
            return _on_inner(func, args, kwargs)   # C++ makes its arange with the input's C++ device, the CPU
        if func is torch.nn.functional.scaled_dot_product_attention and isinstance(args[0], OnCuda):
            return _attention(*args, **kwargs)   # SDPA's C++ entry asks the CUDA runtime for its kernels
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:   # C++ asked the CUDA runtime (a device guard, a scalar made on the device)
            if "not linked with support for cuda" not in str(err):
                raise
            return _on_inner(func, args, kwargs)


def _on_inner(func, args, kwargs):
    """``func`` on the inner CPU tensors (no autograd through it), with the device check of :func:`_run`."""
    tensors = [x for x in _leaves((args, kwargs), []) if isinstance(x, torch.Tensor)]
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        raise NotImplementedError(f"fake_cuda: {func} needs the CUDA runtime and a gradient through it")
    _refuse_mix(func, tensors)
    return tree_map(_wrap, func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)))


def _attention(q, k, v, attn_mask=None, **options):
    """``F.scaled_dot_product_attention`` by the CPU's own kernels on the inner tensors, forward and
    backward, so a run on the emulated GPU computes what the same run on the CPU computes, bit for bit."""
    _refuse_mix("scaled_dot_product_attention", [q, k, v, attn_mask])
    mask = None if attn_mask is None else _unwrap(attn_mask)
    return _ByCpuAutograd.apply(
        lambda *qkv: torch.nn.functional.scaled_dot_product_attention(*qkv, attn_mask=mask, **options), q, k, v)


class _ByCpuAutograd(torch.autograd.Function):
    """``fn`` of "CUDA" tensors run on their inner CPU tensors under the CPU's own autograd, whose
    backward gives the gradients (SDPA's kernels; indexing, whose repeated indices sum theirs)."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.inputs = [_unwrap(t).detach().requires_grad_(t.requires_grad) for t in tensors]
        with torch.enable_grad():
            ctx.out = fn(*ctx.inputs)
        return OnCuda(ctx.out.detach())

    @staticmethod
    def backward(ctx, grad):
        wanted = [t for t in ctx.inputs if t.requires_grad]
        found = iter(torch.autograd.grad(ctx.out, wanted, _unwrap(grad)))
        return (None, *(OnCuda(next(found)) if t.requires_grad else None for t in ctx.inputs))


def _indexing(func, args):
    """``t[idx]`` / ``t[idx] = v`` on a "CUDA" tensor: CPU or CUDA index tensors, as CUDA allows."""
    t, idx, *value = args
    inner_idx = tree_map(_unwrap, idx if isinstance(idx, tuple) else (idx,))
    inner_idx = inner_idx if isinstance(idx, tuple) else inner_idx[0]
    if func is torch.Tensor.__getitem__:
        if t.requires_grad and torch.is_grad_enabled():
            return _ByCpuAutograd.apply(lambda inner: inner[inner_idx].clone(), t)
        return OnCuda(t.inner[inner_idx])
    t.inner[inner_idx] = _unwrap(value[0])   # a CPU source is copied across, as CUDA's setitem does
    return None


def _device_properties(device=None):
    return types.SimpleNamespace(name="Fake CUDA (CPU)", major=9, minor=0, total_memory=80 * 2**30,
                                 multi_processor_count=132, shared_memory_per_block_optin=227 * 1024,
                                 L2_cache_size=50 * 2**20)


class _NoStream:
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *a):
        pass

    def is_capturing(self):
        return False

    def synchronize(self):
        pass

    def record(self, *a):
        pass

    def elapsed_time(self, other):
        return 0.0


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Run the body as if the machine had one CUDA GPU (see the module's docstring)."""
    cuda = torch.cuda
    patches = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "synchronize": lambda *a, **k: None, "empty_cache": lambda: None,
        "max_memory_allocated": lambda *a, **k: 0, "memory_allocated": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None, "mem_get_info": lambda *a, **k: (64 * 2**30, 80 * 2**30),
        "get_device_name": lambda *a, **k: "Fake CUDA (CPU)", "get_device_capability": lambda *a, **k: (9, 0),
        "get_device_properties": _device_properties, "is_current_stream_capturing": lambda: False,
        "get_rng_state_all": lambda: [], "set_rng_state_all": lambda states: None,
        "manual_seed_all": lambda seed: None, "manual_seed": lambda seed: None,
        "stream": lambda *a, **k: contextlib.nullcontext(), "current_stream": lambda *a, **k: _NoStream(),
        "Stream": _NoStream, "Event": _NoStream, "_lazy_init": lambda: None, "is_initialized": lambda: True,
    }
    saved = {name: getattr(cuda, name) for name in patches}
    for name, value in patches.items():
        setattr(cuda, name, value)
    # the device-generic API (accelerate ≥ 1.16 picks its device by torch.accelerator.current_accelerator())
    generic = {"current_accelerator": lambda *a, **k: torch.device("cuda"), "is_available": lambda: True,
               "device_count": lambda: 1, "current_device_index": lambda: 0,
               "current_stream": lambda *a, **k: _NoStream(), "synchronize": lambda *a, **k: None}
    saved_generic = {name: getattr(torch.accelerator, name) for name in generic if hasattr(torch.accelerator, name)}
    for name, value in generic.items():
        setattr(torch.accelerator, name, value)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)   # module.to() swaps each parameter in place,
    try:                                                           # so references to it hold, as on a GPU
        with _Functions(), _Dispatch():
            yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        for name, value in saved.items():
            setattr(cuda, name, value)
        for name in generic:
            if name in saved_generic:
                setattr(torch.accelerator, name, saved_generic[name])
            else:
                delattr(torch.accelerator, name)
