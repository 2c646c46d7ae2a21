"""Stage implementations, one module per job; each registers its stages with
:func:`shuffleprune.prune.stage.register`. A new module here is found without further edits."""
