"""The stage contract of the block walk, and the registry that recipes name stages from.

A stage does one job. The driver calls, for every stage of a recipe in order:

- ``check(spec)`` once, before anything is loaded (bad parameters fail fast);
- ``device_bytes(weights)`` once the model is loaded, before any data: what the stage holds on the
  device at once besides the whole model, when it moves the model there (0: one block at a time),
  so a run the device cannot hold is refused before any work;
- ``prepare(run)`` once, before the first block (model-level passes: dense statistics, learning
  every permutation jointly, reading maps of an earlier run);
- ``apply(run, work)`` for every decoder block, in recipe order.

Stage kinds run in this order: ``statistics`` (what the layers' inputs look like), ``permutation``
(the input-channel index maps), ``prune`` (mask and weight update), ``update`` (weight updates after
the mask). A stage is a dataclass whose fields are its recipe parameters; registering it with
:func:`register` makes it available to recipes (``{kind: name, param: value, …}``) without any
edit to the driver.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from shuffleprune.block_inputs import CapturedInputs, run_block
from shuffleprune.blocks import Blocks, ExpertWeight
from shuffleprune.masks import Pattern

KINDS = ("statistics", "permutation", "prune", "update")


@dataclass
class RunSpec:
    """What a stage may check its parameters against before any work: the pattern and the other stages."""

    pattern: Pattern
    stages: list["Stage"]
    nsamples: int

    def needs(self) -> set[str]:
        """Union of what the stages need from the statistics: ``norms`` (‖X_j‖) and/or ``gram`` (XᵀX)."""
        return set().union(*(s.needs() for s in self.stages))


@dataclass
class Run:
    """Everything of a pruning run that outlives one block (what ``prepare`` and ``apply`` see)."""

    model: nn.Module
    blocks: Blocks
    linears: list[dict[str, nn.Linear]]   # per block: full name -> selected linear
    experts: list[dict[str, ExpertWeight]]  # per block: full name -> selected expert of a fused MoE layer
    tokens: torch.Tensor                  # calibration windows [n, L]
    pattern: Pattern
    spec: RunSpec
    device: torch.device
    batch_size: int
    seed: int
    work: Path | None                     # resume directory (None: nothing is saved)
    progress: bool
    captured: CapturedInputs | None = None
    status: Callable[[str], None] = lambda text: None      # shows a stage's progress (e.g. on the block bar)
    notes: dict[str, Any] = field(default_factory=dict)   # run-level report entries
    cache: dict[str, Any] = field(default_factory=dict)   # run-level results several stages read (dense statistics)

    def all_linears(self) -> dict[str, nn.Linear]:
        return {n: lin for block in self.linears for n, lin in block.items()}

    def all_experts(self) -> dict[str, ExpertWeight]:
        return {n: e for block in self.experts for n, e in block.items()}


@dataclass
class BlockWork:
    """One decoder block while its stages run: its inputs and what the stages found so far."""

    index: int
    prefix: str                            # e.g. ``model.layers.3``
    block: nn.Module
    linears: dict[str, nn.Linear]
    hidden: torch.Tensor                   # the block's inputs for every calibration window
    # Experts of fused MoE layers: masked and updated like linears (prune, lsq; random and searched
    # index maps; blockrecon per fused tensor), kept in their own column order in the checkpoint.
    experts: dict[str, ExpertWeight] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)        # name -> InputStats | None (linears and experts)
    groups: list[list[str]] = field(default_factory=list)      # linears that read one input
    expert_groups: list[list[str]] = field(default_factory=list)  # experts' matrices that read one input
    perms: dict[str, torch.Tensor] = field(default_factory=dict)
    perm_info: dict | None = None          # report entry of the block's permutations
    dense: dict[str, torch.Tensor] = field(default_factory=dict)   # unpruned weights (when a stage needs them)
    dense_outputs: torch.Tensor | None = None  # the unpruned model's outputs of this block (``dense_stream``)
    report: dict[str, Any] = field(default_factory=dict)           # stages' per-block report entries

    def weights(self) -> dict[str, nn.Linear | ExpertWeight]:
        """Every selected matrix of the block, linears then experts (each has ``.weight``)."""
        return {**self.linears, **self.experts}

    def outputs(self, run: Run) -> torch.Tensor:
        """The block's current outputs for every window (its weights as they are now)."""
        return run_block(self.block, self.hidden, run.captured, self.index, run.device, run.batch_size)


class Stage:
    """Base of every stage: a dataclass of parameters with a ``kind`` and a ``name``."""

    kind: ClassVar[str]
    name: ClassVar[str]
    smaller: ClassVar[str] = "take a recipe whose stages work block by block"   # when device_bytes do not fit

    def needs(self) -> set[str]:
        """What this stage reads: ``norms`` and/or ``gram`` (statistics), ``dense_weights`` (the
        block's unpruned weights, kept by the driver in ``BlockWork.dense``), ``dense_stream`` (the
        unpruned model's activations, propagated by the driver beside the pruned ones: this block's
        outputs in ``BlockWork.dense_outputs``)."""
        return set()

    def check(self, spec: RunSpec) -> None:
        """Raise ``UserError`` for parameters that cannot work with this run."""

    def device_bytes(self, weights: dict[str, nn.Linear | ExpertWeight]) -> int:
        """At least the bytes this stage holds on the device at once besides the whole model, when it
        moves the model there; 0 for a stage that works one block at a time (the driver's own need)."""
        return 0

    def prepare(self, run: Run) -> None:
        """Once, before the first block (after a resume too: reload what was saved in ``run.work``)."""

    def apply(self, run: Run, work: BlockWork) -> None:
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def as_recipe(self) -> dict[str, Any]:
        """This stage as one recipe entry: ``{kind: name, param: value, …}``."""
        return {self.kind: self.name, **self.params()}


REGISTRY: dict[tuple[str, str], type[Stage]] = {}


def register(cls: type[Stage]) -> type[Stage]:
    """Class decorator: make a stage dataclass available to recipes as ``{cls.kind: cls.name}``."""
    if cls.kind not in KINDS:
        raise ValueError(f"stage kind '{cls.kind}' is not one of {KINDS}")
    REGISTRY[(cls.kind, cls.name)] = cls
    return cls
