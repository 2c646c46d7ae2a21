"""Which tensor each module of a block reads and writes on one probe run (forward hooks).

The deploy-time rewrites find their groups by tensor identity, so no architecture is assumed:
moving an index map to its producer needs the module whose output *is* a layer's input
(:meth:`BlockIO.producer_of`), stacking layers needs the layers that read one tensor
(:meth:`BlockIO.readers_by_input`). One recorder serves both.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn


@dataclasses.dataclass
class BlockIO:
    """One probe run of a block: ``inputs`` (reader name → the tensor it was called with),
    ``outputs`` (every other module's tensor output, in completion order: inner modules first)
    and the block's own ``output``. The tensors are held, so identity comparisons are meaningful."""

    inputs: dict[str, torch.Tensor]
    outputs: list[tuple[str, torch.Tensor]]
    output: torch.Tensor
    leaf_inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def modules_reading(self, x: torch.Tensor) -> list[str]:
        """The modules called with ``x`` itself (recorded with ``leaves=True``: every leaf module)."""
        return [name for name, seen in self.leaf_inputs.items() if seen is x]

    def producer_of(self, reader: str) -> str | None:
        """The innermost module whose output is ``reader``'s input tensor (not one containing ``reader``)."""
        x = self.inputs[reader]
        return next((name for name, out in self.outputs if out is x and not reader.startswith(name + ".")), None)

    def readers_by_input(self) -> list[list[str]]:
        """The readers grouped by the tensor they read, groups and members in first-read order."""
        groups: list[tuple[torch.Tensor, list[str]]] = []
        for name, x in self.inputs.items():
            group = next((names for tensor, names in groups if tensor is x), None)
            if group is None:
                groups.append((x, [name]))
            else:
                group.append(name)
        return [names for _, names in groups]


def record_block_io(block: nn.Module, run: Callable[[], torch.Tensor], is_reader: Callable[[nn.Module], bool],
                    outputs: bool = True, leaves: bool = False) -> BlockIO:
    """Run ``run()`` (the block on its probe input) with hooks on ``block``'s submodules: the modules
    ``is_reader`` selects record the tensor they are called with, the others (if ``outputs``) their
    tensor output; with ``leaves``, every module without children also records the tensor it is
    called with (``leaf_inputs``). The hooks return nothing, so the run is the block's ordinary forward."""
    inputs: dict[str, torch.Tensor] = {}
    leaf_inputs: dict[str, torch.Tensor] = {}
    produced: list[tuple[str, torch.Tensor]] = []

    def reader_hook(name: str, into: dict[str, torch.Tensor]):
        def hook(_module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor):
                into.setdefault(name, args[0])
        return hook

    def output_hook(name: str):
        def hook(_module: nn.Module, _args: tuple, out: object) -> None:
            if isinstance(out, torch.Tensor):
                produced.append((name, out))
        return hook

    handles = []
    for name, mod in block.named_modules():
        if not name:
            continue
        if is_reader(mod):
            handles.append(mod.register_forward_pre_hook(reader_hook(name, inputs)))
        elif outputs:
            handles.append(mod.register_forward_hook(output_hook(name)))
        if leaves and next(mod.children(), None) is None:
            handles.append(mod.register_forward_pre_hook(reader_hook(name, leaf_inputs)))
    try:
        with torch.no_grad():
            output = run()
    finally:
        for handle in handles:
            handle.remove()
    return BlockIO(inputs, produced, output, leaf_inputs)
