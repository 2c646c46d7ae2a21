"""Calibration and evaluation text sources (installed as ``shuffleprune.calib``)."""
from .sources import TextSource, calibration_windows, eval_tokens, get_source, default_eval_source

__all__ = ["TextSource", "calibration_windows", "eval_tokens", "get_source", "default_eval_source"]
