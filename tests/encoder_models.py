"""A small seeded BERT encoder built from all-MiniLM-L6-v2's real config (tests/fixtures/families/bert.json),
shrunk, saved as a sentence-transformers directory: mean pooling, then Normalize, as that model ships.

Its tokenizer is a BERT WordPiece vocabulary made here from the fixed text below (the hub is not
reachable): every word of it, every character alone and as a `##` continuation (so any text of those
characters tokenizes, unknown words split into pieces), a few suffixes; lower-casing, `[CLS] ... [SEP]`
added as BERT tokenizers add them.  Built, not trained: the `tokenizers` WordPiece trainer breaks
frequency ties differently from run to run.
Built once per cache directory and reused; the directory name carries the seed and a hash of the
config and the text.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from serving.model_files import default_cache_dir
from tests.family_models import SEED, _randomise, real_config

SHRINK = {
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,
    "torch_dtype": "float32",
}
TEXT = (
    "The sea is calm tonight. The tide is full, the moon lies fair upon the straits.",
    "Copper conducts electricity well because its electrons move freely.",
    "The quick brown fox jumps over the lazy dog. 0123456789 !?,.;:'\"()-",
    "An embedding maps a sentence to a vector; similar sentences map to nearby vectors.",
    "Sphinx of black quartz, judge my vow. Pack my box with five dozen liquor jugs.",
)
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # BERT's, [PAD] first (pad_token_id 0)
SUFFIXES = ("s", "ed", "er", "ing", "ly", "tion")
ST_FILES = {  # what all-MiniLM-L6-v2 publishes beside its weights
    "modules.json": [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ],
    "1_Pooling/config.json": {
        "word_embedding_dimension": SHRINK["hidden_size"],
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    },
    "sentence_bert_config.json": {"max_seq_length": SHRINK["max_position_embeddings"], "do_lower_case": False},
}


def vocab() -> dict[str, int]:
    """Special tokens, then characters, `##` characters, suffixes and TEXT's words, each once, in a fixed order."""
    from tokenizers.pre_tokenizers import BertPreTokenizer

    words = sorted({w for line in TEXT for w, _ in BertPreTokenizer().pre_tokenize_str(line.lower())})
    chars = sorted({c for w in words for c in w})
    tokens = SPECIAL + chars + ["##" + c for c in chars] + ["##" + x for x in SUFFIXES] + words
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}


def tokenizer():
    """The WordPiece tokenizer of `vocab()`, as transformers' BertTokenizer (fast)."""
    from transformers import BertTokenizerFast

    return BertTokenizerFast(vocab=vocab(), do_lower_case=True, model_max_length=SHRINK["max_position_embeddings"])


def build(cache_dir: Path | None = None) -> Path:
    """The seeded encoder as an HF directory (safetensors, tokenizer.json, sentence-transformers files)."""
    from transformers import BertConfig, BertModel

    cfg = {**real_config("bert"), **SHRINK}
    digest = hashlib.sha256(json.dumps([cfg, TEXT, SUFFIXES, ST_FILES], sort_keys=True).encode()).hexdigest()[:12]
    out = (cache_dir or default_cache_dir()) / "families" / f"bert-s{SEED}-{digest}"
    if (out / "config.json").is_file():
        return out
    tok = tokenizer()
    cfg["vocab_size"] = len(tok)
    torch.manual_seed(SEED)
    model = BertModel(BertConfig(**cfg)).eval()
    _randomise(model)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    for name, content in ST_FILES.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(json.dumps(content, indent=2))
    tmp.rename(out)
    return out
