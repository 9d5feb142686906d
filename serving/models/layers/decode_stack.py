"""Every layer of a decode-only step in one native call (kernels/decode_stack.cpp).

At one decode stream the layer-by-layer forward spends as long in Python between kernels
(ctypes conversion, tensor allocation: ~12 calls a layer) as in the kernels; this runs the same
kernels, in the same order on the same buffers, from C++, so its output is bit for bit the
layer-by-layer forward's (tests/unit/serving/models/test_decode_stack.py).  It applies when
every linear layer is on a native kernel (float32 panels or quantized), the norms, RoPE and
decode attention are native, and the KV cache is float32; `DecodeStack.build` says None
otherwise and the model keeps its Python forward.  The model asks it only for steps whose
every token decodes (`runs`).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Sequence

import torch

from serving.models.layers.decode_attention import NativeDecode
from serving.models.layers.forward_batch import ForwardBatch
from serving.models.layers.kv_cache import KVCache
from serving.models.layers.linear import FusedLinear

if TYPE_CHECKING:
    from serving.models.layers.rope import RotaryTables

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Lin(ctypes.Structure):
    _fields_ = [
        ("packed", _PTR),
        ("bias", _PTR),
        ("types", _PTR),
        ("ptrs", _PTR),
        ("rows", _PTR),
        ("nparts", _I64),
        ("n", _I64),
        ("k", _I64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _PTR),
        ("mlp_norm", _PTR),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
        ("k_pool", _PTR),
        ("v_pool", _PTR),
        ("qkv", _Lin),
        ("o", _Lin),
        ("gate_up", _Lin),
        ("down", _Lin),
    ]


class _Stack(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)),
        ("num_layers", _I64),
        ("hidden", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("eps", ctypes.c_float),
    ]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _lin(lin: FusedLinear) -> _Lin | None:
    """The kernel's view of a linear layer, or None when it is not on a native kernel."""
    if lin.quant is not None:
        q, parts = lin.quant, lin.quant._parts
        return _Lin(
            0,
            _ptr(q.bias),
            ctypes.addressof(parts.types),
            ctypes.addressof(parts.ptrs),
            ctypes.addressof(parts.rows),
            parts.count,
            parts.n,
            q.in_features,
        )
    if lin.kernel is not None and lin.packed is not None:
        return _Lin(lin.packed.data_ptr(), _ptr(lin.packed_bias), 0, 0, 0, 0, lin.out_features, lin.packed.shape[1])
    return None


class DecodeStack:
    """The layers' weights as the kernel reads them; K/V pools are bound on the first call with them.

    `layers` are the Llama-shaped decoder's (`serving.models.llama.LlamaLayer`: attn_norm, attn, mlp_norm,
    mlp), taken by shape so that this module does not import the model it serves."""

    def __init__(self, lib: ctypes.CDLL, layers: Sequence[Any], rows: list[_Layer], hidden: int, eps: float) -> None:
        self._fn = lib.decode_stack_f32
        self._fn.argtypes = [_PTR, _PTR, _I64] + [_PTR] * 6 + [_I64, _I64, ctypes.c_float]
        self._fn.restype = None
        self._layers, self._rows = layers, (_Layer * len(rows))(*rows)
        a = layers[0].attn
        self._stack = _Stack(self._rows, len(rows), hidden, a.num_heads, a.num_kv_heads, a.head_dim, eps)
        self._scale = a.head_dim**-0.5
        self._pools: int | None = None  # data_ptr of the K pool bound into `_rows`

    @classmethod
    def build(
        cls, lib: ctypes.CDLL, layers: Sequence[Any], rotary: "RotaryTables", hidden: int
    ) -> "DecodeStack | None":
        """The stack, or None where a layer has a part the kernel does not run."""
        if rotary.cos.dtype != torch.float32 or not (rotary.cos.is_contiguous() and rotary.sin.is_contiguous()):
            return None
        rows = []
        for layer in layers:
            a, m = layer.attn, layer.mlp
            kernel = layer.attn_norm.kernel
            lins = [_lin(x) for x in (a.qkv, a.o, m.gate_up, m.down)]
            if (
                kernel is None
                or a.rope_kernel is None
                or any(x is None for x in lins)
                or layer.attn_norm.weight.dtype != torch.float32
            ):
                return None
            rows.append(
                _Layer(
                    layer.attn_norm.weight.data_ptr(),
                    layer.mlp_norm.weight.data_ptr(),
                    _ptr(a.q_norm.weight if a.q_norm else None),
                    _ptr(a.k_norm.weight if a.k_norm else None),
                    0,
                    0,
                    *lins,
                )
            )
        eps = {x.eps for layer in layers for x in (layer.attn_norm, layer.mlp_norm)}
        if not rows or len(eps) != 1:
            return None
        return cls(lib, layers, rows, hidden, eps.pop())

    def runs(self, fb: ForwardBatch, kv: KVCache) -> bool:
        """Whether this step is one the kernel computes: decode tokens only, float32 K/V, native attention."""
        return (
            fb.num_decode == fb.num_tokens > 0
            and not fb.extends
            and fb.hidden_rows is None
            and isinstance(fb.decode_attention, NativeDecode)
            and kv.k[0].dtype == torch.float32
        )

    def __call__(self, h: torch.Tensor, rotary: "RotaryTables", kv: KVCache, fb: ForwardBatch) -> torch.Tensor:
        """h [B, hidden] (the embeddings) → the last layer's residual stream, in place."""
        if self._pools != kv.k[0].data_ptr():
            for row, k, v in zip(self._rows, kv.k, kv.v):
                assert k.is_contiguous() and v.is_contiguous()
                row.k_pool, row.v_pool = k.data_ptr(), v.data_ptr()
            self._pools = kv.k[0].data_ptr()
        idx, lens = fb.decode_kv_idx, fb.decode_lens
        assert idx is not None and lens is not None and idx.is_contiguous()
        h = h.contiguous()
        positions, slots = fb.positions.contiguous(), fb.out_slots.contiguous()
        self._fn(
            ctypes.addressof(self._stack),
            h.data_ptr(),
            h.shape[0],
            rotary.cos.data_ptr(),
            rotary.sin.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            idx.data_ptr(),
            lens.data_ptr(),
            idx.shape[1],
            fb.decode_requests,
            self._scale,
        )
        return h
