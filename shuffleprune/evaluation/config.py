"""What ``eval`` scores and how (:class:`EvalConfig`), and its defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

PPL = "ppl"
DEFAULT_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "openbookqa", PPL)
OFFLINE_PPL_TEXT = "brown"
ONLINE_PPL_TEXT = "wikitext2"


@dataclass
class EvalConfig:
    """What ``eval`` scores and how; every field lands in the results file."""

    models: list[str | None] = field(default_factory=lambda: [None])  # None: the embedded default
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    limit: float | None = None            # lm-eval --limit: items per task (<1: a fraction)
    num_fewshot: int | None = None        # None: each task's own default (0 for the paper's tasks)
    batch_size: int = 8
    device: str = "auto"
    dtype: str = "auto"
    offline: bool = False                 # force local task data even if the hub is reachable
    include_path: list[str] | None = None  # extra lm-eval task directories
    ppl_text: str = "auto"                # auto: wikitext2 online, brown offline; or a source name/path
    ppl_ctx: int = 2048
    ppl_tokens: int | None = None         # cap on held-out tokens (default: the whole test split)
    ppl_bos: str = "window"               # BOS of tokenizers that add one: every window | the text's start (the papers')
    apply_chat_template: bool = False     # lm-eval --apply_chat_template: each item through the model's chat template
    trust_remote_code: bool = False       # run the model code a checkpoint ships (auto_map), as transformers' flag
    baseline: str | int | None = None     # the model the others are compared with item by item: as given, or its
                                          # position (Python); None: the first
