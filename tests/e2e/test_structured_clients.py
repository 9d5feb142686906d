"""Structured outputs and tool calls as the libraries people use send them, against the bundled model.

Each scenario runs one real client (openai's `.parse()`, instructor in three modes, LangChain's
`with_structured_output` two ways, the OpenAI Agents SDK) from its own virtualenv
(.venv-clients, tests/clients/requirements.txt: `make setup` builds it) in a subprocess, and the test
checks the object it returned — the grammar forces the shape, so a 135M model still gives one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.server_util import ServerProc

pytestmark = [pytest.mark.smollm, pytest.mark.lane2]

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_PY = ROOT / ".venv-clients" / "bin" / "python"
DRIVE = ROOT / "tests" / "clients" / "drive.py"
COUNTRIES = {"France", "Japan", "Peru"}


def need_clients_venv() -> None:
    if not CLIENTS_PY.exists():
        message = f"{CLIENTS_PY} is missing: `make setup` builds it from tests/clients/requirements.txt"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_clients_venv()
    srv = ServerProc("--quantization", "none", model="smollm2-135m", tmpdir=tmp_path_factory.mktemp("clients"))
    yield srv
    srv.stop()


def drive_all(server: ServerProc, scenarios: list[str], timeout: float = 120) -> dict[str, dict]:
    """Every scenario's result, run one after another in one client interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "PYTHON"))}
    proc = subprocess.run([str(CLIENTS_PY), str(DRIVE), ",".join(scenarios), server.url + "/v1"],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"scenario"')]
    return {r["scenario"]: r for r in lines}


def drive(server: ServerProc, scenario: str) -> dict:
    result = drive_all(server, [scenario])[scenario]
    assert result["ok"], result["error"]
    return result


def assert_city(parsed: dict) -> None:
    """The object the client validated: every field present, typed and in its bounds."""
    assert set(parsed) == {"name", "country", "population_millions"}
    assert isinstance(parsed["name"], str) and 0 < len(parsed["name"]) <= 24
    assert parsed["country"] in COUNTRIES
    assert isinstance(parsed["population_millions"], int) and 0 <= parsed["population_millions"] <= 50


@pytest.mark.parametrize("scenario", ["openai_parse", "instructor_tools", "instructor_json_schema",
                                      "langchain_json_schema", "langchain_function_calling"])
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
    pins = [line for line in (ROOT / "tests/clients/requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    frozen = subprocess.run([str(CLIENTS_PY), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    assert set(pins) <= set(frozen.splitlines()), sorted(set(pins) - set(frozen.splitlines()))
