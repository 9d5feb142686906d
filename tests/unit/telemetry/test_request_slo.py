"""Per-request objectives without a server: the headers (llm-d's names, their aliases, what is refused),
a tenant's defaults from the keys file, the verdict at a request's end, and the tail-sampling reason."""

from __future__ import annotations

import pytest

from serving.frontend.tenants.keys import KeysFileError, parse
from telemetry import outcomes
from telemetry.request_slo import Objectives, SLOHeaderError, judge, objective_headers, parse_headers
from telemetry.tail_sampling import TailPolicy


def test_headers_in_milliseconds_the_canonical_name_winning_over_its_alias():
    assert parse_headers({}) == Objectives() and not Objectives()
    got = parse_headers(
        {
            "x-llm-d-slo-ttft-ms": "250",
            "x-slo-ttft-ms": "9",
            "x-slo-tpot-ms": "12.5",
            "x-sightline-slo-e2e-ms": " 3000 ",
        }
    )
    assert got == Objectives(ttft=0.25, tpot=0.0125, e2e=3.0)


@pytest.mark.parametrize(
    "header, raw",
    [
        ("x-llm-d-slo-ttft-ms", "fast"),
        ("x-llm-d-slo-tpot-ms", "0"),
        ("x-slo-ttft-ms", "-1"),
        ("x-sightline-slo-e2e-ms", "nan"),
        ("x-sightline-slo-e2e-ms", "inf"),
        ("x-slo-tpot-ms", "86400001"),
        ("x-llm-d-slo-ttft-ms", "100, 200"),
        ("x-llm-d-slo-ttft-ms", ""),
    ],
)
def test_a_malformed_header_is_refused_by_name(header, raw):
    with pytest.raises(SLOHeaderError) as exc:
        parse_headers({header: raw})
    assert exc.value.header == header and header in str(exc.value)


def test_an_alias_is_checked_even_beside_its_canonical_name():
    with pytest.raises(SLOHeaderError) as exc:
        parse_headers({"x-llm-d-slo-ttft-ms": "100", "x-slo-ttft-ms": "soon"})
    assert exc.value.header == "x-slo-ttft-ms"


def test_headers_override_the_tenants_objectives_one_by_one():
    tenant = Objectives.from_ms(ttft_ms=500, e2e_ms=10_000)
    assert Objectives(ttft=0.1).over(tenant) == Objectives(ttft=0.1, e2e=10.0)
    assert Objectives().over(tenant) == tenant and Objectives(tpot=0.05).over(None) == Objectives(tpot=0.05)


def test_judged_only_when_successful_tpot_only_with_two_tokens():
    obj = Objectives(ttft=0.5, tpot=0.05, e2e=2.0)
    assert judge(obj, outcomes.STOP, 0.2, 0.01, 1.0) == {"ttft": True, "tpot": True, "e2e": True, "all": True}
    assert judge(obj, outcomes.LENGTH, 0.6, 0.01, 1.0) == {"ttft": False, "tpot": True, "e2e": True, "all": False}
    assert judge(obj, outcomes.STOP, 0.2, None, 0.3) == {"ttft": True, "e2e": True, "all": True}  # one token
    for failed in (outcomes.ERROR, outcomes.TIMEOUT, outcomes.SHED, outcomes.REJECTED, outcomes.CLIENT_DISCONNECT):
        assert judge(obj, failed, 0.01, 0.001, 0.1) == {"ttft": False, "tpot": False, "e2e": False, "all": False}
    assert judge(Objectives(), outcomes.STOP, 0.1, 0.1, 0.1) == {}
    assert judge(Objectives(e2e=1.0), outcomes.STOP, None, None, 1.0) == {"e2e": True, "all": True}  # at the bound


def test_a_tenants_objectives_in_the_keys_file():
    table, _ = parse("[tenants.a]\nslo_ttft_ms = 500\nslo_e2e_ms = 10000.5\n[tenants.b]\npriority = 1\n")
    assert table.policy("a").objectives == Objectives(ttft=0.5, e2e=10.0005)
    assert table.policy("b").objectives is None and table.policy("nobody").objectives is None
    for bad in (
        "slo_ttft_ms = 0",
        "slo_tpot_ms = -3",
        'slo_e2e_ms = "1s"',
        "slo_ttft_ms = true",
        "slo_ttft_ms = 1e12",
        "slo_latency_ms = 5",
    ):
        with pytest.raises(KeysFileError, match="tenants.a"):
            parse(f"[tenants.a]\n{bad}\n")


def test_tail_sampling_keeps_a_missed_objective_after_the_outcomes():
    policy = TailPolicy(ttft_s=1.0, tpot_s=None)
    assert policy.keep_reason(outcomes.STOP, 0.1, 0.01, missed_slo=True) == "slo"
    assert policy.keep_reason(outcomes.ERROR, 0.1, 0.01, missed_slo=True) == "error"
    assert policy.keep_reason(outcomes.STOP, 2.0, 0.01, missed_slo=True) == "slo"
    assert policy.keep_reason(outcomes.STOP, 2.0, 0.01) == "ttft"
    assert policy.keep_reason(outcomes.STOP, 0.1, 0.01) is None


def test_the_load_tests_thresholds_as_headers_read_back_the_same():
    sent = objective_headers({"ttft_ms": 1000.0, "tpot_ms": 100.0, "e2e_ms": 0.0, "objective": 0.99})
    assert sent == {"x-llm-d-slo-ttft-ms": "1000", "x-llm-d-slo-tpot-ms": "100"}
    assert parse_headers(sent) == Objectives(ttft=1.0, tpot=0.1)
