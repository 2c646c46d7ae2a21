"""``python -m shuffleprune …``: the command line, also as the module that ``torchrun`` and
``accelerate launch -m shuffleprune dst …`` start on every process of a multi-GPU run."""
from shuffleprune.cli import main

main()
