"""How ``shuffleprune.load`` lays out an exported model for serving, as one call the benchmarks make too:
index maps moved to their producers, cuSPARSELt's buffer where it helps, shared-input layers stacked;
and ``warm_up``, which makes ``auto``'s measurements before a server takes requests."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shuffleprune.block_inputs import lazy_block_probe
from shuffleprune.errors import UserError

MAPS_PLACES = ("kernel", "producer")


def check_serving_options(maps: str, fuse: bool = True, cslt: bool | None = None) -> None:
    """Refuse a ``maps`` that is no place for an index map, and a ``fuse`` or ``cslt`` that is no
    yes or no (a string was taken as true); ``load`` asks before reading weights."""
    if not isinstance(maps, str) or maps not in MAPS_PLACES:
        raise UserError(f"maps must be 'kernel' or 'producer', not {maps!r}")
    if not isinstance(fuse, bool):
        raise UserError(f"fuse must be True or False, not {fuse!r}")
    if cslt is not None and not isinstance(cslt, bool):
        raise UserError(f"cslt must be None (the device decides), True or False, not {cslt!r}")


def cslt_by_default(device: torch.device) -> bool:
    """Whether ``load`` holds 2:4 layers in cuSPARSELt's buffer unasked: on a Hopper GPU (compute
    capability 9.0: the layout was learned there, ``deploy/cslt_layout.py``) whose PyTorch has
    cuSPARSELt. There an H100 prefilled a LLaMA-2-7B shape in 0.83–0.98× dense's time instead of
    1.37×, and decoded 1.58× dense instead of 1.61× (``scripts/results/bench_e2e.json``)."""
    return (device.type == "cuda" and torch.backends.cusparselt.is_available()
            and torch.cuda.get_device_capability(device) == (9, 0))


def arrange_for_serving(model: nn.Module, maps: str = "producer", fuse: bool = True,
                        cslt: bool | None = None) -> dict[str, Any]:
    """Lay ``model``'s sparse layers out for serving, in place: ``maps="producer"`` moves shared index
    maps to the modules producing those layers' input (an RMSNorm then writes its output permuted);
    ``cslt`` holds each 2:4 16-bit layer as one cuSPARSELt buffer (None: :func:`cslt_by_default` on
    the model's device); ``fuse`` stacks the layers that read one input (q/k/v, gate/up). Returns
    what changed: ``maps_moved`` ({producer: layers}), ``cslt_layers``, ``stacked_groups``."""
    check_serving_options(maps, fuse, cslt)
    probe = lazy_block_probe(model)   # one probe for both rewrites, built only if one needs it
    done: dict[str, Any] = {"maps_moved": {}, "cslt_layers": [], "stacked_groups": []}
    if maps == "producer":
        from shuffleprune.deploy.producer_maps import move_maps_to_producers

        done["maps_moved"] = move_maps_to_producers(model, probe=probe)
    if cslt if cslt is not None else cslt_by_default(next(model.parameters()).device):
        from shuffleprune.deploy.sparse_linear import use_cslt_layout

        done["cslt_layers"] = use_cslt_layout(model)
    if fuse:
        from shuffleprune.deploy.fused_inputs import fuse_shared_inputs

        done["stacked_groups"] = fuse_shared_inputs(model, probe=probe)
    return done


def warm_up(model: nn.Module, max_tokens: int = 2048) -> list[int]:
    """Run ``model`` once at each token-count bucket up to ``max_tokens`` (1, 2, 4, … and ``max_tokens``
    itself; batch 1, no gradients; token ids spread over the vocabulary, so that an MoE model routes them
    to many experts as text does, not all to the experts one repeated token picks), so that what ``auto`` measures at a bucket's
    first call (each kind of sparse layer's implementation, cuSPARSELt's configuration, the gathers,
    the experts' mode) and Triton's compiles happen now rather than in a user's first requests of each
    length; on CUDA the answers also go to :mod:`.choice_store` for later processes. Returns the token
    counts run. On the CPU nothing is measured (the scratch path runs), so it only runs the model."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise UserError(f"max_tokens must be a positive whole number of tokens, not {max_tokens!r}")
    counts = [1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens] + [max_tokens]
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    with torch.no_grad():
        for tokens in counts:   # a fixed stride through the vocabulary: the same ids at every call
            ids = (torch.arange(tokens, device=device) * 7919 + 1) % vocab
            model(input_ids=ids.unsqueeze(0))
    return counts
