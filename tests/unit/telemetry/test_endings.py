"""The table of request endings (telemetry.outcomes.ENDINGS) is complete and is what every reader sees:
each abort reason has a status and an outcome, every outcome and finish reason is reachable, and the
front end's status, the outcome label and the zero series all agree with the rows."""

from __future__ import annotations

import ast

from protocol.reasons import ENGINE_ERROR, AbortReason
from serving.frontend.errors import ABORT_STATUS, CLIENT_GONE, http_status, result_error
from telemetry import outcomes
from telemetry.metrics import ZERO_SERIES
from telemetry.outcomes import (
    ABORTS,
    ENDINGS,
    ERROR_TYPES,
    FINISHED,
    OUTCOMES,
    REFUSALS,
    REQUEST_FINISH_REASONS,
    ending_for,
)
from tests.helpers import REPO

ROOT = REPO


def test_every_row_is_complete():
    for e in ENDINGS:
        assert e.finish_reason in REQUEST_FINISH_REASONS, e
        assert e.outcome in OUTCOMES, e
        assert 200 <= e.status < 600, e
    assert all(e.abort_reason and e.finish_reason == "abort" and e.status >= 400 for e in ABORTS)
    assert len({e.abort_reason for e in ABORTS}) == len(ABORTS), "an abort reason is listed twice"
    assert len({(e.status, e.code) for e in REFUSALS}) == len(REFUSALS), "a refusal is listed twice"
    assert {e.finish_reason for e in ENDINGS} == set(REQUEST_FINISH_REASONS)  # the engine's, and tool_calls
    assert {e.outcome for e in ENDINGS} == set(OUTCOMES), "an outcome no request can end with"


def test_one_error_type_per_status():
    for status in ERROR_TYPES:
        types = {e.error_type for e in ENDINGS if e.status == status and e.error_type}
        assert len(types) == 1, f"status {status} has error types {types}"
    for e in FINISHED + ABORTS:  # an admitted request's explicit error says its own status and type
        if e.error_type:
            err = result_error(e.finish_reason, "why", e.status)
            assert err is not None and (err.status, err.type) == (e.status, e.error_type)


def test_the_functions_read_the_rows():
    for e in FINISHED + ABORTS:
        assert http_status(e.finish_reason, e.abort_reason) == e.status, e
        assert outcomes.finished_outcome(e.finish_reason, e.abort_reason) == e.outcome, e
    for e in REFUSALS:
        assert outcomes.refused_outcome(e.status, e.code) == e.outcome, e
    assert outcomes.refused_outcome(CLIENT_GONE, None) == outcomes.CLIENT_DISCONNECT
    assert ABORT_STATUS == {e.abort_reason: e.status for e in ABORTS}


def test_every_ending_exists_at_zero():
    series = {tuple(sorted(s.items())) for s in ZERO_SERIES["sightline_requests_total"]}
    rows = {
        tuple(sorted({"finish_reason": e.finish_reason, "status": str(e.status), "outcome": e.outcome}.items()))
        for e in ENDINGS
    }
    assert series == rows
    assert [s["reason"] for s in ZERO_SERIES["sightline_request_aborts_total"]] == [e.abort_reason for e in ABORTS]


def _abort_reasons_in_code() -> tuple[set[str], list[str]]:
    """The reasons the front end aborts requests with (`tm.abort(rid, r)`, `tm.abort_all(r, ...)`), and the
    calls that give one as a bare string instead of an `AbortReason` member."""
    found, bare = set(), []
    for path in (ROOT / "serving").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            i = {"abort": 1, "abort_all": 0}.get(node.func.attr)
            if i is None or len(node.args) <= i:
                continue
            arg = node.args[i]
            if isinstance(arg, ast.Constant):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "AbortReason":
                found.add(AbortReason[arg.attr].value)
    return found, bare


def test_every_abort_reason_the_code_uses_has_a_row():
    used, bare = _abort_reasons_in_code()
    assert used, "the scan found no abort call: update it"
    assert not bare, f"abort reasons as bare strings (take them from AbortReason): {bare}"
    assert used <= {e.abort_reason for e in ABORTS}, used - {e.abort_reason for e in ABORTS}


def test_ending_for_an_engine_error_type():
    assert ending_for(AbortReason.TIMEOUT).abort_reason == "timeout"  # a queue timeout stays an abort (504)
    assert ending_for(ENGINE_ERROR).finish_reason == "error" and ending_for(None).status == 500
