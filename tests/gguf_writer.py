"""Write an F32 GGUF file of a small HF model directory, laid out as llama.cpp's
convert_hf_to_gguf.py lays it out, so the GGUF import path can be tested against the HF
model it came from without network access or llama.cpp.

What a real converter does and transformers' GGUF reader must undo or honour is done here
too: Llama-arch Q/K rows are permuted into llama.cpp's rotary layout, Mistral is written as
arch `llama` (with "mistral" in `general.name`), a tied embedding gets no `output.weight`,
Llama-3 RoPE scaling becomes the `rope_freqs.weight` tensor of per-frequency factors, and
linear/yarn scaling the `{arch}.rope.scaling.*` keys.  The tokenizer is copied key by key
from the bundled SmolLM2 GGUF, which every test model shares (cut to the model's vocabulary
where `tests.family_models` cut it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

ARCH_OF_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def permute_qk(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: interleave each head's two rotary halves."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(
    theta: float,
    head_dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> np.ndarray:
    """The `rope_freqs.weight` values llama.cpp writes for `rope_type: llama3` (float32 maths, as there)."""
    import torch

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


@contextlib.contextmanager
def parsed_once(path: Path) -> Iterator[None]:
    """For transformers' own load of a GGUF file: the file parsed once (`serving.model_files._one_parse`;
    transformers parses it anew for its config and for its weights), and gguf-py's tensor-name map built
    once an architecture (transformers builds it anew for every module: ~400 for SmolLM2, ~40 ms each).
    The map is read-only where transformers uses it."""
    import gguf

    from serving.model_files import _one_parse

    real = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(real)
    try:
        with _one_parse(Path(path)):
            yield
    finally:
        gguf.get_tensor_name_map = real


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@functools.cache
def _tokenizer_fields() -> tuple:
    """`(key, value, type, sub_type)` of every `tokenizer.*` field of the bundled file, each value as
    gguf-py's `ReaderField.contents()` gives it, read straight from the header (gguf-py's reader makes
    numpy views of each of the ~100k vocabulary and merge strings: ~8 s)."""
    import mmap
    import struct

    import gguf

    from serving.model_files import bundled_gguf_path

    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype != gguf.GGUFValueType.STRING:
            return take(_SCALARS[vtype])[0]
        (n,) = take("Q")
        pos += n
        return str(buf[pos - n : pos], "utf-8")

    out = []
    with open(bundled_gguf_path(), "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _magic, _version, _n_tensors, n_kv = take("IIQQ")
        for _ in range(n_kv):
            key = value(gguf.GGUFValueType.STRING)
            vtype, sub_type = gguf.GGUFValueType(take("I")[0]), None
            if vtype == gguf.GGUFValueType.ARRAY:
                sub_type, (n,) = gguf.GGUFValueType(take("I")[0]), take("Q")
                contents = [value(sub_type) for _ in range(n)]
            else:
                contents = value(vtype)
            if key.startswith("tokenizer."):
                out.append((key, contents, vtype, sub_type))
    return tuple(out)


def _cut_tokenizer(fields: tuple, n: int) -> tuple:
    """The tokenizer fields cut to token ids below `n`, with the merges among the kept tokens
    (what `tests.family_models.cut_vocab` does to the HF tokenizer)."""
    tokens = next(value for key, value, *_ in fields if key == "tokenizer.ggml.tokens")
    if n >= len(tokens):
        return fields
    kept = set(tokens[:n])
    out = []
    for key, value, vtype, sub_type in fields:
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value[:n]
        elif key == "tokenizer.ggml.merges":
            pairs = (m.split(" ") for m in value)
            value = [f"{a} {b}" for a, b in pairs if a in kept and b in kept and a + b in kept]
        out.append((key, value, vtype, sub_type))
    return tuple(out)


def _quantized(data: np.ndarray, kind) -> np.ndarray:
    import gguf
    import torch

    from serving.models.layers.quantize import AT_LOAD, quantize

    if kind == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    name = next((n for n, t in AT_LOAD.items() if t == kind), None)
    if name is None:
        raise ValueError(f"no quantizer for {kind.name}")
    return quantize(torch.from_numpy(data), name).data.numpy()


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("full_attention", params)


def write_gguf(
    hf_dir: Path,
    out: Path,
    *,
    name: str | None = None,
    tokenizer: bool = True,
    sliding_window: bool = True,
    rope_freqs: np.ndarray | None = None,
    extra_kv: dict | None = None,
    qtype: Callable[[str, tuple[int, ...]], Any] | None = None,
) -> Path:
    """`hf_dir` (a llama, mistral, qwen2 or qwen3 HF directory) as an F32 GGUF file at `out`.

    `name` replaces `general.name`.  For files no converter would write: `tokenizer=False` leaves
    the tokenizer out (such a file is read in a fraction of the time: enough for what comes before
    the tokenizer is needed), `sliding_window=False` leaves out Mistral's window key,
    `rope_freqs` replaces or adds the factor tensor, `extra_kv` adds keys (`{arch}` expanded).
    `qtype(gguf_name, shape)` gives a 2-D weight's ggml type (None: F32), quantized as llama.cpp's
    quantizer would (gguf-py's, or `serving.models.layers.quantize` for the K-quants).
    """
    import gguf
    from safetensors import safe_open
    from transformers import AutoConfig

    hf_dir, out = Path(hf_dir), Path(out)
    config = AutoConfig.from_pretrained(hf_dir)
    model_type = config.model_type
    if model_type not in ARCH_OF_MODEL_TYPE:
        raise ValueError(f"no GGUF layout for model_type {model_type!r}")
    arch = ARCH_OF_MODEL_TYPE[model_type]
    n_layers = config.num_hidden_layers
    n_head, n_head_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    rope = _rope_parameters(config)
    rope_type = rope.get("rope_type", "default")

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch)
    # llama.cpp's Mistral is arch `llama`; transformers' reader takes it for a Mistral only when
    # general.name is exactly "mistral" (real files say e.g. "Mistral 7B Instruct v0.3")
    writer.add_name(name or ("mistral" if model_type == "mistral" else hf_dir.name))
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(n_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if json.loads((hf_dir / "config.json").read_text()).get("head_dim") is not None:  # as llama.cpp: only if stated
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(rope[key])
    elif rope_type not in ("default", "llama3"):
        raise ValueError(f"no GGUF layout for rope_type {rope_type!r}")
    if model_type == "mistral" and sliding_window and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    for key, value in (extra_kv or {}).items():
        writer.add_key_value(key.format(arch=arch), value, gguf.GGUFValueType.get_type(value))
    if tokenizer:
        for key, value, vtype, sub_type in _cut_tokenizer(_tokenizer_fields(), config.vocab_size):
            writer.add_key_value(key, value, vtype, sub_type=sub_type)

    if rope_type == "llama3" and rope_freqs is None:
        rope_freqs = llama3_rope_factors(
            float(rope["rope_theta"]),
            head_dim,
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
    if rope_freqs is not None:  # llama.cpp writes the generated tensors first
        writer.add_tensor(
            gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", np.asarray(rope_freqs, dtype=np.float32)
        )

    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with safe_open(hf_dir / "model.safetensors", framework="np") as st:
        for hf_name in st.keys():
            if hf_name == "lm_head.weight" and tied:
                continue
            data = st.get_tensor(hf_name).astype(np.float32)
            if arch == "llama":
                if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                    data = permute_qk(data, n_head, n_head)
                elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                    data = permute_qk(data, n_head, n_head_kv)
            gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise ValueError(f"cannot map tensor {hf_name!r} to a GGUF name")
            kind = qtype(gguf_name, data.shape) if qtype is not None and data.ndim == 2 else None
            if kind is None:
                writer.add_tensor(gguf_name, np.ascontiguousarray(data))
            else:
                writer.add_tensor(gguf_name, _quantized(data, kind), raw_dtype=kind)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
