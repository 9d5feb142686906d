"""Linear layers whose weights are concatenated: Q/K/V (or gate/up) as one matmul, which is what pays on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The fused bias; a part without bias contributes zeros, and no part with one means no bias at all."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears]).detach()


@dataclass
class FusedLinear:
    weight: torch.Tensor  # [sum of out_features, in_features]
    bias: torch.Tensor | None

    @classmethod
    def of(cls, *linears: torch.nn.Linear) -> "FusedLinear":
        """One linear over the same input as `linears`; its output is theirs concatenated, in order."""
        if len(linears) == 1:  # nothing to fuse: share the model's tensor instead of copying it
            weight = linears[0].weight.detach()
        else:
            weight = torch.cat([lin.weight for lin in linears]).detach().contiguous()
        return cls(weight, _cat_bias(*linears))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
