"""The bundled SmolLM2-135M through the whole pipeline: CJK and emoji stream unbroken."""

from __future__ import annotations

import pytest

from tests.helpers import collect, greedy, make_core
from tests.server_util import ServerProc, chat_ids, chat_text, stream

pytestmark = pytest.mark.smollm

PROMPTS = ["Translate 'hello world' into Chinese.", "Reply with three emojis that describe happiness."]


@pytest.fixture(scope="module")
def smollm_server(tmp_path_factory):
    srv = ServerProc("--quantization", "none", model="smollm2-135m", tmpdir=tmp_path_factory.mktemp("smollm-server"))
    yield srv
    srv.stop()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_multibyte_output_round_trips(smollm_server, smollm, prompt):
    ids = chat_ids(smollm, prompt)
    core = make_core(smollm)
    core.add_request("ref", ids, greedy(40))
    out_ids = collect(core)["ref"]
    expected = smollm.tokenizer.decode(out_ids, skip_special_tokens=True)
    assert any(ord(ch) > 0x2E80 for ch in expected)  # the prompt really produces CJK / emoji
    assert any("\ufffd" in smollm.tokenizer.decode([t]) for t in out_ids)  # split across tokens
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0}
    events = stream(smollm_server, "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]]
    full = smollm_server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert chat_text(events[:-1]) == full == expected
    # a replacement character may only come at the very end, from bytes cut off by max_tokens
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "\ufffd" not in expected.rstrip("\ufffd")
