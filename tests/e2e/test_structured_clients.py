"""Structured outputs and tool calls as the libraries people use send them, against the bundled model.

Each scenario runs one real client (openai's `.parse()`, instructor in three modes, LangChain's
`with_structured_output` two ways, the OpenAI Agents SDK) from its own virtualenv
(.venv-clients, tests/clients/requirements.txt: `make setup` builds it) in a subprocess, and the test
checks the object it returned — the grammar forces the shape, so a 135M model still gives one.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.client_venv import CLIENTS_PY, ROOT, need_clients_venv
from tests.client_venv import drive as drive_client
from tests.server_util import ServerProc

pytestmark = [pytest.mark.smollm, pytest.mark.lane2]

COUNTRIES = {"France", "Japan", "Peru"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_clients_venv()
    srv = ServerProc("--quantization", "none", model="smollm2-135m", tmpdir=tmp_path_factory.mktemp("clients"))
    yield srv
    srv.stop()


def drive(server: ServerProc, scenario: str) -> dict:
    return drive_client(server.url + "/v1", scenario)


def assert_city(parsed: dict) -> None:
    """The object the client validated: every field present, typed and in its bounds."""
    assert set(parsed) == {"name", "country", "population_millions"}
    assert isinstance(parsed["name"], str) and 0 < len(parsed["name"]) <= 24
    assert parsed["country"] in COUNTRIES
    assert isinstance(parsed["population_millions"], int) and 0 <= parsed["population_millions"] <= 50


@pytest.mark.parametrize(
    "scenario",
    [
        "openai_parse",
        "instructor_tools",
        "instructor_json_schema",
        "langchain_json_schema",
        "langchain_function_calling",
    ],
)
def test_client_gets_a_validated_object(server, scenario):
    result = drive(server, scenario)
    assert result["type"] == "City"
    assert_city(result["parsed"])
    if scenario == "openai_parse":
        assert result["finish_reason"] == "stop"  # the grammar completed: not cut by max_tokens


def test_instructor_json_mode(server):
    """JSON mode with the schema in extra_body (structured_outputs.json beside instructor's json_object): the
    schema says which object, so the object validates."""
    result = drive(server, "instructor_json")
    assert result["type"] == "City"
    assert_city(result["parsed"])


def test_agents_sdk_calls_the_tool_and_feeds_its_result_back(server):
    result = drive(server, "agents_tool_turn")
    assert len(result["calls"]) >= 1
    call = result["calls"][0]
    assert isinstance(call["city"], str) and isinstance(call["year"], int)
    # the run: a tool call, its output sent back to the model, then the model's answer
    assert result["items"][:2] == ["ToolCallItem", "ToolCallOutputItem"]
    assert "MessageOutputItem" in result["items"][2:]


def test_the_clients_venv_holds_the_pinned_versions():
    """The lock is what runs: a drifted venv would test other clients than the ones pinned."""
    need_clients_venv()
    pins = [
        line
        for line in (ROOT / "tests/clients/requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    frozen = subprocess.run([str(CLIENTS_PY), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    assert set(pins) <= set(frozen.splitlines()), sorted(set(pins) - set(frozen.splitlines()))
