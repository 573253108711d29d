"""Linear projections as objects built once at load: `lin = make_linear(w, b, quantization); y = lin(x)`.

Models call these instead of `F.linear` on raw weights, so the weight can be held in whatever form is
fastest on the device (packed, quantized) without the models knowing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """y = x @ weight.T + bias, weight [out, in] in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str | None = None) -> Linear:
    """The fastest Linear for this weight on its device; quantization None keeps the weight's dtype."""
    if quantization is not None:
        raise ValueError(f"quantization {quantization!r} is not supported")
    return Linear(weight, bias)
