"""Put back into a GGUF model's config what transformers' GGUF reader drops.

transformers rebuilds the config of a llama/mistral/qwen2/qwen3 GGUF from a fixed key map.
It ignores the `rope_freqs.weight` tensor (Llama-3.x RoPE scaling, stored as per-frequency
factors), the `{arch}.rope.scaling.*` keys (linear, yarn), `{arch}.attention.key_length`
(Qwen3's head_dim when it differs from hidden/heads) and `{arch}.attention.sliding_window`,
and gives a Mistral the 4096-token window of MistralConfig's default.  Each of these loads a
model that runs and answers wrongly, so here the file is read again with `gguf.GGUFReader`
and the config corrected -- or the load refused, in one line, when the file states something
transformers cannot reproduce.

Llama-3 scaling is stored only as its result, a factor per rotary frequency.  Those factors
are `factor` above the low-frequency boundary, 1 below the high-frequency one, and in
between `1 / ((1 - s) / factor + s)` with `s` linear in 1/wavelength; `fit_llama3` solves that
for the boundaries, and the fit is accepted only if transformers' own rotary embedding, built
from the corrected config, reproduces `base_inv_freq / rope_freqs`.
"""

from __future__ import annotations

import importlib
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from serving.model_errors import ModelLoadError

log = logging.getLogger(__name__)

ROPE_FREQS = "rope_freqs.weight"
# Llama-3's pretraining context, in every Llama-3.x release.  Only low/orig and high/orig are
# fixed by the factors, so the fit states the boundaries against this value.
LLAMA3_ORIGINAL_CONTEXT = 8192
# The Llama-3 releases' high_freq_factor / low_freq_factor, used when the factors leave the
# band's width free (fewer than two frequencies inside it).
LLAMA3_BAND_RATIO = 4.0
INV_FREQ_RTOL = 1e-5
_SAME = 1e-6  # relative: a factor this close to 1 or to the maximum is taken as equal to it


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _rope_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = getattr(config, "rope_parameters", None) or {}
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    """transformers' default inverse frequencies (float32, as its rotary embeddings compute them)."""
    import torch

    return (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).double().numpy()


# -- Llama-3 -----------------------------------------------------------------------------------
def fit_llama3(rope_freqs, theta: float, dim: int) -> dict | None:
    """Llama-3 `rope_parameters` whose factors are `rope_freqs` for this theta and rotary dim.

    None when every factor is 1 (no scaling).  Raises ModelLoadError when the factors have
    no Llama-3 shape (wrong count, not positive, not rising with wavelength); whether the
    result reproduces them is for `verify_inv_freq` to say.
    """
    r = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if r.size != dim // 2:
        raise _no_match(f"{r.size} factors for a rotary dimension of {dim} (needs {dim // 2})")
    if not np.all(np.isfinite(r)) or r.min() <= 0:
        raise _no_match("factors are not all positive and finite")
    factor = float(r.max())
    if factor - 1.0 <= _SAME:
        return None
    if np.any(np.diff(r) < -_SAME * factor) or r.min() < 1.0 - _SAME:
        raise _no_match("factors do not rise from 1 with the wavelength")
    u = _base_inv_freq(theta, dim) / (2 * math.pi)  # 1 / wavelength, falling along the head
    high = np.abs(r - 1.0) <= _SAME  # short wavelengths: unscaled
    low = np.abs(r - factor) <= _SAME * factor  # long wavelengths: divided by `factor`
    mid = ~(high | low)
    s = (1.0 / r[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)  # the smoothing weight, in (0, 1)
    # The band's edges may sit anywhere between its own frequencies and these neighbours
    # (`low` holds at least the maximum; `high` may be empty).
    u_low_max = float(u[low].max())
    u_high_min = float(u[high].min()) if high.any() else None

    if mid.sum() >= 2:
        slope, intercept = np.polyfit(u[mid], s, 1)
        if slope <= 0:
            raise _no_match("smoothed factors do not fall with the wavelength")
        u_l, u_h = -intercept / slope, (1.0 - intercept) / slope
    elif mid.sum() == 1:
        # One equation, u1 = u_l + s1 (u_h - u_l): the band width w is free.  Take Llama-3's
        # width ratio where the neighbouring unscaled/fully scaled frequencies allow it.
        u1, s1 = float(u[mid][0]), float(s[0])
        w = (LLAMA3_BAND_RATIO - 1.0) * u1 / (1.0 + (LLAMA3_BAND_RATIO - 1.0) * s1)
        w = min(w, (u1 - u_low_max) / s1)
        if u_high_min is not None:
            w = min(w, (u_high_min - u1) / (1.0 - s1))
        u_l, u_h = u1 - s1 * w, u1 + (1.0 - s1) * w
    elif u_high_min is not None:  # a step from 1 to `factor`: edges inside the gap, splitting it in three
        gap = u_high_min / u_low_max
        u_l, u_h = u_low_max * gap ** (1 / 3), u_low_max * gap ** (2 / 3)
    else:  # every frequency scaled by `factor`: both edges above the highest frequency
        u_l = 2.0 * float(u.max())
        u_h = LLAMA3_BAND_RATIO * u_l
    if not 0 < u_l < u_h:
        raise _no_match("no smoothing band fits the factors")
    orig = LLAMA3_ORIGINAL_CONTEXT
    return {
        "rope_type": "llama3",
        "rope_theta": float(theta),
        "factor": factor,
        "low_freq_factor": float(orig * u_l),
        "high_freq_factor": float(orig * u_h),
        "original_max_position_embeddings": orig,
    }


def _rounded(params: dict, digits: int) -> dict:
    out = dict(params)
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        out[key] = round(out[key], digits)
    return out


def _no_match(why: str) -> ModelLoadError:
    return ModelLoadError(f"GGUF rope_freqs factors do not match any llama3 RoPE scaling: {why}")


def transformers_inv_freq(config) -> np.ndarray:
    """The inverse frequencies transformers' own rotary embedding computes for this config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    rotary = None
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_cls is not None:
        module = importlib.import_module(model_cls.__module__)
        rotary = getattr(module, model_cls.__name__.replace("ForCausalLM", "RotaryEmbedding"), None)
    if rotary is not None:
        return rotary(config).inv_freq.double().numpy()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config)[0].double().numpy()


def verify_inv_freq(config, params: dict, want: np.ndarray) -> float:
    """Largest relative error of transformers' inv_freq under `params` against `want`."""
    trial = config.__class__.from_dict({**config.to_dict(), "rope_parameters": dict(params)})
    got = transformers_inv_freq(trial)
    if got.shape != want.shape:
        return math.inf
    return float(np.max(np.abs(got - want) / want))


def apply_llama3(config, rope_freqs: np.ndarray) -> None:
    params = getattr(config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta") or getattr(config, "rope_theta"))
    dim = _rope_dim(config)
    fit = fit_llama3(rope_freqs, theta, dim)
    if fit is None:
        log.info("GGUF rope_freqs are all 1: plain RoPE")
        return
    if "partial_rotary_factor" in params:
        fit["partial_rotary_factor"] = params["partial_rotary_factor"]
    want = _base_inv_freq(theta, dim) / np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    for candidate in (_rounded(fit, 4), _rounded(fit, 6), fit):  # the readable one when it is as good
        err = verify_inv_freq(config, candidate, want)
        if err <= INV_FREQ_RTOL:
            config.rope_parameters = candidate
            log.info("GGUF rope_freqs: llama3 RoPE scaling %s (inv_freq within %.1e)", candidate, err)
            return
    raise _no_match(f"best fit {fit} is off by {err:.1e} (relative) in inv_freq")


# -- rope.scaling.* keys ---------------------------------------------------------------------------
_YARN_KEYS = {  # GGUF key suffix -> transformers' rope_parameters key
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}
_NEUTRAL = {  # keys transformers has no equivalent for: accepted only where they change nothing
    "finetuned": lambda v: True,
    "yarn_ext_factor": lambda v: v < 0 or v == 1.0,  # negative: llama.cpp's "auto", 1 for yarn
    "yarn_attn_factor": lambda v: v == 1.0,
    "attn_factor": lambda v: v == 1.0,
    "yarn_log_multiplier": lambda v: v == 0.0,
}


def apply_scaling_keys(config, reader, arch: str) -> None:
    prefix = f"{arch}.rope.scaling."
    keys = {k[len(prefix) :]: _field(reader, k) for k in reader.fields if k.startswith(prefix)}
    kind = keys.pop("type", None)
    if kind is None:
        if keys:
            log.info("GGUF %s* keys without a type: ignored, as llama.cpp does", prefix)
        return
    kind = str(kind).lower()
    if kind == "none":
        return
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if kind in ("linear", "yarn") and "factor" not in keys:
        raise ModelLoadError(f"GGUF RoPE scaling {kind!r} has no {prefix}factor")
    if kind == "linear":
        new = {"rope_type": "linear", "rope_theta": theta, "factor": float(keys.pop("factor"))}
    elif kind == "yarn":
        new = {"rope_type": "yarn", "rope_theta": theta}
        for suffix, name in _YARN_KEYS.items():
            if suffix in keys:
                value = keys.pop(suffix)
                new[name] = int(value) if name == "original_max_position_embeddings" else float(value)
        new.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    else:
        raise ModelLoadError(f"GGUF RoPE scaling type {kind!r} ({prefix}type) is not supported")
    for suffix, value in keys.items():
        if suffix not in _NEUTRAL or not _NEUTRAL[suffix](value):
            raise ModelLoadError(f"GGUF {prefix}{suffix} = {value} is not supported with RoPE scaling {kind!r}")
    if "partial_rotary_factor" in params:
        new["partial_rotary_factor"] = params["partial_rotary_factor"]
    config.rope_parameters = new
    log.info("GGUF RoPE scaling from %stype: %s", prefix, new)


# -- Mistral's window, Qwen3's head_dim -----------------------------------------------------------
def is_mistral(arch: str, name: Any) -> bool:
    """llama.cpp writes Mistral as arch `llama`; only the model's name tells them apart."""
    return arch == "llama" and "mistral" in str(name or "").lower()


def _as_mistral(config, sliding_window):
    from transformers import MistralConfig

    d = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    return MistralConfig.from_dict({**d, "architectures": ["MistralForCausalLM"], "sliding_window": sliding_window})


def fix_config(config, gguf_path: Path):
    """`config` (as transformers read it from `gguf_path`) with what it dropped put back.

    Returns the config to use: the same object, or a MistralConfig where a Mistral file that
    transformers took for a Llama states a sliding window.
    """
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = str(_field(reader, "general.architecture"))
    name = _field(reader, "general.name")

    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None and getattr(config, "head_dim", None) != int(key_length):
        log.info(
            "GGUF %s.attention.key_length: head_dim %s (transformers read %s)",
            arch,
            key_length,
            getattr(config, "head_dim", None),
        )
        config.head_dim = int(key_length)

    window = _field(reader, f"{arch}.attention.sliding_window")
    if is_mistral(arch, name):
        window = int(window) if window else None
        if config.model_type == "mistral":
            config.sliding_window = window
        elif window is not None:
            config = _as_mistral(config, window)
        log.info(
            "GGUF Mistral (%r): %s",
            name,
            f"sliding window {window}" if window else "full attention (no sliding_window key, as llama.cpp)",
        )
    elif window and arch == "llama":
        log.info("GGUF %s.attention.sliding_window = %s ignored: a Llama file runs with full attention", arch, window)

    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    has_type = _field(reader, f"{arch}.rope.scaling.type") not in (None, "none")
    if freqs is not None and has_type:
        raise ModelLoadError(f"GGUF has both {ROPE_FREQS} and {arch}.rope.scaling.type: not supported together")
    if freqs is not None:
        apply_llama3(config, gguf.quants.dequantize(freqs.data, freqs.tensor_type))
    else:
        apply_scaling_keys(config, reader, arch)
    return config


def weights_config(config):
    """The config to load the GGUF weights under.

    transformers maps tensor names through gguf-py's architecture list, which has no plain
    `mistral`; a Mistral's tensors are a Llama's, so they load under the equivalent Llama config.
    """
    if config.model_type != "mistral":
        return config
    from transformers import LlamaConfig

    d = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "sliding_window")}
    return LlamaConfig.from_dict({**d, "architectures": ["LlamaForCausalLM"]})
