"""Embeddings against a real server (three processes, ZMQ, HTTP) on an embedding model: a seeded
Llama saved as a sentence-transformers directory (mean pooling, Normalize).  The official `openai`
client's `embeddings.create` for every input form, `/encode`, the refusals and truncation; its
vectors equal sentence-transformers' pooling of transformers' hidden states; it refuses generation;
a 16-client `embed` load reconciles with /metrics exactly.  A generative model without `--pooling`
refuses embeddings (the shared tiny-random server).  One server for all: the suite's time is
counted (last-token pooling and embeddings batched with generation are the engine tests')."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from telemetry.request_record import read_records
from tests import family_models
from tests.server_util import ServerProc, span_names, wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def st_model(tmp_path_factory) -> Path:
    """A sentence-transformers directory: the seeded Llama family model, mean pooling, then Normalize."""
    out = tmp_path_factory.mktemp("st-model") / "st-llama"
    shutil.copytree(family_models.build("llama"), out)
    (out / "1_Pooling").mkdir()
    (out / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 128,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False,
                "pooling_mode_lasttoken": False,
            }
        )
    )
    return out


@pytest.fixture(scope="module")
def st_server(st_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("st")
    srv = ServerProc(
        "--served-model-name",
        "st-llama",
        "--max-embedding-inputs",
        "8",
        "--context-length",
        "160",
        "--dump-requests",
        str(tmp / "dump"),
        "--dump-content",
        model=str(st_model),
        tmpdir=tmp,
    )
    srv.dump = tmp / "dump"
    yield srv
    srv.stop()


def cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_openai_client_every_input_form(st_server):
    client = openai.OpenAI(base_url=st_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    one = client.embeddings.create(model="st-llama", input="The sea is calm tonight.")  # base64 by default
    assert len(one.data) == 1 and len(one.data[0].embedding) == 128
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0
    assert abs(np.linalg.norm(one.data[0].embedding) - 1) < 1e-5  # its Normalize module
    many = client.embeddings.create(
        model="st-llama", input=["The sea is calm tonight.", "A cat."], encoding_format="float"
    )
    assert [d.index for d in many.data] == [0, 1]
    assert cos(many.data[0].embedding, one.data[0].embedding) > 0.99999  # batched equals alone
    ids = client.embeddings.create(model="st-llama", input=[5, 6, 7, 8])
    lists = client.embeddings.create(model="st-llama", input=[[5, 6, 7, 8], [9, 10]])
    assert cos(ids.data[0].embedding, lists.data[0].embedding) > 0.99999 and lists.usage.prompt_tokens == 6
    cut = client.embeddings.create(model="st-llama", input="The sea is calm tonight.", dimensions=16)
    assert len(cut.data[0].embedding) == 16 and abs(np.linalg.norm(cut.data[0].embedding) - 1) < 1e-5
    assert cos(cut.data[0].embedding, one.data[0].embedding[:16]) > 0.99999


def test_refusals_truncation_and_encode(st_server):
    post = st_server.post

    def error(body, path="/v1/embeddings"):
        r = post(path, body)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert error({"input": list(range(1, 170))})["code"] == "context_length_exceeded"  # context 160
    assert error({"input": ["x"] * 9})["code"] == "too_many_inputs"  # --max-embedding-inputs 8
    assert error({"input": "x", "dimensions": 129})["param"] == "dimensions"
    assert error({"input": []})["param"] == "input"
    assert error({"input": ["a", [1, 2]]})["code"] == "invalid_type"
    assert error({"input": "x", "encoding_format": "int8"})["param"] == "encoding_format"
    assert error({"input": "x", "model": "nope"})["code"] == "model_not_found"
    long = list(range(1, 170))
    r = post("/v1/embeddings", {"input": long, "truncate_prompt_tokens": 10, "encoding_format": "base64"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    tail = post("/v1/embeddings", {"input": long[-10:]}).json()["data"][0]["embedding"]
    assert cos(vec, tail) > 0.99999  # truncation keeps the last tokens
    raw = post("/v1/embeddings", {"input": long[-10:], "normalize": False}).json()["data"][0]["embedding"]
    assert np.linalg.norm(raw) > 1.5 and cos(raw, tail) > 0.99999
    enc = post("/encode", {"text": ["hello", "world"]}).json()
    assert len(enc) == 2 and enc[0]["meta_info"]["prompt_tokens"] > 0 and len(enc[0]["embedding"]) == 128
    single = post("/encode", {"input_ids": [5, 6, 7, 8]}).json()
    assert cos(single["embedding"], ids_vec(st_server)) > 0.99999


def ids_vec(srv):
    return srv.post("/v1/embeddings", {"input": [5, 6, 7, 8]}).json()["data"][0]["embedding"]


def test_generative_model_without_pooling_refuses(tiny_server):
    r = tiny_server.post("/v1/embeddings", {"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "embeddings_not_supported"


def test_embedding_model_matches_sentence_transformers_and_refuses_generation(st_server, st_model):
    texts = ["The sea is calm tonight.", "Copper conducts electricity well because its electrons move freely."]
    got = st_server.post("/v1/embeddings", {"input": texts}).json()["data"]
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(st_model), AutoModel.from_pretrained(st_model).eval()
    for text, item in zip(texts, got):
        with torch.no_grad():
            h = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        ref = torch.nn.functional.normalize(h.mean(dim=0), dim=0).numpy()  # Pooling(mean) → Normalize
        assert cos(item["embedding"], ref) >= 0.9999
        assert abs(np.linalg.norm(item["embedding"]) - 1) < 1e-5
    r = st_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "generation_not_supported"


def test_spans_in_every_process_and_the_flight_record(st_server):
    r = st_server.post("/v1/embeddings", {"input": [[5, 6, 7], [8, 9]], "dimensions": 8})
    rid = r.headers["x-request-id"]
    names = span_names(st_server, rid, inputs=2)
    assert {"POST /v1/embeddings", "tokenize", "receive scheduler", "receive detokenizer"} <= set(names)
    assert names.count("queue") == 2  # one per input
    record = wait_until(lambda: [x for x in read_records(st_server.dump) if x.rid == rid], 10, "the record")[0]
    assert (record.route, record.operation, record.prompt_tokens, record.outcome) == (
        "/v1/embeddings",
        "embeddings",
        5,
        "stop",
    )
    assert record.params["inputs"] == 2 and record.params["dimensions"] == 8 and record.prompt == [[5, 6, 7], [8, 9]]


def test_embed_load_at_16_clients_reconciles(st_server, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "--url",
            st_server.url,
            "--model",
            "st-llama",
            "--mix",
            "embed=1",
            "--levels",
            "16",
            "--stage-seconds",
            "3",
            "--out",
            str(out),
            "--require-reconcile",
            "--slo",
            "error_rate=0.0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    r = json.loads((out / "summary.json").read_text())["reconciliation"]
    assert len(recs) > 16 and all(x["error"] is None for x in recs)
    assert r["ok"] and r["server_embedding_requests"] == r["client_embedding_requests"] == len(recs)
    assert r["server_embedding_inputs"] == r["client_embedding_inputs"] == sum(x["inputs"] for x in recs)
    assert r["server_prompt_tokens"] == r["client_prompt_tokens"] == sum(x["prompt_tokens"] for x in recs)
    metrics = httpx.get(st_server.url + "/metrics", timeout=10).text
    assert (
        'sightline_embedding_request_latency_seconds_count{kind="queue",model_name="st-llama",route="/v1/embeddings"}'
    ) in metrics
