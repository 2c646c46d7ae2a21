"""Is the Hugging Face hub reachable? If not, switch the HF libraries to offline mode so that a
missing model or dataset fails at once from the local cache instead of after minutes of retries.
And does a name look like a hub id rather than a local path?"""
from __future__ import annotations

import os
import re
import socket
from functools import lru_cache
from urllib.parse import urlparse


@lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the hub endpoint (``HF_ENDPOINT`` or the default) accepts a TCP connection.
    When it does not (or ``HF_HUB_OFFLINE`` is set), HF libraries are put into offline mode."""
    import huggingface_hub.constants as hf_constants

    if hf_constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(hf_constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        hf_constants.HF_HUB_OFFLINE = True
        try:
            import datasets.config

            datasets.config.HF_HUB_OFFLINE = True
        except ImportError:  # pragma: no cover
            pass
        return False


def looks_like_hub_id(spec: str) -> bool:
    """``name`` or ``owner/name`` in the characters hub ids use, so not a local path (``./x``, ``/x``,
    ``~/x``, ``a/b/c``) nor a name no repo can have (``in-memory LlamaForCausalLM``)."""
    return not spec.startswith(".") and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec) is not None
