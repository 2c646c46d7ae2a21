"""Silence the progress bars the libraries we call draw on their own (weight loading, shard writing,
downloads, lm-eval's request building and scoring), for runs asked to show none."""
from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Iterator
from unittest.mock import patch


@contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False, turn off transformers', huggingface_hub's and datasets' progress bars for the
    block and restore their previous state after it; with True, change nothing."""
    if enabled:
        yield
        return
    import datasets
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_was_on = hf_logging.is_progress_bar_enabled()
    hub_was_on = not are_progress_bars_disabled()
    datasets_was_on = datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if hf_was_on:
            hf_logging.enable_progress_bar()
        if hub_was_on:
            enable_progress_bars()
        if datasets_was_on:
            datasets.enable_progress_bars()


@contextmanager
def lm_eval_progress_bars(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False, make every tqdm bar lm-eval's loaded modules draw a disabled one for the block:
    lm-eval has no switch for them all (building a task's requests has none, and ``simple_evaluate`` passes none
    to the model), so each ``lm_eval`` module's own ``tqdm`` name is swapped for a subclass that never shows."""
    if enabled:
        yield
        return
    from tqdm import tqdm

    class Hidden(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    with ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            bar = getattr(module, "tqdm", None) if name.split(".")[0] == "lm_eval" else None
            if isinstance(bar, type) and issubclass(bar, tqdm):
                stack.enter_context(patch.object(module, "tqdm", Hidden))
        yield
