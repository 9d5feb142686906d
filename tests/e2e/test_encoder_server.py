"""A BERT encoder served end to end (three processes, ZMQ, HTTP): the seeded all-MiniLM-shaped
sentence-transformers directory (tests/encoder_models.py), mean pooling then Normalize from its own files.
The official `openai` client's `embeddings.create` for every input form equals transformers' `BertModel`
pooled the same way on the same tokens ([CLS] ... [SEP] added by the front end's tokenizer); generation is
refused; an input over the model's 64 positions is refused unless truncated, and truncation keeps
[CLS] ... [SEP]; the embeddings telemetry counts the requests and each input has its spans.  One server for all."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer, BertModel

from tests import encoder_models
from tests.server_util import ServerProc, scrape, span_names, value, wait_until

LATENCY = "sightline_embedding_request_latency_seconds_count"
TEXTS = ["The sea is calm tonight.", "Copper conducts electricity well because its electrons move freely."]


@pytest.fixture(scope="module")
def bert_dir():
    return encoder_models.build()


@pytest.fixture(scope="module")
def reference(bert_dir):
    tok, model = AutoTokenizer.from_pretrained(bert_dir), BertModel.from_pretrained(bert_dir).eval()

    def embed(ids: list[int]) -> np.ndarray:
        """sentence-transformers' Pooling(mean) then Normalize over transformers' last hidden state."""
        with torch.no_grad():
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(h.mean(dim=0), dim=0).numpy()

    embed.tok = tok
    return embed


@pytest.fixture(scope="module")
def server(bert_dir, tmp_path_factory):
    srv = ServerProc("--served-model-name", "minilm", model=str(bert_dir), tmpdir=tmp_path_factory.mktemp("bert"))
    yield srv
    srv.stop()


def cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_every_input_form_equals_transformers(server, reference):
    before = value(scrape(server), LATENCY, kind="e2e")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ids = [reference.tok(t)["input_ids"] for t in TEXTS]
    one = client.embeddings.create(model="minilm", input=TEXTS[0])
    assert len(one.data[0].embedding) == 96 and one.usage.prompt_tokens == len(ids[0])  # [CLS] ... [SEP] counted
    many = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    one_ids = client.embeddings.create(model="minilm", input=ids[1])
    lists = client.embeddings.create(model="minilm", input=ids)
    for got, want in [
        (one.data[0], ids[0]),
        (many.data[0], ids[0]),
        (many.data[1], ids[1]),
        (one_ids.data[0], ids[1]),
        (lists.data[0], ids[0]),
        (lists.data[1], ids[1]),
    ]:
        assert cos(got.embedding, reference(want)) >= 0.9999
        assert np.abs(np.asarray(got.embedding) - reference(want)).max() < 1e-5
        assert abs(np.linalg.norm(got.embedding) - 1) < 1e-5  # its Normalize module
    wait_until(lambda: value(scrape(server), LATENCY, kind="e2e") - before == 4, 10, "4 more in the histogram")
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert listed.get("architecture") == "BertModel" and listed.get("max_model_len") == 64


def test_generation_is_refused(server):
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    ]:
        r = server.post(path, {"model": "minilm", **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "generation_not_supported" and err["type"] == "invalid_request_error"


def test_over_long_inputs_are_refused_unless_truncated(server, reference):
    text = " ".join(TEXTS * 6)
    ids = reference.tok(text)["input_ids"]
    assert len(ids) > 64
    for item in (text, ids):
        r = server.post("/v1/embeddings", {"input": item})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    want = reference(reference.tok(text, truncation=True, max_length=64)["input_ids"])  # [CLS] first 62 [SEP]
    for item, k in [(text, -1), (ids, 64)]:
        r = server.post("/v1/embeddings", {"input": item, "truncate_prompt_tokens": k})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64, r.text
        assert cos(r.json()["data"][0]["embedding"], want) >= 0.9999


def test_spans_of_each_input(server):
    r = server.post("/v1/embeddings", {"input": [[2, 7, 9, 3], [2, 8, 3]]})
    names = span_names(server, r.headers["x-request-id"], inputs=2)
    assert {"POST /v1/embeddings", "tokenize", "receive scheduler"} <= set(names) and names.count("queue") == 2
