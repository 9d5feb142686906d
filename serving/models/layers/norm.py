"""RMSNorm, in transformers' op order so fp32 results agree with it bit-closely."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm: reordering changes the last bits.  A bf16
    # input is normalised in fp32 and cast back before the weight, as transformers does.
    if x.dtype != torch.float32:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


@dataclass
class RMSNorm:
    """A norm's weight with its epsilon, so a family's forward does not carry eps around."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
