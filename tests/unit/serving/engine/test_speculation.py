"""Speculative decoding in the engine: prompt lookup proposes what followed the suffix before; verified drafts
give greedy outputs token for token those without speculation (every family's seeded model, float32 and a
GGUF type), sampled ones the same distribution (chi-square), and the KV bookkeeping stays exact."""

from __future__ import annotations

import itertools

import gguf
import pytest
import torch

from protocol.sampling_params import SamplingParams, StructuredOutput
from serving.args import ServerArgs
from serving.engine.loader import load_model
from serving.engine.request import MAX_SPEC_RUNS, Req
from serving.engine.spec_accept import accept
from serving.engine.spec_propose import INDEX_PER_STEP, NgramProposer, Proposer
from serving.engine.speculation import (
    ALPHA_PRIOR,
    ALPHA_PROBE,
    DRAFT_ROW_COST,
    QUANT_ROW_COST,
    VERIFY_STEP_COST,
    Speculator,
    batch_row_cost,
    best_k,
)
from serving.model_errors import ModelLoadError
from tests import encoder_models
from tests.family_models import CUT_VOCAB, FAMILIES, build
from tests.gguf_writer import write_gguf
from tests.helpers import assert_distributed_as, encode, greedy, make_core, one_thread, run_requests

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"


_rids = itertools.count()


def _req(ids: list[int], out: list[int] = (), **params) -> Req:
    rid = f"r{next(_rids)}"
    return Req(rid, list(ids), SamplingParams(**params), torch.Generator().manual_seed(0), output_ids=list(out))


# -- the proposer ---------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_longest_suffix():
    p = NgramProposer(1, 3)
    # suffix [7, 8, 9] occurred at 0 (followed by 1, 2); [8, 9] also at 5 (followed by 4): the longest wins
    assert p.propose(_req([7, 8, 9, 1, 2, 8, 9, 4, 7, 8, 9]), 2) == [1, 2]
    assert p.propose(_req([5, 6, 5]), 4) == [6, 5]  # a run reaching the end is cut there
    assert p.propose(_req([1, 2, 3]), 4) == []  # nothing repeats
    assert NgramProposer(2, 3).propose(_req([1, 2, 3, 1]), 4) == []  # a 1-gram is below the minimum


def test_the_latest_occurrence_proposes_and_the_index_follows_the_output():
    p = NgramProposer(2, 2)
    req = _req([1, 2, 3, 1, 2, 4, 1, 2])
    assert p.propose(req, 1) == [4]  # [1, 2] last occurred before 4
    req.output_ids += [5, 1, 2]  # tokens appended since: indexed incrementally
    assert p.propose(req, 2) == [5, 1]
    p.forget(req)
    assert not p.index


def test_incremental_index_matches_a_brute_force_search():
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 6, (300,), generator=gen).tolist()
    p = NgramProposer(2, 4)
    req = _req(seq[:20])
    for end in range(20, 300):
        req.output_ids = seq[20:end]
        got = p.propose(req, 3)
        want = []
        for n in range(4, 1, -1):
            suffix = seq[end - n : end]
            starts = [i for i in range(end - n) if seq[i : i + n] == suffix]
            if starts:
                want = seq[starts[-1] + n : min(end, starts[-1] + n + 3)]
                break
        assert got == want, end


def test_a_long_prompt_is_indexed_over_several_lookups():
    seq = [i % 1000 for i in range(3 * INDEX_PER_STEP)] + [7, 8]  # 7, 8 last occurred at 1007
    p = NgramProposer(2, 2)
    req = _req(seq)
    looked = [p.propose(req, 2) for _ in range(4)]
    assert p.index[req.rid].upto == len(seq) - 1
    assert looked[-1] == [9, 10] and looked[0] == [9, 10]  # the first lookup saw 7, 8 at 7 already


# -- the acceptance rule --------------------------------------------------------------------
def test_greedy_keeps_the_draft_while_it_is_the_argmax():
    logits = torch.full((4, 10), -5.0)
    logits[0, 3] = logits[1, 4] = logits[2, 7] = logits[3, 1] = 5.0
    req = _req([0], temperature=0.0)
    assert accept(logits, req, [3, 4, 5], frozenset()) == [3, 4, 7]  # 5 refused: the target's 7 instead
    assert accept(logits, req, [3, 4, 7], frozenset()) == [3, 4, 7, 1]  # all kept, plus the last row's
    assert accept(logits, req, [2, 4, 7], frozenset()) == [3]
    # min_tokens masks EOS (9) per row as if the draft had been sampled: row 0 cannot end it, row 1 can
    logits[0, 9] = logits[1, 9] = 9.0
    assert accept(logits, _req([0], temperature=0.0, min_tokens=1), [3, 4], frozenset({9})) == [3, 9]


def test_penalties_see_the_draft_before_each_row():
    logits = torch.zeros(2, 5)
    logits[:, 2] = 1.0
    logits[:, 3] = 0.9
    req = _req([0], temperature=0.0, presence_penalty=0.5)
    assert accept(logits, req, [2], frozenset()) == [2, 3]  # row 1 penalises the drafted 2


def test_sampled_acceptance_keeps_the_targets_distribution():
    """The real logits of a small-vocabulary model for a prompt and a 2-token draft: the first emitted token
    is distributed as row 0's distribution, and after a kept draft token the next as row 1's."""
    model = load_model(str(build("llama", vocab=CUT_VOCAB)))
    core = make_core(model, max_total_tokens=256)
    ids = encode(model, "Once upon a time")
    from serving.engine.batch import Work

    params = dict(temperature=1.0, top_k=30, repetition_penalty=1.1)
    p0_req = _req(ids, **params)
    row = core.pool.admit(len(ids) + 3)
    first = core.runner.forward([], [Work(row, 0, ids[:-1], False)] if len(ids) > 1 else [])
    fed = [Work(row, len(ids) - 1, [ids[-1]], True)]
    draft = [int(core.runner.forward(fed, [])[0].argmax()), 0]  # the likeliest token (often kept, often not), then any
    core.pool.free(core.pool.req_to_token[row, len(ids) - 1 : len(ids)].clone())
    fed += [Work(row, len(ids) + i, [t], True) for i, t in enumerate(draft)]
    logits = core.runner.forward(fed, [])  # as a verify step computes them: one decode row a position
    assert first.shape[0] == 0 and logits.shape[0] == 3
    from serving.engine.sampling import adjust, probabilities
    from serving.engine.spec_accept import draft_rows

    adj_rows = draft_rows(p0_req, draft)
    probs = probabilities(adjust(logits, adj_rows, frozenset()), adj_rows)
    n = 4000
    firsts = torch.zeros(logits.shape[-1], dtype=torch.float64)
    seconds = torch.zeros_like(firsts)
    with one_thread():
        for seed in range(n):
            req = _req(ids, **params)
            req.generator.manual_seed(seed)
            out = accept(logits, req, draft, frozenset())
            firsts[out[0]] += 1
            if out[0] == draft[0]:
                seconds[out[1]] += 1
    for observed, p in ((firsts, probs[0]), (seconds, probs[1])):
        assert_distributed_as(observed, p)


# -- the engine: greedy identity, the KV bookkeeping ---------------------------------------------------
class Oracle(Proposer):
    """Proposes each request's known greedy continuation, every third draft with its last token wrong: drafts
    that land wholly and partly, through the same interface as prompt lookup."""

    method = "ngram"

    def __init__(self, reference: dict[str, list[int]]) -> None:
        self.reference, self.calls = reference, 0

    def propose(self, req: Req, k: int) -> list[int]:
        self.calls += 1
        draft = self.reference[req.rid][len(req.output_ids) : len(req.output_ids) + k]
        if draft and self.calls % 3 == 0:
            draft[-1] = (draft[-1] + 1) % 100
        return draft

    def verified(self, req: Req, proposed: int, accepted: int) -> None:
        pass

    def forget(self, req: Req) -> None:
        pass


def _identity(model, **kw) -> tuple[Speculator, NgramProposer]:
    """The speculator that gave the same greedy tokens, and the prompt lookup its flags made (the oracle's)."""
    ids = encode(model, PROMPT)
    requests = [(f"r{i}", ids[: len(ids) - 3 * i], greedy(24 - 5 * i)) for i in range(3)]
    reference = run_requests(make_core(model, max_total_tokens=1024, **kw), requests, check=False)
    core = make_core(model, max_total_tokens=1024, speculative="ngram", speculative_num_tokens=5, **kw)
    lookup, core.spec.proposer = core.spec.proposer, Oracle(reference)
    assert run_requests(core, requests) == reference
    assert core.spec.accepted > core.spec.proposed / 2 > 0
    return core.spec, lookup


@pytest.mark.parametrize("family", ("tiny-random", *FAMILIES))
def test_greedy_outputs_are_those_without_speculation(family):
    spec, lookup = _identity(load_model(family if family == "tiny-random" else str(build(family))))
    # float weights: draft rows share the decode's pass over them, and one-token keys' guesses pay
    assert spec.row_cost == DRAFT_ROW_COST and spec.step_cost == VERIFY_STEP_COST and lookup.n_min == 1


def test_greedy_identity_on_a_gguf_file_served_in_its_own_type(tmp_path):
    path = write_gguf(
        build("qwen2", vocab=CUT_VOCAB), tmp_path / "q8.gguf", qtype=lambda name, shape: gguf.GGMLQuantizationType.Q8_0
    )
    spec, lookup = _identity(load_model(str(path), cache_dir=tmp_path / "cache"), quantization="gguf")
    assert spec.row_cost == QUANT_ROW_COST and spec.step_cost == 0.0 and lookup.n_min == 2  # its rows cost more


def test_prompt_lookup_on_a_copying_output_stays_exact(tiny):
    """Real prompt lookup on a repetitive prompt: a stop token id inside an accepted run ends the request there,
    and its K/V past it is freed (the invariants, and an idle pool after)."""
    ids = encode(tiny, PROMPT)
    requests = [("a", ids, greedy(30)), ("b", ids[:-2], greedy(12, min_tokens=3))]
    reference = run_requests(make_core(tiny, max_total_tokens=1024), requests, check=False)
    stop = reference["a"][5]
    requests.append(("c", ids, greedy(30, stop_token_ids=[stop])))
    reference["c"] = reference["a"][: reference["a"].index(stop) + 1]
    core = make_core(tiny, max_total_tokens=1024, speculative="ngram", speculative_ngram_min=1)
    core.spec.proposer = Oracle(reference)
    assert run_requests(core, requests) == reference


def test_sampled_runs_keep_the_books_and_reproduce_with_a_seed(tiny):
    """Sampled requests with penalties and cuts, drafts landing and not: every step's KV bookkeeping holds, each
    request's tokens are accepted + steps, and a seeded run gives the same tokens again."""
    ids = encode(tiny, PROMPT)
    reference = run_requests(make_core(tiny, max_total_tokens=1024), [("g", ids, greedy(24))], check=False)["g"]

    def run() -> tuple[dict[str, list[int]], dict[str, object]]:
        core = make_core(tiny, max_total_tokens=1024, speculative="ngram")
        core.spec.proposer = Oracle({f"s{i}": reference for i in range(3)})
        params = [
            SamplingParams(max_new_tokens=24, temperature=0.3, seed=1, ignore_eos=True),
            SamplingParams(max_new_tokens=24, temperature=0.4, top_p=0.9, min_p=0.05, seed=2, ignore_eos=True),
            SamplingParams(max_new_tokens=24, temperature=0.3, repetition_penalty=1.2, min_tokens=4, seed=3),
        ]
        reqs = {f"s{i}": core.add_request(f"s{i}", ids, p) for i, p in enumerate(params)}
        return run_requests(core, []), {rid: r.spec.counts for rid, r in reqs.items()}

    (outs, counts), (again, _) = run(), run()
    assert outs == again
    assert sum(c.proposed for c in counts.values()) > sum(c.accepted for c in counts.values()) > 0
    assert all(len(outs[rid]) <= c.accepted + c.steps for rid, c in counts.items())  # a stop may cut a run
    assert all(len(outs[rid]) == 24 == counts[rid].accepted + counts[rid].steps for rid in ("s0", "s1"))


def test_who_is_speculated(tiny):
    core = make_core(tiny, max_total_tokens=512, speculative="ngram")
    ids = encode(tiny, PROMPT)
    cases = {
        "plain": SamplingParams(max_new_tokens=4),
        "opted_out": SamplingParams(max_new_tokens=4, speculative=False),
        "logprobs": SamplingParams(max_new_tokens=4, logprobs=0),
        "grammar": SamplingParams(max_new_tokens=4, structured=StructuredOutput(kind="regex", spec="[ab]+")),
    }
    reqs = {rid: core.add_request(rid, ids, p) for rid, p in cases.items()}
    assert {rid for rid, r in reqs.items() if r.spec is not None} == {"plain"}
    for rid in cases:
        core.abort(rid)


class _Pool:
    """What `settle` touches of the KV pool: the slot table, and the slots it frees."""

    def __init__(self) -> None:
        self.req_to_token = torch.arange(64).reshape(1, 64)
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()


def test_draft_length_follows_the_acceptance_pauses_and_frees_the_rejected_slots():
    assert [best_k(a, 5, cost=0.22) for a in (0.1, 0.5, 0.7, 0.9, 1.0)] == [0, 1, 3, 5, 5]
    assert [best_k(a, 5) for a in (0.04, 0.1, 0.3, 0.5, 0.7)] == [0, 1, 2, 3, 5]  # cheap rows: longer drafts
    assert batch_row_cost(1) == DRAFT_ROW_COST < batch_row_cost(2) < batch_row_cost(8) < 1.0
    assert best_k(0.9, 16) > best_k(0.9, 5) and best_k(0.9, 16, cost=1.0) == 0  # costly rows never pay
    # a verify step's own cost: free text's rare guesses (a few % kept) stop paying, copying still does
    assert best_k(0.07, 5) == 1 and best_k(0.07, 5, fixed=VERIFY_STEP_COST) == 0
    assert best_k(0.4, 5, fixed=VERIFY_STEP_COST) >= 2
    spec = Speculator(NgramProposer(1, 2), 5, 128)
    req = _req([1, 2, 1, 2, 1, 2], temperature=0.0)
    req.row, req.max_new_tokens = 0, 100
    pool = _Pool()
    spec.attach(req)
    assert req.spec.k == best_k(ALPHA_PRIOR, 5)

    def verify(kept: int) -> None:
        spec.propose([req], room=100, step_tokens=1)
        req.spec.draft = [1] * req.spec.k  # whatever the lookup said: a draft of the current length
        req.num_computed, pool.freed = 6, []  # its last token's position (5) counted computed
        proposed = len(req.spec.draft)
        spec.settle(req, [1] * (min(kept, proposed) + 1), pool)
        kept = min(kept, proposed)
        assert req.num_computed == 6 + kept and pool.freed == list(range(6 + kept, 6 + proposed))

    ks = []
    for _ in range(4):  # every draft token kept: longer drafts
        verify(16)
        ks.append(req.spec.k)
    assert ks == sorted(ks) and ks[-1] == 5
    proposed = req.spec.counts.proposed
    assert req.spec.counts.accepted == proposed
    while not req.spec.paused:  # nothing kept: shorter drafts, then a pause
        verify(0)
    spec.propose([req], room=100, step_tokens=1)
    assert req.spec.draft == []  # paused: no lookup this step
    assert req.spec.counts.accepted == proposed and req.spec.alpha == DRAFT_ROW_COST + ALPHA_PROBE and req.spec.k == 1
    # each verify step recorded for the span's timeline (its tokens not yet appended: the run starts at index 0
    # here), adding up to the counts, and at most MAX_SPEC_RUNS of them while the counts go on
    runs = req.spec.runs
    assert [i for i, *_ in runs] == [0] * len(runs) and len(runs) >= 5
    assert sum(p for _, p, _ in runs) == req.spec.counts.proposed and sum(k for *_, k in runs) == proposed
    req.spec.paused = 0
    while req.spec.counts.steps < MAX_SPEC_RUNS + 3:
        req.spec.k = 1
        verify(1)
        req.spec.counts.steps += 1
    assert len(req.spec.runs) == MAX_SPEC_RUNS and req.spec.counts.proposed > sum(p for _, p, _ in req.spec.runs)


def test_an_encoder_cannot_speculate():
    with pytest.raises(ModelLoadError, match="needs a generative model"):
        make_core(load_model(str(encoder_models.build())), speculative="ngram")


def test_bad_flags_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="--speculative must be one of off, ngram"):
        ServerArgs(speculative="eagle")
    with pytest.raises(ValueError, match=r"--speculative-num-tokens must be in \[1, 16\]"):
        ServerArgs(speculative="ngram", speculative_num_tokens=0)
    for n_min in (5, -1):
        with pytest.raises(ValueError, match="min <= max"):
            ServerArgs(speculative="ngram", speculative_ngram_min=n_min, speculative_ngram_max=3)
    ServerArgs(speculative="ngram", speculative_ngram_min=0, speculative_ngram_max=1)  # 0: from the precision
