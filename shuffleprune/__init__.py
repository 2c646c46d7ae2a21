"""shuffleprune: N:M sparsity for pretrained LLMs with learned input-channel permutations."""
__version__ = "0.1.0"
