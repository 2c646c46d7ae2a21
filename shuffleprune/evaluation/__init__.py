"""Evaluation: the one perplexity (``perplexity``), lm-eval zero-shot tasks side by side (``evaluate``)
and their offline copies (``offline_tasks``)."""
