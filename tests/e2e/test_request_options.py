"""Server options of the request surface, on one server: `--generation-config auto` (a model directory's
generation_config.json supplies the sampling defaults of requests that leave them unset, and each request
says where its values came from) and `--allow-unknown-fields` (unknown fields ignored, but counted)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from serving.model_files import prepare_model_dir
from tests.server_util import ServerProc


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("genconfig")
    model = tmp / "tiny-with-defaults"
    shutil.copytree(prepare_model_dir("tiny-random")[0], model)
    cfg = json.loads((model / "generation_config.json").read_text())  # tiny-random's has no sampling fields
    (model / "generation_config.json").write_text(
        json.dumps({**cfg, "temperature": 0.0, "top_k": 1, "max_new_tokens": 5})
    )
    s = ServerProc("--allow-unknown-fields", model=str(model), tmpdir=tmp)
    try:
        yield s
    finally:
        s.stop()


def test_generation_config_fills_unset_fields(srv):
    msgs = [{"role": "user", "content": "hi"}]
    r = srv.post("/v1/chat/completions", {"messages": msgs, "ignore_eos": True, "top_p": 0.5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5  # generation_config's max_new_tokens
    sources = httpx.get(f"{srv.url}/debug/requests/{r.headers['x-request-id']}", timeout=10).json()["param_sources"]
    assert sources == {
        "temperature": "generation_config",
        "top_k": "generation_config",
        "top_p": "request",
        "min_p": "default",
        "repetition_penalty": "default",
        "max_new_tokens": "generation_config",
    }
    again = srv.post("/v1/chat/completions", {"messages": msgs, "ignore_eos": True, "seed": 3}).json()
    assert again["choices"][0]["message"] == r.json()["choices"][0]["message"]  # greedy: temperature 0, top_k 1
    assert "generation defaults from" in srv.log()


def test_unknown_fields_ignored_and_counted(srv):
    r = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "add_special_tokens": False, "frobnicate": 1})
    assert r.status_code == 200, r.text
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    for name in ("add_special_tokens", "other"):
        line = f'sightline_request_fields_ignored_total{{field="{name}",route="/v1/completions"}} 1.0'
        assert line in metrics, name
