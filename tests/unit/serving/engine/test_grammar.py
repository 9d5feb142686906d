"""Structured outputs in the engine, on tiny-random (its near-uniform distributions draw any token the mask
leaves, the hardest test of the mask): every sampled output follows its grammar (JSON schemas checked with
jsonschema, regexes and choices matched), `after_token_ids` frees the output until its trigger, a grammar
that cannot compile or that leaves no token to draw ends only its request, a request waits for its compile
with the wait reason `grammar` without holding back the queue, rows without a grammar sample exactly what they
sample alone, processed logprobs see the mask, retraction keeps every matcher in step with its output, and
the grammar phase reaches the step's stats and timeline."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protocol.io_struct import ReqMeta
from protocol.sampling_params import SamplingParams, StructuredOutput
from serving.engine.sampling import _normaliser, pick
from serving.engine.scheduler_core import SchedulerCore
from serving.engine.token_mask import allowed_counts, apply_bias, mask_bias
from telemetry.engine_spans import SchedulerSpans
from telemetry.step_timeline import StepRing, chrome_trace
from telemetry.tracing import Tracing
from tests.helpers import encode, make_core

# Short outputs by construction: bounded strings, integers, enums, a few items.  Numbers with a fraction
# have no bound on their digits, so the number schema asks for a multiple of 0.5.  And no free whitespace
# (llguidance's `x-guidance` option): with it, a sampled model can run on newlines to its length limit
# (SmolLM2 at temperature 1: 3 samples of 200).
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
SCHEMAS = [
    {**COMPACT, **s}
    for s in [
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "name": {"type": "string", "minLength": 1, "maxLength": 8},
                    },
                    "required": ["id", "name"],
                    "additionalProperties": False,
                },
                "active": {"type": "boolean"},
            },
            "required": ["user", "active"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            },
            "required": ["color", "size"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["code", "zip"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "score": {"type": "integer", "minimum": 0, "maximum": 100},
                "ratio": {"type": "number", "minimum": -10, "maximum": 40, "multipleOf": 0.5},
            },
            "required": ["score", "ratio"],
            "additionalProperties": False,
        },
    ]
]
PROMPT = "Answer with one JSON object that follows the schema.\nJSON:"


def json_so(schema: dict, after: tuple[int, ...] = ()) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", spec=json.dumps(schema), after_token_ids=after)


def run(core: SchedulerCore) -> tuple[dict[str, list[int]], dict[str, tuple[str, str | None]]]:
    """Step to idle: each rid's tokens, and how it ended (finish reason, error)."""
    out: dict[str, list[int]] = {}
    end: dict[str, tuple[str, str | None]] = {}
    for ev in core.run_to_completion():
        out.setdefault(ev.rid, []).extend(ev.new_token_ids)
        if ev.finished:
            end[ev.rid] = (ev.finish_reason.value, ev.error)
    return out, end


def text(model, ids: list[int]) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True)


def sampled(n: int, seed: int, so: StructuredOutput | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, structured=so, **kw)


@pytest.fixture(scope="module")
def core(tiny) -> SchedulerCore:
    return make_core(tiny, max_running_requests=40)


def test_two_hundred_sampled_json_outputs_all_validate(tiny, core):
    ids = encode(tiny, PROMPT)
    n = 0
    for round_ in range(5):  # 40 concurrent rows a round, 8 per schema
        for i in range(40):
            schema = SCHEMAS[i % len(SCHEMAS)]
            core.add_request(f"j{round_}-{i}", ids, sampled(48, 1000 * round_ + i, json_so(schema)))
        out, end = run(core)
        for rid, toks in out.items():
            schema = SCHEMAS[int(rid.split("-")[1]) % len(SCHEMAS)]
            assert end[rid] == ("stop", None), (rid, end[rid], text(tiny, toks))
            jsonschema.validate(json.loads(text(tiny, toks)), schema)
            n += 1
    assert n == 200
    st = core.stats()
    assert {c.result: c.count for c in st["grammar_cache"]}["miss"] == len(SCHEMAS)
    assert st["grammar_forced_tokens_total"] > 0  # the keys' tokens, mostly


def test_regex_and_choice_outputs_all_match(tiny, core):
    ids = encode(tiny, "Reply:")
    regex, choices = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", ["yes", "no", "maybe later"]
    for i in range(16):
        so = (
            StructuredOutput(kind="regex", spec=regex)
            if i % 2
            else StructuredOutput(kind="choice", spec=json.dumps(choices))
        )
        core.add_request(f"m{i}", ids, sampled(32, i, so))
    out, end = run(core)
    for i in range(16):
        got = text(tiny, out[f"m{i}"])
        assert end[f"m{i}"] == ("stop", None)
        assert re.fullmatch(regex, got) if i % 2 else got in choices, got


def test_after_token_ids_frees_the_output_until_the_trigger(tiny, core):
    ids = encode(tiny, "Think first.")
    core.add_request("free", ids, sampled(12, 5, ignore_eos=True))
    free = run(core)[0]["free"]
    trigger = tuple(free[2:4])
    end = next(j for j in range(1, len(free)) if tuple(free[j - 1 : j + 1]) == trigger)  # its first occurrence
    so = StructuredOutput(kind="regex", spec="[0-9]{4}", after_token_ids=trigger)
    req = core.add_request("after", ids, sampled(40, 5, so, ignore_eos=True))
    out, ends = run(core)
    got = out["after"]
    assert got[: end + 1] == free[: end + 1]  # no mask until the output ends with the trigger: the same draws
    assert re.fullmatch("[0-9]{4}", text(tiny, got[end + 1 :])), text(tiny, got[end + 1 :])
    assert ends["after"] == ("stop", None) and req.grammar.complete  # the grammar ended it, EOS ignored or not


def test_a_dead_end_ends_only_its_request(tiny, core):
    ids = encode(tiny, "Open a brace:")
    brace = tiny.tokenizer.convert_tokens_to_ids("{")
    alone = sampled(8, 3, ignore_eos=True)
    core.add_request("alone", ids, alone)
    want = run(core)[0]["alone"]
    # the grammar allows only "{", and min_tokens bans it as a stop token id: nothing is left to draw
    so = StructuredOutput(kind="choice", spec=json.dumps(["{"]))
    core.add_request("dead", ids, sampled(8, 1, so, stop_token_ids=[brace], min_tokens=2))
    core.add_request("mate", ids, alone)
    before = {e.kind: e.count for e in core.stats()["grammar_errors"]}
    out, end = run(core)
    assert end["dead"][0] == "error" and out["dead"] == []
    assert end["dead"][1].startswith("structured output: the grammar allows no further token: ")
    assert "min_tokens" in end["dead"][1]
    assert out["mate"] == want and end["mate"] == ("length", None)
    assert {e.kind: e.count for e in core.stats()["grammar_errors"]}["dead_end"] == before["dead_end"] + 1
    core.check_kv_invariants()


def test_a_grammar_that_does_not_compile_ends_only_its_request(tiny, core):
    ids = encode(tiny, "Hello")
    core.add_request("bad", ids, sampled(4, 1, StructuredOutput(kind="regex", spec="(")))
    core.add_request("bad-json", ids, sampled(4, 1, StructuredOutput(kind="json_schema", spec="{not json")))
    core.add_request("good", ids, sampled(4, 2, ignore_eos=True))
    out, end = run(core)
    assert end["bad"][0] == "error" and "does not compile" in end["bad"][1] and "unclosed group" in end["bad"][1]
    assert end["bad-json"][0] == "error" and "not valid JSON" in end["bad-json"][1]
    assert end["good"] == ("length", None) and len(out["good"]) == 4
    assert {e.kind: e.count for e in core.stats()["grammar_errors"]}["compile"] >= 2
    assert not core.grammar.pending and not core.waiting


def test_a_request_waits_for_its_compile_without_holding_back_the_queue(tiny):
    tr = Tracing("scheduler", sink=lambda r: None)
    exp = InMemorySpanExporter()
    tr.provider.add_span_processor(SimpleSpanProcessor(exp))
    spans = SchedulerSpans(tr)
    core = make_core(tiny)  # its own: the first compile builds the tokenizer too (~0.3 s), a wait to see
    ids = encode(tiny, "Hello")
    so = json_so(SCHEMAS[1])
    g = core.add_request("g", ids, sampled(32, 1, so))
    p = core.add_request("p", ids, sampled(2, 2, ignore_eos=True))
    for req in (g, p):
        spans.received(req.rid, ReqMeta(trace=tr.carrier(tr.start("POST /generate", None))), 0, 0)
    core.step()
    assert p in core.running and g in core.waiting  # admitted past the request waiting for its grammar
    core.run_to_completion()
    assert g.times.wait.ns.get("grammar", 0) > 0 and "grammar" not in p.times.wait.ns
    assert sum(g.times.wait.ns.values()) == g.times.waited_ns()
    assert g.grammar.wait_ns > 0 and not g.grammar.cache_hit
    h = core.add_request("h", ids, sampled(32, 3, so))  # cached now: ready at once
    core.run_to_completion()
    assert h.grammar.cache_hit and h.grammar.wait_ns == 0 and "grammar" not in h.times.wait.ns
    for req in (g, p):
        spans.finished(req, req.finish_reason.value)
    queue = {s.attributes["sightline.rid"]: s for s in exp.get_finished_spans() if s.name == "queue"}
    reasons = [e.attributes["sightline.wait.reason"] for e in queue["g"].events if e.name == "wait_reason"]
    assert reasons[0] == "grammar"
    assert queue["g"].attributes["sightline.grammar.kind"] == "json_schema"
    assert queue["g"].attributes["sightline.grammar.compile_wait_ms"] > 0
    assert queue["g"].attributes["sightline.grammar.cache_hit"] is False
    assert "sightline.grammar.kind" not in queue["p"].attributes
    st = core.stats()
    assert st["grammar_compile_seconds"][0].counts[-1] == 0 and sum(st["grammar_compile_seconds"][0].counts) == 1
    assert {c.result: c.count for c in st["grammar_cache"]} == {"hit": 1, "miss": 1}


def test_rows_without_a_grammar_sample_what_they_sample_alone(tiny, core):
    ids = encode(tiny, "The weather today")
    core.add_request("plain", ids, sampled(10, 77, ignore_eos=True))
    want = run(core)[0]["plain"]
    for i in range(3):
        core.add_request(f"g{i}", ids, sampled(10, i, json_so(SCHEMAS[i])))
    core.add_request("plain", ids, sampled(10, 77, ignore_eos=True))
    assert run(core)[0]["plain"] == want


def test_processed_logprobs_see_the_mask(tiny, core):
    ids = encode(tiny, "Yes or no?")
    choices = ["yes", "no"]
    so = StructuredOutput(kind="choice", spec=json.dumps(choices))
    req = core.add_request("lp", ids, sampled(4, 9, so, logprobs=5))
    lps = [ev.logprobs for ev in core.run_to_completion() if ev.rid == "lp" and ev.new_token_ids]
    first = lps[0]
    allowed = [t for t, lp in zip(first.top_ids[0], first.top_logprobs[0]) if lp > float("-inf")]
    assert allowed and all(any(c.startswith(text(tiny, [t])) for c in choices) for t in allowed)
    assert text(tiny, req.output_ids) in choices
    # with --logprobs-mode raw they are the model's: the mask is on a copy
    raw = make_core(tiny, logprobs_mode="raw")
    raw.add_request("lp", ids, sampled(4, 9, so, logprobs=5))
    raw_lps = [ev.logprobs for ev in raw.run_to_completion() if ev.rid == "lp" and ev.new_token_ids]
    assert all(lp > float("-inf") for lp in raw_lps[0].top_logprobs[0])
    assert raw_lps[0].token_logprobs[0] < first.token_logprobs[0]  # the mask moved the mass to the allowed


def test_retraction_keeps_each_matcher_with_its_output(tiny):
    core = make_core(tiny, max_total_tokens=120, init_new_token_ratio=0.1)  # admits more than decode can hold
    regex = "[a-z]{150}"  # ~30 tokens of letters each
    reqs = [
        core.add_request(f"r{i}", [5 + i] * 12, sampled(100, i, StructuredOutput(kind="regex", spec=regex)))
        for i in range(6)
    ]
    while core.has_work:
        core.step()
        core.check_kv_invariants()
    assert core.retractions > 0 and any(r.num_retractions for r in reqs)
    for req in reqs:
        assert req.finish_reason.value == "stop", req.rid
        assert re.fullmatch(regex, text(tiny, req.output_ids)), text(tiny, req.output_ids)


def test_the_grammar_phase_is_timed_and_on_the_timeline(tiny, core):
    ids = encode(tiny, "Hi")
    core.add_request("g", ids, sampled(6, 1, json_so(SCHEMAS[2])))
    ring = StepRing(16)
    while core.has_work:
        core.step()
        ring.add(core.last_step, ("",) * len(core.last_step.rids), 1000)
    st = core.last_step
    assert st.grammar_seconds > 0 and st.sample_seconds > 0
    rec = ring.since(60)[-1]
    assert rec.grammar == int(st.grammar_seconds * 1e9)
    phases = [e["name"] for e in chrome_trace([(0, [rec])])["traceEvents"] if e.get("cat") == "phase"]
    assert phases == ["schedule", "forward", "sample", "grammar", "output"]
    core.add_request("plain", ids, sampled(2, 1, ignore_eos=True))
    core.run_to_completion()
    assert core.last_step.grammar_seconds == 0  # no grammar in the batch: nothing done


def test_the_samplers_floor_for_masked_rows_changes_no_draw():
    """A masked row's -inf logits are raised to EXP_FLOOR before the normaliser's exp (its fast path): the same
    sums to the last bit, so the same draws."""
    torch.manual_seed(0)
    logits = torch.randn(24, 49152) * 3
    logits[:, :40] += 10  # peaked, as a trained model's
    allowed = torch.rand(24, 49152) < torch.linspace(0.001, 1.0, 24)[:, None]
    masked = [i % 2 == 0 for i in range(24)]
    logits[torch.tensor(masked)] = logits[torch.tensor(masked)].masked_fill(
        ~allowed[torch.tensor(masked)], float("-inf")
    )
    peak = logits.max(-1, keepdim=True).values.double()
    assert torch.equal(_normaliser(logits, peak, masked), _normaliser(logits, peak, None))

    def rows():
        return [
            SimpleNamespace(
                params=SamplingParams(temperature=t),
                generator=torch.Generator().manual_seed(i),
                input_ids=[],
                output_ids=[],
            )
            for i, t in enumerate([1.0, 0.7, 1.5, 0.0] * 6)
        ]

    assert torch.equal(pick(logits, rows(), masked), pick(logits, rows()))


def test_a_bitmask_becomes_a_bias_over_the_logits_width():
    """Bit b of word w allows id 32w + b; ids past the tokenizer's vocabulary and the bitmask's width are -inf."""
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    for row, ids in enumerate(([0, 5, 33, 63], [31], [])):
        for i in ids:
            bitmask[row, i // 32] |= torch.tensor(1 << (i % 32)).to(torch.int32)  # bit 31: the sign bit
    for width in (36, 64, 70):
        bias = mask_bias(bitmask, vocab=40, width=width)
        assert bias.shape == (3, width)
        finite = [torch.isfinite(r).nonzero().flatten().tolist() for r in bias]
        assert finite == [[i for i in (0, 5, 33) if i < width], [31], []]
        assert torch.all(bias[torch.isfinite(bias)] == 0)
    assert allowed_counts(bitmask) == ([False, False, True], [False, True, False])
    logits = torch.randn(4, 36)
    want = logits.clone()
    apply_bias(logits, torch.tensor([3, 0, 1]), mask_bias(bitmask, vocab=40, width=36))
    assert torch.equal(logits[2], want[2])  # a row without a mask: untouched
    assert torch.equal(logits[3][[0, 5, 33]], want[3][[0, 5, 33]]) and torch.isinf(logits[3][1])


def test_an_eos_the_grammar_allows_ends_the_request_like_any_eos(tiny, core):
    """`[0-9]{1,8}` accepts after one digit and may go on: EOS is allowed there, and drawn it ends the request
    with `stop` (a special token: no text), the grammar complete."""
    ids = encode(tiny, "A number:")
    reqs = [
        core.add_request(f"n{i}", ids, sampled(16, i, StructuredOutput(kind="regex", spec="[0-9]{1,8}")))
        for i in range(16)
    ]
    out, end = run(core)
    eos = set(core.eos_ids)
    ended_on_eos = [r for r in reqs if r.output_ids[-1] in eos]
    assert ended_on_eos  # 1 token in ~11 allowed at each accepting step: some of 16 draw it
    for r in reqs:
        assert end[r.rid] == ("stop", None) and r.grammar.complete
        assert not eos & set(r.output_ids[:-1])
        assert re.fullmatch("[0-9]{1,8}", text(tiny, r.output_ids)), text(tiny, r.output_ids)


def test_the_scheduler_does_not_load_torch_dynamo():
    """llguidance.torch wraps a helper in torch.compile at import, which loads torch._dynamo (~2.5 s of every
    Scheduler start and restart): the engine fills masks through llguidance's own calls instead."""
    import subprocess
    import sys

    code = "import sys, serving.engine.scheduler; print('torch._dynamo' in sys.modules, 'llguidance' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
