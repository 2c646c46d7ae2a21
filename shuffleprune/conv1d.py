"""GPT-2-style ``Conv1D`` layers held as ``nn.Linear``, their checkpoints kept in ``Conv1D``'s layout.

transformers' ``Conv1D`` (GPT-2, OpenAI GPT, ImageGPT, …) computes ``x W + b`` with ``W`` stored
``[in, out]``. :func:`linears_from_conv1d` swaps each for a :class:`Conv1DAsLinear`, an ``nn.Linear``
(``[out, in]``, the same function) whose state dict stores the weight transposed, as ``Conv1D``
does: every stage, kernel and export that acts on linears acts on these layers, and what is saved
loads into the model's own ``Conv1D`` layers with plain transformers.
"""
from __future__ import annotations

from torch import nn

try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    Conv1D = ()


def _weight_to_conv1d_layout(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].t().contiguous()


def _weight_from_conv1d_layout(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].t()


class Conv1DAsLinear(nn.Linear):
    """An ``nn.Linear`` standing in for a ``Conv1D``: weight ``[out, in]`` in memory, ``[in, out]`` in
    its state dict (saving and loading)."""

    stores_transposed = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.register_state_dict_post_hook(_weight_to_conv1d_layout)
        self.register_load_state_dict_pre_hook(_weight_from_conv1d_layout)

    @classmethod
    def from_conv1d(cls, conv: nn.Module) -> "Conv1DAsLinear":
        w = conv.weight.data
        linear = cls(w.shape[0], w.shape[1], bias=conv.bias is not None, device=w.device, dtype=w.dtype)
        linear.weight.data = w.t().contiguous()
        if conv.bias is not None:
            linear.bias.data = conv.bias.data
        return linear


def plain_linear_like(module: nn.Module, in_features: int, out_features: int, bias: bool,
                      device=None, dtype=None) -> nn.Linear:
    """A new ``nn.Linear`` of that shape, a :class:`Conv1DAsLinear` where ``module`` stands for a
    ``Conv1D`` (so a rebuilt layer still saves in its checkpoint's layout)."""
    cls = Conv1DAsLinear if getattr(module, "stores_transposed", False) else nn.Linear
    return cls(in_features, out_features, bias=bias, device=device, dtype=dtype)


def linears_from_conv1d(model: nn.Module) -> list[str]:
    """Replace every ``Conv1D`` of ``model`` by a :class:`Conv1DAsLinear` in place; their names."""
    if not Conv1D:
        return []
    names = [name for name, m in model.named_modules() if isinstance(m, Conv1D)]
    for name in names:
        model.set_submodule(name, Conv1DAsLinear.from_conv1d(model.get_submodule(name)))
    return names
