"""A block's recorded call arguments made a batch's: those laid out per window (:class:`PerWindow`), those
holding each window's own data (:class:`WindowData`), state blocks hand later blocks (:class:`SharedState`),
and what a block returned that the model hands the next block (:class:`Carried`)."""
from __future__ import annotations

from collections import UserDict
from collections.abc import MutableMapping
from typing import Any, Callable

import torch

from shuffleprune.errors import UserError


class PerWindow:
    """A block argument laid out window by window along dim 0, held for one window: BLOOM's ALiBi
    bias is ``[batch·heads, 1, L]`` (repeated for a batch), XGLM's mask ``[batch, 1, L, L]`` (a
    leading 1 broadcasts, but XGLM checks the batch size: expanded, a view)."""

    def __init__(self, one: torch.Tensor):
        self.one = one

    def expand(self, batch: int, device: torch.device) -> torch.Tensor:
        one = self.one.to(device)
        if one.shape[0] == 1:
            return one.expand(batch, *one.shape[1:])
        return one.repeat(batch, *([1] * (one.dim() - 1)))


class WindowData:
    """A block argument that holds each window's own data (Zamba2's hybrid blocks are passed the
    embeddings as ``original_hidden_states``): recorded for every window like the hidden states,
    and taken row by row for a batch. Blocks passed the same tensor share one."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.all: torch.Tensor | None = None

    def rows(self, windows: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.all is None:
            self.all, self.parts = torch.cat(self.parts), []
        return self.all[windows].to(device)


class SharedState:
    """A container the model hands every block, empty when recorded, that blocks write into for later
    blocks to read (Gemma 3n's ``shared_kv_states``: a layer stores its keys and values, later layers
    reuse them). Blocks run one at a time over batches of windows, so each write is kept for the
    windows it was made for (every tensor's dim 0 is the batch), and each call gets a fresh dict
    (:class:`_StateView`) holding every entry written so far, for its windows."""

    def __init__(self, windows: int):
        self.windows = windows
        self.entries: dict[Any, Any] = {}
        self.written: dict[Any, torch.Tensor] = {}   # per entry: which windows a block has written

    def view(self, windows: slice | torch.Tensor, batch: int, device: torch.device) -> "_StateView":
        # an entry not yet written for all of these windows is left out (as the model's own dict
        # would lack it), never read as zeros
        return _StateView(self, windows, batch, {k: _map_tensors(v, lambda t: t[windows].to(device))
                                                 for k, v in self.entries.items() if self.written[k][_on_cpu(windows)].all()})

    def write(self, key: Any, value: Any, windows: slice | torch.Tensor, batch: int) -> None:
        def keep(t: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
            if t.dim() == 0 or t.shape[0] != batch:
                raise UserError(f"a block stores {tuple(t.shape)} under '{key}' for later blocks, not laid out by "
                                f"window along dim 0 ({batch} here); shuffleprune cannot replay such a model block by block")
            if held is None or held.shape[1:] != t.shape[1:] or held.dtype != t.dtype:
                held = torch.zeros((self.windows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            held[windows] = t.detach().to(held.device)
            return held

        old = self.entries.get(key)
        self.written.setdefault(key, torch.zeros(self.windows, dtype=torch.bool))[_on_cpu(windows)] = True
        if isinstance(value, torch.Tensor):
            self.entries[key] = keep(value, old if isinstance(old, torch.Tensor) else None)
        elif isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
            olds = old if isinstance(old, tuple) and len(old) == len(value) else (None,) * len(value)
            self.entries[key] = tuple(keep(t, h) for t, h in zip(value, olds))
        else:
            raise UserError(f"a block stores a {type(value).__name__} under '{key}' for later blocks; shuffleprune "
                            "replays blocks one at a time and keeps only tensors (or tuples of them) per window")


class _StateView(UserDict):
    """One call's view of a :class:`SharedState`: its entries for the call's windows; what the block
    writes is kept in the state for those windows. (A ``UserDict`` with an in-place ``to``, as
    transformers' own ``KVSharingDict``, so helpers that rebuild dicts leave it alone.)"""

    def __init__(self, state: SharedState, windows: slice | torch.Tensor, batch: int, entries: dict):
        self._state, self._windows, self._batch = state, windows, batch
        super().__init__()
        self.data.update(entries)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.data[key] = value
        self._state.write(key, value, self._windows, self._batch)

    def to(self, device: torch.device, non_blocking: bool = False) -> "_StateView":
        for key, value in self.data.items():
            self.data[key] = _map_tensors(value, lambda t: t.to(device, non_blocking=non_blocking))
        return self


class CarriedOutputs:
    """What blocks return besides their hidden states that the model hands the next block as an argument (Zaya's
    residual stream, the top-k indices of GLM-5's DSA indexer, Kolibri 1.1's index pool), kept for every window
    per block that returned it. Blocks run one at a time over batches of windows, so the next block reads the
    previous one's own answer for its windows, not the one recorded for a single window. Only the last two
    producers are kept (a block run again reads the one before it), unless ``keep_all``."""

    def __init__(self, windows: int):
        self.windows = windows
        self.wanted: dict[int, set[int]] = {}   # producer → positions in its output tuple (after the hidden states)
        self.held: dict[int, dict[int, torch.Tensor]] = {}
        self.written: dict[int, torch.Tensor] = {}   # producer → which windows it has answered for
        self.keep_all = False
        self.frozen = False   # reads only: a probe's inputs stay those of its first pass

    def keep(self, producer: int, output: Any, windows: slice | torch.Tensor, batch: int) -> None:
        """Keep what block ``producer`` returned (``output``, a tuple led by its hidden states) for ``windows``."""
        if producer not in self.wanted or self.frozen:
            return
        if not self.keep_all:
            for old in [k for k in self.held if k not in (producer - 1, producer)]:
                del self.held[old], self.written[old]
        held = self.held.setdefault(producer, {})
        for position in self.wanted[producer]:
            t = output[1 + position].detach()
            if t.dim() == 0 or t.shape[0] != batch:   # not laid out by window: the same for every window
                held[position] = t
                continue
            old = held.get(position)
            if old is None or old.shape[0] != self.windows or old.shape[1:] != t.shape[1:] or old.dtype != t.dtype:
                old = held[position] = torch.zeros((self.windows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            old[windows] = t.to(old.device)
        self.written.setdefault(producer, torch.zeros(self.windows, dtype=torch.bool))[_on_cpu(windows)] = True

    def rows(self, producer: int, position: int, windows: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
        if producer not in self.written or not self.written[producer][_on_cpu(windows)].all():
            raise RuntimeError(f"block {producer + 1} reads what block {producer} returned for windows it has not run on")
        t = self.held[producer][position]
        return (t[windows] if t.dim() and t.shape[0] == self.windows else t).to(device)


class Carried:
    """A block argument that is element ``position`` of what block ``producer`` returned besides its hidden states
    (the model hands it on): read from ``outputs`` for a batch's windows."""

    def __init__(self, outputs: CarriedOutputs, producer: int, position: int):
        self.outputs, self.producer, self.position = outputs, producer, position
        outputs.wanted.setdefault(producer, set()).add(position)

    def rows(self, windows: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
        return self.outputs.rows(self.producer, self.position, windows, device)


def carried_outputs(args: list[tuple], kwargs: list[dict], rest: tuple | None,
                    windows: int) -> tuple[list[tuple], list[dict], CarriedOutputs | None]:
    """Each block's recorded arguments with every tensor that *is* one of ``rest`` (what the blocks' stand-ins
    returned besides the hidden states while recording, so the model handed a block's return to the next one)
    replaced by a :class:`Carried` reading the previous block's own return; None when no block is handed one."""
    positions = {id(t): j for j, t in enumerate(rest or ()) if isinstance(t, torch.Tensor)}
    outputs = CarriedOutputs(windows)

    def marker(block: int) -> Callable[[Any], Any]:
        return lambda obj: (Carried(outputs, block - 1, positions[id(obj)])
                            if isinstance(obj, torch.Tensor) and id(obj) in positions and block > 0 else obj)

    if not positions:
        return args, kwargs, None
    args = [_map_leaves(a, marker(i)) for i, a in enumerate(args)]
    kwargs = [_map_leaves(kw, marker(i)) for i, kw in enumerate(kwargs)]
    return args, kwargs, outputs if outputs.wanted else None


def rebind_carried(obj: Any, outputs: CarriedOutputs) -> Any:
    """``obj`` with every :class:`Carried` reading from ``outputs`` instead (a second stream of activations)."""
    return _map_leaves(obj, lambda leaf: Carried(outputs, leaf.producer, leaf.position) if isinstance(leaf, Carried)
                       else leaf)


def _map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` (nested tuples/lists/dicts) with ``fn`` applied to everything else inside it."""
    if isinstance(obj, (tuple, list)):
        return _same_sequence(obj, [_map_leaves(o, fn) for o in obj])
    if isinstance(obj, dict):
        return {k: _map_leaves(v, fn) for k, v in obj.items()}
    return fn(obj)


def _same_sequence(like: tuple | list, items: list) -> tuple | list:
    """``items`` as a sequence of ``like``'s type: a named tuple (its fields are positional) stays one."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items)


def _on_cpu(windows: slice | torch.Tensor) -> slice | torch.Tensor:
    return windows.cpu() if isinstance(windows, torch.Tensor) else windows


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return fn(value) if isinstance(value, torch.Tensor) else tuple(fn(t) for t in value)


def shared_states(kwargs: list[dict], windows: int) -> list[dict]:
    """Each block's keyword arguments with every mapping that is empty and handed to two or more
    blocks (the very same object) replaced by one :class:`SharedState`."""
    seen: dict[int, int] = {}
    for kw in kwargs:
        for v in kw.values():
            if isinstance(v, MutableMapping) and not v:
                seen[id(v)] = seen.get(id(v), 0) + 1
    states = {key: SharedState(windows) for key, count in seen.items() if count > 1}
    return [{k: states.get(id(v), v) for k, v in kw.items()} for kw in kwargs]


def for_batch(obj: Any, windows: slice | torch.Tensor, batch: int, device: torch.device) -> Any:
    """Every tensor inside ``obj`` (nested tuples/lists/dicts) on ``device``, each :class:`PerWindow`
    repeated for ``batch`` windows, each :class:`WindowData` taken for ``windows``, each
    :class:`SharedState` as a view for ``windows``, each :class:`Carried` as the previous block's return for them."""
    def leaf(obj: Any) -> Any:
        if isinstance(obj, PerWindow):
            return obj.expand(batch, device)
        if isinstance(obj, (WindowData, Carried)):
            return obj.rows(windows, device)
        if isinstance(obj, SharedState):
            return obj.view(windows, batch, device)
        if isinstance(obj, torch.Tensor):
            return obj.to(device)
        return obj

    return _map_leaves(obj, leaf)


def mark_per_window(one: Any, two: Any, shared: dict[int, WindowData]) -> Any:
    """The arguments recorded for one window, with those recorded for two windows as two copies of it
    along dim 0 marked :class:`PerWindow`, and those that differ between the two windows marked
    :class:`WindowData` (one per tensor: ``shared`` maps the two-window tensors seen so far to it);
    anything else stays as recorded for one window (an argument that does not grow with the batch)."""
    if isinstance(one, torch.Tensor) and isinstance(two, torch.Tensor):
        if one.dim() == 0 or one.shape == two.shape:
            return one
        if two.shape[1:] != one.shape[1:] or two.shape[0] != 2 * one.shape[0]:
            return one
        if torch.equal(two, torch.cat([one, one])):
            return PerWindow(one)
        return shared.setdefault(id(two), WindowData())
    if isinstance(one, (tuple, list)) and isinstance(two, (tuple, list)) and len(one) == len(two):
        return _same_sequence(one, [mark_per_window(a, b, shared) for a, b in zip(one, two)])
    if isinstance(one, dict) and isinstance(two, dict) and one.keys() == two.keys():
        return {k: mark_per_window(v, two[k], shared) for k, v in one.items()}
    return one


def window_data(obj: Any) -> list[WindowData]:
    """The :class:`WindowData` markers inside ``obj``, in a fixed walk order."""
    if isinstance(obj, WindowData):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [w for o in obj for w in window_data(o)]
    if isinstance(obj, dict):
        return [w for v in obj.values() for w in window_data(v)]
    return []


def fill_window_data(marked: Any, recorded: Any, filled: set[int]) -> None:
    """Append to every :class:`WindowData` in ``marked`` its value in ``recorded`` (the same
    arguments recorded for a batch of windows), once per marker (``filled``: those done)."""
    if isinstance(marked, WindowData):
        if id(marked) not in filled:
            marked.parts.append(recorded.detach())
            filled.add(id(marked))
    elif isinstance(marked, (tuple, list)):
        for m, r in zip(marked, recorded):
            fill_window_data(m, r, filled)
    elif isinstance(marked, dict):
        for k, m in marked.items():
            fill_window_data(m, recorded[k], filled)
