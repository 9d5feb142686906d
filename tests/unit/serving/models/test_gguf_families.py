"""GGUF files of every registered family, written as llama.cpp's converter writes them
(tests/gguf_writer.py), converted by `prepare_model_dir`: the converted model gives the HF
model's logits (F32 is lossless) and keeps what transformers' GGUF reader drops -- Llama-3
RoPE scaling, Mistral's window, Qwen3's head_dim -- and its tokenizer is the HF one.  Files
whose RoPE transformers cannot reproduce, and cut-off files, are refused in one line.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from serving.gguf_rope import fit_llama3, fix_config, transformers_inv_freq, weights_config
from serving.model_files import ModelLoadError, load_tokenizer, prepare_model_dir
from tests.family_models import FAMILIES, SLIDING_WINDOW, build
from tests.family_models import gguf as gguf_of
from tests.gguf_writer import llama3_rope_factors, write_gguf
from tests.helpers import one_thread

TEXT = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the hill; "
    "in 1969 the first humans walked on the Moon and millions of people watched it live on television "
    "at home."
)
N_TOKENS = 40  # longer than Mistral's shrunk window


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request):
    """Converted into the default cache (by `make setup`, else here), where the HTTP tests' servers find it."""
    family = request.param
    out, _ = prepare_model_dir(str(gguf_of(family)))
    assert json.loads((out / "sightline.json").read_text())["source"] == str(gguf_of(family))
    return family, build(family), out


def test_a_fresh_conversion_writes_what_the_cache_holds(tmp_path):
    """The conversion itself, into an empty cache: the same weights and config as the shared one."""
    from safetensors.torch import load_file

    cached, _ = prepare_model_dir(str(gguf_of("qwen3")))
    fresh, converted_now = prepare_model_dir(str(gguf_of("qwen3")), cache_dir=tmp_path)
    assert converted_now and fresh != cached
    a, b = load_file(fresh / "model.safetensors"), load_file(cached / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((fresh / "config.json").read_text()) == json.loads((cached / "config.json").read_text())
    assert prepare_model_dir(str(gguf_of("qwen3")), cache_dir=tmp_path) == (fresh, False)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_converted_gguf_gives_the_hf_models_logits(converted):
    from transformers import AutoTokenizer

    family, src, out = converted
    ids = AutoTokenizer.from_pretrained(src)(TEXT)["input_ids"][:N_TOKENS]
    assert len(ids) == N_TOKENS
    ours, theirs = _load(out), _load(src)
    with torch.inference_mode(), one_thread():
        x = torch.tensor([ids])
        torch.testing.assert_close(ours(x).logits, theirs(x).logits, atol=1e-5, rtol=0)

    cfg, ref = ours.config, theirs.config
    assert type(cfg) is type(ref)
    assert cfg.tie_word_embeddings == (family != "mistral")
    assert getattr(cfg, "sliding_window", None) == SLIDING_WINDOW.get(family)
    if family == "llama":
        assert cfg.rope_parameters == ref.rope_parameters  # the real Llama-3.2 values, recovered exactly
        assert cfg.rope_parameters["rope_type"] == "llama3"
    if family == "qwen2":
        assert ours.model.layers[0].self_attn.q_proj.bias is not None
        torch.testing.assert_close(
            ours.model.layers[0].self_attn.k_proj.bias, theirs.model.layers[0].self_attn.k_proj.bias, atol=0, rtol=0
        )
    if family == "qwen3":
        assert cfg.head_dim == ref.head_dim == 48
        torch.testing.assert_close(
            ours.model.layers[1].self_attn.q_norm.weight, theirs.model.layers[1].self_attn.q_norm.weight, atol=0, rtol=0
        )
    saved = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in saved and saved["model_type"] == ref.model_type


@pytest.mark.parametrize("loader", ["auto", "served"])
def test_converted_tokenizer_is_the_hf_one(converted, loader):
    from transformers import AutoTokenizer

    _, src, out = converted
    load = AutoTokenizer.from_pretrained if loader == "auto" else lambda p: load_tokenizer(str(p))[0]
    ours, theirs = load(out), load(src)
    for text in (TEXT, "def add(a, b):\n    return a + b\n", "  spaces,\ttabs and ünïcödé 🚀 12345"):
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.chat_template and ours.chat_template == theirs.chat_template
    chat = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


# -- refusals: one line, nothing cached ----------------------------------------------------------
def _refused(gguf, cache_dir, match):
    with pytest.raises(ModelLoadError, match=match) as err:
        prepare_model_dir(str(gguf), cache_dir=cache_dir)
    assert "\n" not in str(err.value)
    assert not list((cache_dir / "models").glob(f"{gguf.stem}-*"))
    return str(err.value)


@pytest.mark.parametrize("shape", ["shuffled", "rising"])
def test_rope_freqs_no_llama3_scaling_gives_are_refused(tmp_path, shape):
    rng = np.random.default_rng(7)
    factors = rng.uniform(1.0, 32.0, size=32)  # head_dim 64
    if shape == "rising":
        factors = np.sort(factors)
    gguf = write_gguf(build("llama"), tmp_path / f"{shape}.gguf", tokenizer=False, rope_freqs=factors)
    _refused(gguf, tmp_path / "c", "GGUF rope_freqs factors do not match any llama3 RoPE scaling: ")


def test_unknown_rope_scaling_type_is_refused(tmp_path):
    gguf = write_gguf(
        build("mistral"),
        tmp_path / "bogus.gguf",
        tokenizer=False,
        extra_kv={"{arch}.rope.scaling.type": "bogus", "{arch}.rope.scaling.factor": 2.0},
    )
    msg = _refused(gguf, tmp_path / "c", "GGUF RoPE scaling type 'bogus'")
    assert "llama.rope.scaling.type" in msg


def test_truncated_gguf_is_refused(tmp_path):
    import gguf as gguf_py

    full = write_gguf(build("llama"), tmp_path / "full.gguf", tokenizer=False)
    reader = gguf_py.GGUFReader(full)
    data_start = min(t.data_offset for t in reader.tensors)
    cut = (data_start + full.stat().st_size) // 2
    del reader
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(full.read_bytes()[:cut])
    _refused(truncated, tmp_path / "c", f"cannot read GGUF file {truncated}")


# -- the RoPE scaling keys and the Llama-3 fit on their own ---------------------------------------
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
    ],
)
def test_rope_scaling_keys_reach_the_config(tmp_path, rope):
    from transformers import AutoConfig

    src = tmp_path / "hf"
    shutil.copytree(build("mistral"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {**rope, "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (src / "config.json").write_text(json.dumps(cfg))
    gguf = write_gguf(src, tmp_path / "scaled.gguf", tokenizer=False)
    ours = fix_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
    ref = AutoConfig.from_pretrained(src)
    assert {k: ours.rope_parameters[k] for k in rope} == rope
    np.testing.assert_array_equal(transformers_inv_freq(ours), transformers_inv_freq(ref))


@pytest.mark.parametrize(
    "name,window_key,want",
    [
        ("mistral", False, ("mistral", None)),  # not MistralConfig's default 4096: llama.cpp attends to everything
        ("Mistral 7B Instruct v0.3", True, ("mistral", 16)),  # transformers reads this name as a Llama
        ("Mistral 7B Instruct v0.3", False, ("llama", None)),  # a Llama is full attention already
    ],
)
def test_mistral_window_is_what_the_file_says(tmp_path, caplog, name, window_key, want):
    from transformers import AutoConfig

    gguf = write_gguf(build("mistral"), tmp_path / "m.gguf", name=name, tokenizer=False, sliding_window=window_key)
    with caplog.at_level("INFO", logger="serving.gguf_rope"):
        cfg = fix_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
    assert (cfg.model_type, getattr(cfg, "sliding_window", None)) == want
    assert "GGUF Mistral" in caplog.text
    assert weights_config(cfg).model_type == "llama"  # gguf-py names no plain `mistral` architecture


LLAMA3_CASES = [  # theta, head_dim, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama-3.1 8B/70B/405B
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama-3.2 1B
    (500000.0, 128, 32.0, 1.0, 4.0, 8192),  # Llama-3.2 3B
    (10000.0, 64, 4.0, 2.0, 8.0, 4096),
    (1000000.0, 128, 16.0, 1.0, 32.0, 32768),
    (500000.0, 16, 8.0, 1.0, 4.0, 8192),  # one frequency inside the smoothing band
    (500000.0, 16, 8.0, 1.2, 1.8, 8192),  # none: a step from 1 to `factor`
]


def _llama_config(head_dim: int, rope_parameters: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_parameters),
    )


@pytest.mark.parametrize("theta,head_dim,factor,low,high,orig", LLAMA3_CASES)
def test_llama3_fit_reproduces_the_factors(theta, head_dim, factor, low, high, orig):
    true = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }
    factors = llama3_rope_factors(theta, head_dim, factor, low, high, orig)
    fit = fit_llama3(factors, theta, head_dim)
    assert fit["factor"] == pytest.approx(factor, rel=1e-6)
    want = transformers_inv_freq(_llama_config(head_dim, true))
    np.testing.assert_allclose(transformers_inv_freq(_llama_config(head_dim, fit)), want, rtol=1e-5, atol=0)
    base = transformers_inv_freq(_llama_config(head_dim, {"rope_type": "default", "rope_theta": theta}))
    np.testing.assert_allclose(want, base / factors, rtol=1e-6, atol=0)
    in_band = np.sum((factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6)))
    if in_band >= 2:  # the band's edges are fixed by the factors: the same wavelengths come back
        assert fit["original_max_position_embeddings"] / fit["low_freq_factor"] == pytest.approx(orig / low, rel=1e-4)
        assert fit["original_max_position_embeddings"] / fit["high_freq_factor"] == pytest.approx(orig / high, rel=1e-4)
    if orig == 8192 and (low, high) == (1.0, 4.0) and head_dim >= 64:
        assert (round(fit["low_freq_factor"], 4), round(fit["high_freq_factor"], 4)) == (1.0, 4.0)


def test_llama3_fit_of_unit_factors_is_plain_rope():
    assert fit_llama3(np.ones(32), 500000.0, 64) is None


@pytest.mark.parametrize(
    "factors,why",
    [
        (np.ones(16), "16 factors for a rotary dimension of 64"),
        (np.r_[np.ones(16), -np.ones(16)], "not all positive"),
        (np.r_[np.full(16, 8.0), np.ones(16)], "do not rise"),
    ],
)
def test_llama3_fit_refuses_factors_of_another_shape(factors, why):
    with pytest.raises(ModelLoadError, match=why):
        fit_llama3(factors, 500000.0, 64)
