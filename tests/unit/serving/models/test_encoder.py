"""The BERT encoder family on the seeded all-MiniLM-shaped model (tests/encoder_models.py): its pooled
embeddings through the Scheduler core equal transformers' `BertModel` on the same tokens, alone and
several in one step; inputs are never chunked; over-long inputs and generation are refused; the
registry resolves it and refuses what it does not compute; a BertForMaskedLM checkpoint serves the same;
bfloat16, int8 and q8_0 stay close."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

from serving.engine.embedding import pooling_config
from serving.engine.loader import load_model
from serving.frontend.tokenizer_manager.embeddings import truncate
from serving.model_files import ModelLoadError
from serving.models.base import UnsupportedConfig
from serving.models.bert import BertForward
from serving.models.registry import family, resolve
from tests import encoder_models
from tests.helpers import greedy, make_core

TEXTS = [
    "A dog.",
    "The sea is calm tonight.",
    "Copper conducts electricity well because its electrons move freely, and the quick brown fox jumps.",
    "An embedding maps a sentence to a vector; similar sentences map to nearby vectors, zebra.",
]


@pytest.fixture(scope="module")
def bert():
    path = encoder_models.build()
    return load_model(str(path)), AutoTokenizer.from_pretrained(path), BertModel.from_pretrained(path).eval()


def reference(ref: BertModel, ids: list[int], mode: str) -> torch.Tensor:
    """What sentence-transformers pools: the last hidden state of transformers' BertModel."""
    with torch.no_grad():
        h = ref(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return {"mean": h.mean(dim=0), "cls": h[0], "last": h[-1]}[mode]


def embed(core, inputs: list[list[int]], mode: str) -> tuple[list[torch.Tensor], int]:
    """Every input's embedding, and the steps it took."""
    for i, ids in enumerate(inputs):
        core.add_request(f"e{i}", ids, greedy(1), pooling=mode)
    out, steps = {}, 0
    while core.has_work:
        steps += 1
        out.update({ev.rid: ev.req.embedding for ev in core.step() if ev.req.embedding is not None})
    return [out[f"e{i}"] for i in range(len(inputs))], steps


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
def test_batched_and_alone_equal_transformers(bert, mode):
    model, tok, ref = bert
    inputs = [tok(t)["input_ids"] for t in TEXTS]
    assert len({len(ids) for ids in inputs}) == len(inputs) and inputs[0][0] == tok.cls_token_id
    batched, steps = embed(make_core(model), inputs, mode)
    assert steps == 1  # several whole inputs side by side in one step
    for ids, got in zip(inputs, batched):
        alone = embed(make_core(model), [ids], mode)[0][0]
        want = reference(ref, ids, mode)
        assert cos(got, want) >= 0.9999 and float((got - want).abs().max()) < 1e-4, (mode, len(ids))
        assert torch.allclose(got, alone, atol=1e-5)


def test_inputs_run_whole_under_a_small_step_budget(bert):
    model, tok, ref = bert
    inputs = [tok(t)["input_ids"] for t in TEXTS[1:]]
    budget = max(map(len, inputs)) + 4  # one input per step at most, never a chunk of one
    core = make_core(model, max_prefill_tokens=budget)
    reqs = [core.add_request(f"e{i}", ids, greedy(1), pooling="mean") for i, ids in enumerate(inputs)]
    events = core.run_to_completion()
    assert {ev.rid for ev in events} == {"e0", "e1", "e2"}
    for req, ids in zip(reqs, inputs):
        assert [n for _, _, n in req.times.prefill_chunks] == [len(ids)]  # one chunk: the whole input
        assert cos(req.embedding, reference(ref, ids, "mean")) >= 0.9999
    assert core.pool.is_empty() and core.tree is None  # no prefix cache for an encoder


def test_over_long_inputs_and_generation_are_refused(bert, tmp_path):
    model, tok, _ = bert
    core = make_core(model)
    assert core.context_len == 64  # max_position_embeddings of the shrunk config
    with pytest.raises(ValueError, match="context window is 64"):
        core.add_request("long", [5] * 65, greedy(1), pooling="mean")
    with pytest.raises(ValueError, match="embeddings only"):
        core.add_request("gen", [5, 6], greedy(4))
    assert make_core(model, max_prefill_tokens=16).context_len == 16  # an input must fit one step
    assert core.pool.kv.k == []  # no K/V storage is kept
    capped = shutil.copytree(model.path, tmp_path / "capped")
    (capped / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    assert make_core(load_model(str(capped))).context_len == 32  # sentence-transformers' own cap


def test_truncation_keeps_cls_and_sep_as_the_tokenizer_does(bert):
    _, tok, _ = bert
    ids = tok(TEXTS[2])["input_ids"]
    for k in (3, 8, len(ids)):
        assert truncate(ids, k, encoder=True) == tok(TEXTS[2], truncation=True, max_length=k)["input_ids"]
    assert truncate(ids, 4, encoder=False) == ids[-4:]


def test_registry_resolves_bert_and_refuses_what_it_does_not_compute(bert):
    model, _, _ = bert
    cfg = AutoConfig.from_pretrained(model.path)
    assert resolve(cfg) is BertForward and family(cfg).encoder and model.encoder
    assert model.architecture == "BertModel"
    assert resolve(BertConfig(architectures=["BertForMaskedLM"])) is BertForward
    for changes, match in [
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"is_decoder": True}, "decoder"),
    ]:
        with pytest.raises(UnsupportedConfig, match=match):
            resolve(BertConfig(architectures=["BertModel"], **changes))


def test_pooling_comes_from_the_sentence_transformers_files_or_the_flag(bert, tmp_path):
    model, _, _ = bert
    pc = pooling_config(model.path, None, encoder=True)
    assert (pc.mode, pc.normalize, pc.embedding_only, pc.source) == ("mean", True, True, "sentence-transformers")
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ModelLoadError, match="encoder model serves embeddings only"):
        pooling_config(bare, None, encoder=True)
    assert pooling_config(bare, "cls", encoder=True).embedding_only


def test_a_masked_lm_checkpoint_and_the_transformers_model_give_the_same_embeddings(bert, tmp_path):
    """A BertForMaskedLM directory (tensors under `bert.`, an MLM head left unused), from its safetensors and
    through transformers' model (`from_hf`), computes what the BertModel directory does."""
    model, tok, ref = bert
    ids = tok(TEXTS[1])["input_ids"]
    want = embed(make_core(model), [ids], "mean")[0][0]
    mlm_dir = tmp_path / "mlm"
    torch.manual_seed(0)
    mlm = BertForMaskedLM(ref.config)
    mlm.bert.load_state_dict(ref.state_dict(), strict=False)  # its pooler-less BertModel: the same encoder
    mlm.save_pretrained(mlm_dir)
    shutil.copy(model.path / "tokenizer.json", mlm_dir)
    config = json.loads((mlm_dir / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    loaded = load_model(str(mlm_dir))
    got = embed(make_core(loaded, pooling="mean"), [ids], "mean")[0][0]
    assert torch.allclose(got, want, atol=1e-5)
    hf = loaded.hf_model.load()  # transformers' AutoModel: a BertModel, its pooler missing and the MLM head unused
    assert type(hf) is BertModel
    core = make_core(model)
    core.runner.model = BertForward.from_hf(hf)
    assert torch.allclose(embed(core, [ids], "mean")[0][0], want, atol=1e-5)


@pytest.mark.parametrize(
    "precision", [{"dtype": "bfloat16"}, {"quantization": "int8", "dtype": "bfloat16"}, {"quantization": "q8_0"}]
)
def test_reduced_precision_stays_close(bert, precision):
    model, tok, ref = bert
    ids = tok(TEXTS[2])["input_ids"]
    got = embed(make_core(model, **precision), [ids], "mean")[0][0]
    assert cos(got, reference(ref, ids, "mean")) >= 0.999, precision
