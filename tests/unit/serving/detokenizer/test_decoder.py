"""The Detokenizer's tokenizer: `tokenizers` alone when tokenizer.json says which tokens are special,
decoding exactly as transformers' fast tokenizer does; transformers' tokenizer otherwise."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from serving.model_files import Decoder, ModelLoadError, load_decoder, load_tokenizer, prepare_model_dir


@pytest.fixture(scope="module")
def pair():
    return load_decoder("tiny-random"), load_tokenizer("tiny-random")[0]


def test_decodes_as_transformers_does_with_and_without_special_tokens(pair):
    decoder, tokenizer = pair
    assert isinstance(decoder, Decoder)
    rng = random.Random(7)
    specials = sorted(tokenizer.all_special_ids)
    assert specials  # the check below must see special tokens skipped and kept
    for _ in range(400):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 24))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            want = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert decoder.decode(ids, skip_special_tokens=skip) == want
    with pytest.raises(ValueError):
        decoder.decode([1], clean_up_tokenization_spaces=True)


def test_a_special_token_only_the_config_names_falls_back_to_transformers(tmp_path):
    src, _ = prepare_model_dir("tiny-random")
    model = tmp_path / "model"
    shutil.copytree(src, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok = json.loads((model / "tokenizer.json").read_text())
    flagged = next(t for t in tok["added_tokens"] if t["content"] == cfg["eos_token"])
    flagged["special"] = False  # tokenizer.json alone would no longer skip the configured EOS
    (model / "tokenizer.json").write_text(json.dumps(tok))
    assert not isinstance(load_decoder(str(model)), Decoder)
    (model / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="cannot load tokenizer"):  # transformers was asked, and says why
        load_decoder(str(model))


def test_the_detokenizer_never_imports_transformers():
    code = (
        "import sys; import serving.detokenizer.manager; from serving.model_files import load_decoder; "
        "load_decoder('tiny-random'); print('transformers' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
