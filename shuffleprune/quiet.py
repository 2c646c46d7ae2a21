"""Silence the progress bars the libraries we call draw on their own (weight loading, shard writing,
downloads), for runs asked to show none."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False, turn off transformers' and huggingface_hub's progress bars for the
    block and restore their previous state after it; with True, change nothing."""
    if enabled:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_was_on = hf_logging.is_progress_bar_enabled()
    hub_was_on = not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        yield
    finally:
        if hf_was_on:
            hf_logging.enable_progress_bar()
        if hub_was_on:
            enable_progress_bars()
