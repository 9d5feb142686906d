"""Log-probabilities, logit_bias and min_tokens in the engine, checked against transformers' own forward of
the whole sequence on the same weights (tiny-random, float32): sampled tokens' logprobs in both
--logprobs-mode, prompt logprobs chunked and with the prefix cache warm, and the sampler's order."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.io_struct import BatchTokenIDOutput, Logprobs, TokenOut
from protocol.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from serving.args import ServerArgs
from serving.engine.sampling import sample
from serving.ipc import Codec
from telemetry.step_timeline import StepRing, chrome_trace
from tests.helpers import PROMPTS, encode, greedy, make_core, one_thread

TOL = 1e-4  # float32; tiny-random's logits are small, the observed error is ~1e-6


def _reference(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids` [len, V]."""
    with torch.inference_mode(), one_thread():
        return torch.log_softmax(model.hf_model(torch.tensor([ids])).logits[0].double(), dim=-1)


def _run(core, rid: str, ids: list[int], params: SamplingParams):
    """(tokens, one Logprobs per token or None, the Req) of one request run to completion."""
    req = core.add_request(rid, ids, params)
    tokens, lps = [], []
    for ev in core.run_to_completion():
        if ev.rid == rid:
            tokens += ev.new_token_ids
            lps += [ev.logprobs] * len(ev.new_token_ids)
    return tokens, lps, req


def _prompt(model) -> list[int]:
    return encode(model, PROMPTS[1] + " " + PROMPTS[3])


def test_greedy_logprobs_equal_a_direct_forward(tiny):
    ids = encode(tiny, PROMPTS[0])
    tokens, lps, _ = _run(make_core(tiny), "g", ids, greedy(8, ignore_eos=True, logprobs=5))
    ref = _reference(tiny, ids + tokens)
    for j, (tok, lp) in enumerate(zip(tokens, lps)):
        row = ref[len(ids) - 1 + j]
        assert len(lp.token_logprobs) == len(lp.top_ids) == len(lp.top_logprobs) == 1
        assert abs(lp.token_logprobs[0] - row[tok].item()) < TOL
        top = lp.top_logprobs[0]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert lp.top_ids[0][0] == tok and top[0] == lp.token_logprobs[0]  # greedy: its token is the top one
        want, want_ids = torch.topk(row, 5)
        assert lp.top_ids[0] == want_ids.tolist()
        assert max(abs(a - b) for a, b in zip(top, want.tolist())) < TOL


def test_logprobs_zero_gives_own_only_and_others_pay_nothing(tiny):
    core = make_core(tiny)
    ids = encode(tiny, PROMPTS[2])
    core.add_request("lp", ids, greedy(4, ignore_eos=True, logprobs=0))
    core.add_request("plain", ids, greedy(4, ignore_eos=True))
    events = core.run_to_completion()
    own = [e.logprobs for e in events if e.rid == "lp" and e.new_token_ids]
    assert len(own) == 4 and all(len(lp.token_logprobs) == 1 and lp.top_ids == [] for lp in own)
    assert all(e.logprobs is None for e in events if e.rid == "plain")
    assert core.last_step.logprobs_seconds > 0
    core.add_request("alone", ids, greedy(2, ignore_eos=True))
    core.run_to_completion()
    assert core.last_step.logprobs_seconds == 0


def test_processed_and_raw_modes_with_temperature(tiny):
    ids = encode(tiny, PROMPTS[4])
    params = SamplingParams(max_new_tokens=6, temperature=0.5, seed=7, ignore_eos=True, logprobs=3)
    processed = _run(make_core(tiny), "p", ids, params)
    raw = _run(make_core(tiny, logprobs_mode="raw"), "r", ids, params)
    assert processed[0] == raw[0]  # the mode changes what is reported, never what is sampled
    ref = _reference(tiny, ids + processed[0])
    with torch.inference_mode(), one_thread():
        logits = tiny.hf_model(torch.tensor([ids + processed[0]])).logits[0].double()
    scaled = torch.log_softmax(logits / 0.5, dim=-1)
    for j, tok in enumerate(processed[0]):
        pos = len(ids) - 1 + j
        p, r = processed[1][j], raw[1][j]
        assert abs(p.token_logprobs[0] - scaled[pos, tok].item()) < TOL
        assert abs(r.token_logprobs[0] - ref[pos, tok].item()) < TOL
        assert abs(p.token_logprobs[0] - r.token_logprobs[0]) > 1e-3  # the temperature shows
        assert p.top_ids == r.top_ids  # dividing by a temperature keeps the order


@pytest.mark.parametrize("chunk", [512, 5])
def test_prompt_logprobs_equal_a_direct_forward(tiny, chunk):
    ids = _prompt(tiny)
    core = make_core(tiny, max_prefill_tokens=chunk)
    tokens, _, req = _run(core, "p", ids, greedy(3, ignore_eos=True, prompt_logprobs=2))
    if chunk < len(ids):
        assert len(req.times.prefill_chunks) == math.ceil(len(ids) / chunk)
    ref = _reference(tiny, ids)
    lp = req.prompt_logprobs
    assert len(lp.token_logprobs) == len(lp.top_ids) == len(ids) - 1
    for i, got in enumerate(lp.token_logprobs):
        assert abs(got - ref[i, ids[i + 1]].item()) < TOL
        want, want_ids = torch.topk(ref[i], 2)
        assert lp.top_ids[i] == want_ids.tolist()
        assert lp.top_logprobs[i] == sorted(lp.top_logprobs[i], reverse=True)
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs[i], want.tolist())) < TOL
    assert tokens == _run(make_core(tiny), "plain", ids, greedy(3, ignore_eos=True))[0]  # sampling unchanged


@pytest.mark.parametrize("chunk", [512, 5])
def test_prompt_logprobs_with_the_prefix_cache_warm(tiny, chunk):
    ids = _prompt(tiny)
    core = make_core(tiny, max_prefill_tokens=chunk)
    _, _, first = _run(core, "a", ids, greedy(2, ignore_eos=True, prompt_logprobs=1))
    assert core.prefix_cached_tokens >= len(ids)  # a scoring request still fills the cache
    _, _, second = _run(core, "b", ids, greedy(2, ignore_eos=True, prompt_logprobs=1))
    assert second.cached_tokens == 0 and second.prompt_cache_held == len(ids) - 1  # recomputed to be scored
    assert len(second.prompt_logprobs.token_logprobs) == len(ids) - 1
    for a, b in zip(first.prompt_logprobs.token_logprobs, second.prompt_logprobs.token_logprobs):
        assert abs(a - b) < 1e-5
    assert first.prompt_logprobs.top_ids == second.prompt_logprobs.top_ids
    _, _, plain = _run(core, "c", ids, greedy(2, ignore_eos=True))
    assert plain.cached_tokens == len(ids) - 1 and plain.prompt_logprobs is None  # others still reuse it
    core.check_kv_invariants()


def test_prompt_logprobs_survive_retraction_without_duplicates(tiny):
    params = greedy(60, ignore_eos=True, prompt_logprobs=1)
    prompts = [[5 + i] + _prompt(tiny)[:9] for i in range(4)]
    alone = make_core(tiny, max_total_tokens=1024)
    want = {i: _run(alone, f"a{i}", p, params)[2].prompt_logprobs for i, p in enumerate(prompts)}
    core = make_core(tiny, max_total_tokens=120, max_prefill_tokens=6, min_prefill_chunk=6)
    reqs = [core.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    core.run_to_completion()
    assert core.retractions
    for i, req in enumerate(reqs):
        got = req.prompt_logprobs
        assert len(got.token_logprobs) == len(prompts[i]) - 1 and got.top_ids == want[i].top_ids
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, want[i].token_logprobs)) < 1e-5


def test_logit_bias_forces_and_bans(tiny):
    ids = encode(tiny, PROMPTS[0])
    base = _run(make_core(tiny), "b", ids, greedy(6, ignore_eos=True))[0]
    forced = next(t for t in range(100, 200) if t not in base)
    assert _run(make_core(tiny), "f", ids, greedy(6, ignore_eos=True, logit_bias={forced: 100.0}))[0] == [forced] * 6
    banned = _run(make_core(tiny), "n", ids, greedy(6, ignore_eos=True, logit_bias={base[0]: -100.0}))[0]
    assert base[0] not in banned and banned != base


def test_min_tokens_keeps_a_stop_token_from_ending_it(tiny):
    ids = encode(tiny, PROMPTS[1])
    base = _run(make_core(tiny), "b", ids, greedy(8, ignore_eos=True))[0]
    stop = base[1]
    early, _, req = _run(make_core(tiny), "e", ids, greedy(8, ignore_eos=True, stop_token_ids=[stop]))
    assert early == base[:2] and req.matched_stop == stop
    held, lps, req = _run(
        make_core(tiny), "m", ids, greedy(8, ignore_eos=True, stop_token_ids=[stop], min_tokens=5, logprobs=3)
    )
    assert len(held) >= 5 and stop not in held[:5]
    assert all(stop not in lp.top_ids[0] for lp in lps[:5])  # masked: not even an alternative


def test_sampler_masks_eos_below_min_tokens():
    class Row:
        def __init__(self, params, out):
            self.params, self.input_ids, self.output_ids = params, [], out
            self.generator = torch.Generator().manual_seed(0)

    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 3)
    rows = [
        Row(greedy(8, min_tokens=2), []),
        Row(greedy(8, min_tokens=2), [1, 1]),
        Row(greedy(8, min_tokens=2, ignore_eos=True), []),
    ]
    assert sample(logits, rows, eos=frozenset({2})) == [3, 2, 2]  # EOS 2 masked for the first row only


@pytest.mark.parametrize(
    "field,value",
    [
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("min_tokens", 9),
        ("min_tokens", -1),
        ("logit_bias", {100: 1.0}),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {1: float("-inf")}),
        ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} ") as err:
        SamplingParams(max_new_tokens=8, **{field: value}).validate(vocab_size=100)
    assert "got" in str(err.value)


def test_validation_accepts_the_bounds():
    for kw in (
        {"logprobs": 0},
        {"logprobs": 20},
        {"prompt_logprobs": 20},
        {"min_tokens": 8},
        {"logit_bias": {0: -100.0, 99: 100.0}},
    ):
        SamplingParams(max_new_tokens=8, **kw).validate(vocab_size=100)


def test_token_out_with_logprobs_round_trips_msgpack():
    lp = Logprobs(token_logprobs=[-0.5, -1.25], top_ids=[[3, 4], [5, 6]], top_logprobs=[[-0.5, -2.0], [-1.0, -1.25]])
    prompt = Logprobs(token_logprobs=[-3.0, float("-inf")])
    msg = BatchTokenIDOutput(outputs=[TokenOut(rid="r", new_token_ids=[3, 6], logprobs=lp, prompt_logprobs=prompt)])
    codec = Codec("test")
    back = codec.decode(codec.encode(msg))
    assert back.outputs[0].logprobs == lp and back.outputs[0].prompt_logprobs.token_logprobs == [-3.0, float("-inf")]
    assert back.outputs[0].prompt_logprobs.top_ids == []


def test_logprobs_phase_reaches_the_step_timeline(tiny):
    core = make_core(tiny)
    core.add_request("p", _prompt(tiny), greedy(1, prompt_logprobs=3))
    core.step()
    st = core.last_step
    assert st.logprobs_seconds > 0 and st.sample_seconds > 0
    ring = StepRing(8)
    ring.add(st, ("",), 1000)
    (rec,) = ring.since(60)
    assert rec.logprobs == int(st.logprobs_seconds * 1e9)
    phases = [e for e in chrome_trace([(0, [rec])])["traceEvents"] if e.get("cat") == "phase"]
    assert [e["name"] for e in phases] == ["schedule", "forward", "sample", "logprobs", "output"]


def test_logprobs_mode_flag_is_checked():
    assert ServerArgs(logprobs_mode="raw").logprobs_mode == "raw"
    with pytest.raises(ValueError, match="--logprobs-mode must be processed or raw"):
        ServerArgs(logprobs_mode="logits")
