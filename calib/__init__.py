"""Calibration and evaluation text sources (installed as ``shuffleprune.calib``)."""
from shuffleprune.calib.sources import (TextSource, as_documents, bos_token, calibration_windows, default_eval_source,
                                        documents_name, documents_source, eval_tokens, get_source, held_out_part,
                                        same_text, text_contains)

__all__ = ["TextSource", "bos_token", "calibration_windows", "eval_tokens", "get_source", "default_eval_source",
           "held_out_part", "same_text", "as_documents", "documents_name", "documents_source", "text_contains"]
