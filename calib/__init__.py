"""Calibration and evaluation text (installed as ``shuffleprune.calib``): sources by name
(:mod:`.sources`), read from the hub (:mod:`.hub_data`), local files (:mod:`.files`) or the offline
corpora (:mod:`.corpora`) as documents (:mod:`.documents`), and the token windows drawn from them
(:mod:`.sampling`)."""
from shuffleprune.calib.sampling import bos_token, calibration_windows, eval_tokens
from shuffleprune.calib.sources import (TextSource, default_eval_source, get_source, held_out_part, open_text, same_text,
                                        text_contains, texts_in_memory)

__all__ = ["TextSource", "bos_token", "calibration_windows", "eval_tokens", "get_source", "default_eval_source",
           "held_out_part", "same_text", "open_text", "text_contains", "texts_in_memory"]
