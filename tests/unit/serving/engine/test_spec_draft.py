"""Speculation with a draft model (`--speculative draft`): a seeded small Llama pair (`tests.family_models.
draft_pair`: the target, and the target without its last layer) gives greedy outputs token for token those
without speculation (float32, and a Q8_0 GGUF target), sampled outputs the target's distribution (chi-square
over the engine's own tokens), keeps the draft's K/V to the request's tokens, and refuses pairs that do not fit."""

from __future__ import annotations

import gguf
import pytest
import torch

from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.engine.batch import Work
from serving.engine.loader import load_model
from serving.engine.request import Req
from serving.engine.sampling import adjust, probabilities
from serving.engine.spec_accept import draft_rows
from serving.engine.spec_draft import DraftProposer, parameter_count
from serving.model_errors import ModelLoadError
from tests.family_models import CUT_VOCAB, build, draft_pair
from tests.gguf_writer import write_gguf
from tests.helpers import assert_distributed_as, collect, encode, greedy, make_core, run_requests

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def pair():
    target, draft = draft_pair()
    return load_model(str(target)), str(draft)


def _requests(ids: list[int], stop: int | None = None) -> list[tuple[str, list[int], SamplingParams]]:
    """Three greedy requests of different lengths; the third stopped by `stop` where given."""
    return [
        ("a", ids, greedy(40)),
        ("b", ids[:-3], greedy(24, min_tokens=3)),
        ("c", ids[:-5], greedy(30, stop_token_ids=[stop] if stop is not None else [])),
    ]


def _identity(target, draft: str, **kw):
    """Greedy outputs with the draft's speculation are those without; a stop token inside an accepted run ends
    the request there.  Both pools are empty after."""
    ids = encode(target, PROMPT)
    reference = run_requests(make_core(target, max_total_tokens=1024, **kw), _requests(ids), check=False)
    stop = reference["c"][6]
    reference["c"] = reference["c"][: reference["c"].index(stop) + 1]
    core = make_core(target, max_total_tokens=1024, speculative="draft", speculative_model=draft, **kw)
    assert run_requests(core, _requests(ids, stop)) == reference
    assert core.pool.is_idle() and core.spec.proposer.pool.is_empty() and not core.spec.proposer.seqs
    return core.spec


def test_greedy_outputs_are_those_without_speculation(pair):
    spec = _identity(*pair)
    assert spec.method == "draft" and spec.proposed > spec.accepted > spec.proposed / 2  # drafts land, not all


def test_greedy_identity_with_a_gguf_target_in_its_own_type(tmp_path):
    target, draft = draft_pair(vocab=CUT_VOCAB)
    q8 = write_gguf(target, tmp_path / "q8.gguf", qtype=lambda name, shape: gguf.GGMLQuantizationType.Q8_0)
    spec = _identity(load_model(str(q8), cache_dir=tmp_path / "cache"), str(draft), quantization="gguf")
    assert spec.accepted > 0


def test_sampled_tokens_keep_the_targets_distribution():
    """Many seeded requests of 3 tokens at temperature 1: the second token of each is the first a verify step
    gives (a one-token draft, kept or refused by the acceptance rule); for the commonest first token, the second
    is distributed as the target's own distribution after it."""
    target, draft = draft_pair(vocab=CUT_VOCAB)
    model = load_model(str(target))
    ids = encode(model, "Once upon a time")
    params = dict(max_new_tokens=3, temperature=1.0, top_k=20, ignore_eos=True)
    core = make_core(
        model, max_total_tokens=512, max_running_requests=4, speculative="draft", speculative_model=str(draft)
    )
    reqs = [core.add_request(f"s{i}", ids, SamplingParams(seed=i, **params)) for i in range(800)]
    outs = collect(core)
    counts = [(r.spec.counts.proposed, r.spec.counts.accepted, r.spec.counts.steps) for r in reqs]
    assert set(counts) <= {(1, 1, 2), (1, 0, 3)}, set(counts)  # each second token verified, drafts kept or not
    accepted = sum(r.spec.counts.accepted for r in reqs)
    assert 0.2 * len(reqs) < accepted < 0.95 * len(reqs)  # drafts kept and refused
    first = max(set(o[0] for o in outs.values()), key=lambda t: sum(o[0] == t for o in outs.values()))
    seconds = torch.zeros(model.hf_model.config.vocab_size, dtype=torch.float64)
    for o in outs.values():
        if o[0] == first:
            seconds[o[1]] += 1
    plain = make_core(model, max_total_tokens=64)
    row = plain.pool.admit(len(ids) + 1)
    logits = plain.runner.forward([], [Work(row, 0, [*ids, first], True)])
    req = reqs[0]  # its params; the rows' output: the first token
    rows = draft_rows(req, [])
    rows[0].output_ids = [first]
    assert_distributed_as(seconds, probabilities(adjust(logits, rows, frozenset()), rows)[0], least=400)


def test_the_drafts_kv_follows_the_kept_tokens(pair, monkeypatch):
    """After each verify (some draft tokens kept, the rest refused, a token of the target's own appended) the
    draft proposes what a draft that never saw the request proposes for its tokens now: the refused positions'
    K/V is gone, the kept ones' reused.  A step that failed and ran again (tokens the draft saw are not the
    request's) is caught up the same way, and a draft forward that fails proposes nothing."""
    target, draft = pair
    args = ServerArgs(
        model=target.name,
        dtype="float32",
        quantization="none",
        max_total_tokens=256,
        speculative="draft",
        speculative_model=draft,
    )
    proposer, fresh = DraftProposer(target, args), DraftProposer(target, args)
    req = Req("r", encode(target, PROMPT), SamplingParams(), torch.Generator(), output_ids=[])
    for i, kept in enumerate((0, 3, 1, 4, 2)):
        guess = proposer.propose(req, 4)
        alone = Req(f"f{i}", req.input_ids, req.params, req.generator, output_ids=list(req.output_ids))
        assert guess == fresh.propose(alone, 4) and len(guess) == 4
        fresh.forget(alone)
        proposer.verified(req, 4, kept)
        assert proposer.seqs["r"].tokens == req.seq + guess[: min(kept, 3)]  # the last guess was never fed
        req.output_ids += guess[:kept] + [(guess[kept] + 1) % 1000 if kept < 4 else 5]
    req.output_ids[-1] += 1  # the last token changed under the draft: it recomputes that position
    alone = Req("g", req.input_ids, req.params, req.generator, output_ids=list(req.output_ids))
    held = proposer.pool.free_slots
    with monkeypatch.context() as m:  # a draft forward that fails: no draft, nothing held, nothing counted
        m.setattr(proposer.runner.model, "forward", lambda fb, kv: 1 / 0)
        assert proposer.propose_all([(req, 3), (alone, 2)]) == [[], []]
    assert proposer.pool.free_slots == held and "g" in proposer.seqs  # a row for the new one, no slots
    proposer.forget(alone)
    assert proposer.propose(req, 3) == fresh.propose(alone, 3)
    proposer.forget(req)
    fresh.forget(alone)
    assert proposer.pool.is_empty() and fresh.pool.is_empty()


def test_pairs_that_do_not_fit_fail_at_startup(pair):
    target, draft = pair
    with pytest.raises(ModelLoadError, match="does not share .* tokenizer"):
        make_core(target, speculative="draft", speculative_model=str(build("llama", vocab=CUT_VOCAB)))
    with pytest.raises(ModelLoadError, match="has more parameters .* a draft must be the smaller model"):
        make_core(load_model(draft), speculative="draft", speculative_model=str(target.path))
    small = load_model(draft).hf_model.config
    assert parameter_count(small) < parameter_count(target.hf_model.config)


def test_bad_flags_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="--speculative draft and --speculative-model go together"):
        ServerArgs(speculative="draft")
    with pytest.raises(ValueError, match="--speculative draft and --speculative-model go together"):
        ServerArgs(speculative="ngram", speculative_model="smollm2-135m")
    with pytest.raises(ValueError, match=r"--speculative-num-tokens must be in \[1, 16\]"):
        ServerArgs(speculative="draft", speculative_model="x", speculative_num_tokens=17)
