"""Quantize fp32 weights at load (`--quantization q8_0|q4_0|q4_1|q5_0|q5_1|q4_k|q6_k`) into GGUF block layouts.

The 32-value types are gguf-py's quantizers (bit-exact with llama.cpp's reference ones).  gguf-py
has no K-quant quantizers, so `q4_k` and `q6_k` round to nearest here: per sub-block (32 values
for Q4_K, 16 for Q6_K) the scale (and Q4_K's offset) spanning its range, stored as 6-bit (Q6_K:
int8) multiples of the super-block's fp16 scale.  llama.cpp's own quantizers search for better
scales: its files are a little more accurate.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import torch

from serving.models.layers.native_quant import QuantWeight

log = logging.getLogger(__name__)
Q = gguf.GGMLQuantizationType
AT_LOAD = {
    "q8_0": Q.Q8_0,
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
    "q4_k": Q.Q4_K,
    "q6_k": Q.Q6_K,
}
# For a weight whose input size is no multiple of 256, as llama.cpp's quantizer falls back
FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}


def _q4_k(w: torch.Tensor) -> np.ndarray:
    """[N, K] fp32 (K a multiple of 256) → Q4_K blocks, uint8 [N, K / 256 * 144]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32).float()
    lo = x.amin(dim=-1).clamp(max=0.0)  # the offset is subtracted: keep it >= 0, as llama.cpp
    hi = x.amax(dim=-1)
    scale, offset = (hi - lo) / 15.0, -lo
    d = (scale.amax(dim=-1) / 63.0).half()  # fp16 super-block scale of the 6-bit sub-block scales
    dmin = (offset.amax(dim=-1) / 63.0).half()
    sc = torch.where(d[..., None] > 0, scale / d.float()[..., None].clamp(min=1e-30), 0).round().clamp(0, 63)
    mn = torch.where(dmin[..., None] > 0, offset / dmin.float()[..., None].clamp(min=1e-30), 0).round().clamp(0, 63)
    eff_scale, eff_off = d.float()[..., None] * sc, dmin.float()[..., None] * mn
    qv = torch.where(eff_scale[..., None] > 0, (x + eff_off[..., None]) / eff_scale[..., None].clamp(min=1e-30), 0)
    qv = qv.round().clamp(0, 15).to(torch.uint8)  # [n, sb, 8, 32]
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    packed = torch.empty(n, k // 256, 12, dtype=torch.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    pairs = qv.view(n, k // 256, 4, 2, 32)  # 64-value chunks: sub-block 2j in the low nibbles, 2j+1 high
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    blocks = torch.cat([d.view(torch.uint8).view(n, -1, 2), dmin.view(torch.uint8).view(n, -1, 2), packed, qs], dim=-1)
    return blocks.reshape(n, -1).numpy()


def _ratio(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, 0 where the scale is 0."""
    return torch.where(scale > 0, x / scale.clamp(min=1e-30), 0)


def _q6_k(w: torch.Tensor) -> np.ndarray:
    """[N, K] fp32 (K a multiple of 256) → Q6_K blocks, uint8 [N, K / 256 * 210]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16).float()
    sub = x.abs().amax(dim=-1) / 31.0  # per 16 values: |q| <= 31 before the scale is rounded
    d = (sub.amax(dim=-1) / 127.0).half()
    sc = _ratio(sub, d.float()[..., None]).round().clamp(0, 127)
    eff = (d.float()[..., None] * sc)[..., None]
    qv = (_ratio(x, eff).round().clamp(-32, 31) + 32).to(torch.uint8).view(n, k // 256, 2, 4, 32)  # [.., h, t, l]
    ql = torch.cat(
        [(qv[:, :, :, 0] & 15) | ((qv[:, :, :, 2] & 15) << 4), (qv[:, :, :, 1] & 15) | ((qv[:, :, :, 3] & 15) << 4)],
        dim=-1,
    )  # [n, sb, 2, 64]
    hi = qv >> 4
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    blocks = torch.cat(
        [
            ql.reshape(n, -1, 128),
            qh.reshape(n, -1, 64),
            sc.to(torch.int8).view(torch.uint8),
            d.view(torch.uint8).view(n, -1, 2),
        ],
        dim=-1,
    )
    return blocks.reshape(n, -1).numpy()


def quantize(weight: torch.Tensor, name: str) -> QuantWeight:
    """An [N, K] weight in the `--quantization` type `name`."""
    qtype = AT_LOAD[name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = weight.shape
    if k % block:
        raise ValueError(f"cannot quantize a weight with {k} inputs to {name}: blocks of {block}")
    w = weight.detach().float().contiguous()
    own = {Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
    data = own[qtype](w) if qtype in own else gguf.quants.quantize(w.numpy(), qtype)
    return QuantWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)).view(n, -1), k)


def quantize_for(weight: torch.Tensor, name: str) -> QuantWeight | None:
    """`quantize`, in the fallback type where the weight's input size does not fit `name`'s blocks;
    None (the caller keeps it unquantized) where it fits no 32-value block either.  Both logged."""
    n, k = weight.shape
    if k % gguf.GGML_QUANT_SIZES[AT_LOAD[name]][0] and name in FALLBACK:
        log.info(
            "a [%d, %d] weight in %s: its input size is no multiple of %s's 256-value blocks",
            n,
            k,
            FALLBACK[name],
            name,
        )
        name = FALLBACK[name]
    if k % gguf.GGML_QUANT_SIZES[AT_LOAD[name]][0]:
        log.info("a [%d, %d] weight stays unquantized: its input size is no multiple of 32", n, k)
        return None
    return quantize(weight, name)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The fp32 values of a quantized weight (gguf-py's reference dequantizer)."""
    return torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.qtype).copy()).view(w.rows, w.cols)
