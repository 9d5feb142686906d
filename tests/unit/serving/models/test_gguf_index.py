"""The engine's GGUF index reads what gguf-py's reader reads (names, types, shapes, the very bytes)
for every type the kernels run, on the bundled file and on seeded files written the llama.cpp way;
a truncated file is refused; a packed engine drops the file's pages once built, and the Scheduler's
load never builds the tokenizer it does not use."""

from __future__ import annotations

import itertools
import re

import gguf
import numpy as np
import pytest

from serving.args import ServerArgs
from serving.engine.loader import load_model
from serving.engine.model_runner import ModelRunner
from serving.model_files import bundled_gguf_path
from serving.models.gguf_index import GGUFIndex
from serving.models.layers import native_quant
from tests.family_models import CUT_VOCAB, build
from tests.gguf_writer import write_gguf

Q = gguf.GGMLQuantizationType
TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K, Q.F16)


def _mixed():
    """Each tensor the next 32-value type, so one file holds them all (K-types where the row allows)."""
    turn = itertools.count()

    def pick(name: str, shape: tuple[int, ...]):
        if "token_embd" in name:
            return Q.F16
        if "ffn_down" in name:
            return Q.Q6_K if ".0." in name else Q.Q4_K
        return TYPES[next(turn) % 5]

    return pick


def assert_same(path) -> set[str]:
    reader, index = gguf.GGUFReader(path), GGUFIndex(path)
    assert index.fields["general.architecture"] == str(reader.fields["general.architecture"].contents())
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and list(ours.shape) == list(theirs.shape), ours.name
        assert ours.data.shape == theirs.data.shape and ours.data.dtype == theirs.data.dtype, ours.name
        assert np.array_equal(np.asarray(ours.data), np.asarray(theirs.data)), ours.name
    return {t.tensor_type.name for t in index.tensors}


def test_index_equals_gguf_py_on_the_bundled_file():
    assert assert_same(bundled_gguf_path()) >= {"Q4_1", "Q8_0", "F32"}


def test_index_equals_gguf_py_on_every_kernel_type(tmp_path):
    """A seeded model's file with a small vocabulary: every tensor type, and a tokenizer to skip."""
    path = write_gguf(build("llama", vocab=CUT_VOCAB), tmp_path / "mixed.gguf", qtype=_mixed())
    assert assert_same(path) >= {"Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "F16", "F32"}


def test_a_truncated_file_is_refused(tmp_path):
    full = bundled_gguf_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[: len(full) // 2])
    with pytest.raises(ValueError):
        GGUFIndex(cut)


def _mapped_rss_kib(path) -> int:
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not native_quant.load().interleaves, reason="needs the interleaved quantized kernel")
def test_packed_engine_drops_the_files_pages_and_scheduler_load_skips_the_tokenizer():
    model = load_model("smollm2-135m")
    assert model._tokenizer is None  # what the Scheduler loads: config and weights only
    assert model.eos_token_id() == 2 and model._tokenizer is None  # read from the tokenizer's files
    runner = ModelRunner(model, ServerArgs(model=model.name, quantization="gguf", max_total_tokens=256))
    size_kib = bundled_gguf_path().stat().st_size // 1024
    # every layer and the lm_head are interleaved copies: the mapped file stays only for embedding lookups
    assert _mapped_rss_kib(bundled_gguf_path()) < size_kib // 10
    assert runner.model is not None
    assert model.tokenizer.eos_token_id == 2  # still there for who asks
