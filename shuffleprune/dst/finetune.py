"""``shuffleprune finetune``: train a pruned checkpoint's kept weights on text with its zeros held (the ``keep``
method of :class:`~shuffleprune.dst.sparsifier.DynamicSparsifier`), through the ``dst`` trainer: the same text
sources, schedule, held-out perplexity, checkpoints and ``--resume``, one process or several."""
from __future__ import annotations

from pathlib import Path

from shuffleprune.dst.config import DSTConfig, TrainConfig


def finetune(pruned: str | Path, out: str | Path, *, data: str = "wiki", steps: int = 200, lr: float = 1e-4,
             warmup: int = 20, seq_len: int = 512, batch_size: int = 8, eval_every: int = 50,
             eval_tokens: int | None = 65536, checkpoint_every: int = 50, seed: int = 0,
             trust_remote_code: bool = False, resume: bool = False, overwrite: bool = False, progress: bool = True,
             deterministic: bool = False) -> dict:
    """Fine-tune the pruned checkpoint ``pruned`` (a ``prune`` output, or any checkpoint whose linears hold
    zeros) into ``out/model``: AdamW with warmup and cosine decay in float32, every zero it had still zero
    after every step, saved in the checkpoint's dtype with its index maps and prune report (``export`` and
    ``eval`` take it as they take ``pruned``); the report (``out/dst_report.json``, also returned) holds the
    held-out perplexity before the first step and after the last."""
    start = str(pruned)
    cfg = TrainConfig(arch=start, tokenizer=start, init=start, data=data, seq_len=seq_len, batch_size=batch_size,
                      steps=steps, lr=lr, warmup=warmup, eval_every=eval_every, eval_tokens=eval_tokens,
                      checkpoint_every=checkpoint_every, seed=seed, trust_remote_code=trust_remote_code)
    from shuffleprune.dst.train import train

    return train(cfg, DSTConfig(method="keep", seed=seed), out, resume=resume, overwrite=overwrite, progress=progress,
                 deterministic=deterministic)
