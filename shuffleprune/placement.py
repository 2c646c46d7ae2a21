"""A caller's model, used by a run and given back as it was found: on its devices, in its dtypes and
training mode, dispatched by its ``device_map`` again.

A model loaded with a ``device_map`` (accelerate's dispatch: blocks on several GPUs, or offloaded to
CPU memory or disk, their weights on the meta device until a forward) cannot be moved with ``.to()``.
:func:`held_for_run` loads every offloaded weight into CPU memory and takes accelerate's hooks off for
a run that places blocks itself (``prune``), then dispatches the model by the same map again (a part
offloaded to disk comes back offloaded to CPU memory, where its weights now are).
:func:`left_as_found` is the same promise for a run that scores a model where it is (``evaluate``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def is_dispatched(model: torch.nn.Module) -> bool:
    """Whether accelerate's hooks place ``model`` (loaded with a ``device_map`` that spans devices or offloads)."""
    return any(hasattr(m, "_hf_hook") for m in model.modules())


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _where(model: torch.nn.Module) -> dict[str, tuple[torch.device, torch.dtype]]:
    return {name: (t.device, t.dtype) for name, t in _tensors(model)}


def _put_back(model: torch.nn.Module, where: dict[str, tuple[torch.device, torch.dtype]]) -> None:
    """Each parameter and buffer back on its device in its dtype, as ``.to()`` moves them: a parameter
    keeps its object (an optimizer's references hold), a buffer is replaced (so that what a module
    caches from one, like ``SparseLinear``'s position words, is made again). A half-precision weight
    upcast for a CPU run comes back exactly."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in (module._parameters, module._buffers):
            for name, tensor in kind.items():
                device, dtype = where.get(f"{prefix}.{name}" if prefix else name, (None, None))
                if tensor is None or device is None or device.type == "meta" or \
                        (tensor.device == device and tensor.dtype == dtype):
                    continue
                if kind is module._parameters:
                    tensor.data = tensor.data.to(device, dtype)
                else:
                    kind[name] = tensor.to(device, dtype)


@contextmanager
def left_as_found(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the run may move ``model`` (unless dispatched), change its dtype and switch it
    to eval mode; after it, the model is on its devices, in its dtypes and training mode again."""
    training, where = model.training, _where(model)
    try:
        yield
    finally:
        _put_back(model, where)
        model.train(training)


def _undispatch(model: torch.nn.Module) -> dict:
    """Load a dispatched model's offloaded weights into CPU memory and remove accelerate's hooks;
    returns the device map it was dispatched by."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook, remove_hook_from_module
    from accelerate.utils import named_module_tensors, set_module_tensor_to_device

    device_map = dict(getattr(model, "hf_device_map", None) or {"": "cpu"})   # accelerate's cpu_offload has none
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in (hook.hooks if isinstance(hook, SequentialHook) else [hook]):
            if not isinstance(h, AlignDevicesHook) or not h.offload or h.weights_map is None:
                continue
            for name, tensor in named_module_tensors(module, include_buffers=h.offload_buffers,
                                                     recurse=h.place_submodules, remove_non_persistent=True):
                if tensor.device.type == "meta":
                    set_module_tensor_to_device(module, name, "cpu", value=h.weights_map[name])
    remove_hook_from_module(model, recurse=True)
    if hasattr(model, "hf_device_map"):   # whole on the CPU now (and saved so); dispatching sets it again
        del model.hf_device_map
    model.to("cpu")
    if hasattr(model, "tie_weights"):
        model.tie_weights()   # a tied weight loaded into one of its modules is shared again
    return device_map


@contextmanager
def held_for_run(model: torch.nn.Module) -> Iterator[None]:
    """``model`` for a run that places its blocks itself: in eval mode (no dropout in its statistics)
    and, when accelerate dispatched it, whole on the CPU without hooks; after the run (or its error)
    it is given back as :func:`left_as_found` promises, dispatched by its device map again."""
    if not is_dispatched(model):
        with left_as_found(model):
            model.eval()
            yield
        return
    device_map = _undispatch(model)
    try:
        with left_as_found(model):
            model.eval()
            yield
    finally:
        from accelerate import dispatch_model

        dispatch_model(model, device_map={name: "cpu" if where == "disk" else where for name, where in device_map.items()})


@contextmanager
def weights_readable(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s own weights hold their values: an offloaded module of a dispatched
    model (weights on the meta device) has them loaded from its offload for the time."""
    from accelerate.utils import align_module_device, has_offloaded_params

    if has_offloaded_params(module):
        with align_module_device(module):
            yield
    else:
        yield
