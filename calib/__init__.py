"""Calibration and evaluation text sources (installed as ``shuffleprune.calib``)."""
from shuffleprune.calib.sources import (TextSource, bos_token, calibration_windows, default_eval_source, eval_tokens,
                                        get_source, held_out_part, open_text, same_text, text_contains, texts_in_memory)

__all__ = ["TextSource", "bos_token", "calibration_windows", "eval_tokens", "get_source", "default_eval_source",
           "held_out_part", "same_text", "open_text", "text_contains", "texts_in_memory"]
