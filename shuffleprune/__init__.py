"""shuffleprune: N:M sparsity for pretrained LLMs with learned input-channel permutations."""
__version__ = "0.1.0"


def load(path: str, dtype: str = "auto"):
    """Load a checkpoint written by ``shuffleprune export`` (linears as compressed ``SparseLinear``),
    by ``prune`` (with its index maps applied) or any HF model; returns the model (``.eval()``).
    The tokenizer: ``transformers.AutoTokenizer.from_pretrained(path)``."""
    from .models import load_model

    return load_model(path, dtype).model
