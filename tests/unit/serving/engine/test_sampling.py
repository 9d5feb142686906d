"""Sampling: seeds reproduce whoever shares the batch; top-k=1 is greedy; penalties act as defined."""

from __future__ import annotations

import msgspec
import pytest
import torch

from protocol.sampling_params import MAX_STOP_TOKEN_IDS, MAX_TOP_K, SamplingParams
from serving.engine.sampling import apply_penalties, sample
from tests.helpers import PROMPTS, collect, encode, greedy, make_core


class Row:
    def __init__(self, params, input_ids=(), output_ids=(), seed=0):
        self.params = params
        self.input_ids = list(input_ids)
        self.output_ids = list(output_ids)
        self.generator = torch.Generator().manual_seed(seed)


def _run(model, requests):
    core = make_core(model, max_total_tokens=1024)
    for rid, prompt, params in requests:
        core.add_request(rid, encode(model, prompt), params)
    return collect(core)


def _run_each(model, requests) -> list[list[int]]:
    """Each request alone on one engine, in turn, the cache flushed between them: as on engines of their own."""
    core = make_core(model, max_total_tokens=1024)
    outs = []
    for rid, prompt, params in requests:
        core.add_request(rid, encode(model, prompt), params)
        outs.append(collect(core)[rid])
        assert core.pool.is_idle() and core.flush_cache() and core.pool.is_empty()
    return outs


def test_seeded_request_reproduces_regardless_of_batch_mates(tiny):
    p = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    alone = _run(tiny, [("s", PROMPTS[0], p)])["s"]
    mates = [
        (f"m{i}", PROMPTS[i], SamplingParams(max_new_tokens=10 + i, temperature=0.9, seed=100 + i)) for i in range(1, 5)
    ]
    crowded = _run(tiny, mates[:2] + [("s", PROMPTS[0], p)] + mates[2:])["s"]
    again = _run(tiny, [("s", PROMPTS[0], p)])["s"]
    other_seed = _run(tiny, [("s", PROMPTS[0], msgspec.structs.replace(p, seed=43))])["s"]
    assert alone == crowded == again
    assert alone != other_seed  # the seed is actually used
    greedy_out = _run(tiny, [("g", PROMPTS[0], greedy(24, ignore_eos=True))])["g"]
    assert alone != greedy_out  # temperature 1 on tiny-random does sample


def test_top_k_1_equals_greedy(smollm):
    g, k1 = _run_each(
        smollm,
        [
            ("g", PROMPTS[1], greedy(16)),
            ("k", PROMPTS[1], SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1, seed=5)),
        ],
    )
    assert g == k1


def test_repetition_penalty_definition():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    apply_penalties(logits, Row(SamplingParams(repetition_penalty=2.0), input_ids=[0], output_ids=[1]))
    assert logits.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied, unseen untouched


def test_frequency_and_presence_penalty_definition():
    logits = torch.zeros(5)
    apply_penalties(
        logits, Row(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), input_ids=[4], output_ids=[1, 1, 1, 2])
    )
    assert logits.tolist() == [0.0, -2.5, -1.5, 0.0, 0.0]  # prompt tokens are not frequency-penalised


def test_filters_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def support(**kw):
        rows = [Row(SamplingParams(**kw), seed=s) for s in range(300)]
        return set(sample(logits.expand(300, 4).contiguous(), rows))

    assert support(temperature=1.0) == {0, 1, 2, 3}
    assert support(temperature=1.0, top_k=2) == {0, 1}
    assert support(temperature=1.0, top_p=0.7) == {0, 1}  # 0.5 + 0.3 reaches 0.7
    assert support(temperature=1.0, min_p=0.5) == {0, 1}  # >= 0.5 * 0.5
    assert support(temperature=0.0) == {0}
    assert support(temperature=1e-45) == {0}  # would be NaN probabilities in float32: greedy instead
    assert support(temperature=1.0, top_k=2**64 - 1) == {0, 1, 2, 3}  # clamped to the vocabulary, no overflow


def test_penalties_change_generation(smollm):
    prompt = "List the numbers: one, two, one, two, one, two,"
    base, pen, rep = _run_each(
        smollm,
        [
            ("b", prompt, greedy(24)),
            ("p", prompt, greedy(24, frequency_penalty=2.0, presence_penalty=2.0)),
            ("r", prompt, greedy(24, repetition_penalty=5.0)),
        ],
    )
    assert base != pen
    assert rep != base


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("max_new_tokens", 0),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("presence_penalty", -3.0),
        ("seed", -1),
        ("top_k", 2**64 - 1),
        ("top_k", MAX_TOP_K + 1),
        ("seed", 2**63),
        ("max_new_tokens", 2**31),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("frequency_penalty", float("-inf")),
        ("repetition_penalty", float("nan")),
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
        ("stop_token_ids", [5, 2**63]),
        ("stop_token_ids", [-1]),
    ],
)
def test_out_of_range_params_rejected(field, value):
    with pytest.raises(ValueError, match=f"^{field} .*, got "):  # the API's 400 names the field first
        SamplingParams(**{field: value}).validate()


def test_limits_are_inclusive():
    SamplingParams(top_k=MAX_TOP_K, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), seed=2**63 - 1).validate(49152)
    with pytest.raises(ValueError, match=r"^stop_token_ids must be token ids in \[0, 100\), got 100$"):
        SamplingParams(stop_token_ids=[99, 100]).validate(100)


def _sorted_reference(logits: torch.Tensor, rows) -> list[int]:
    """The draw by definition: the whole vocabulary sorted, softmax (float64), cuts, the request's uniform on the
    cumulative sum."""
    out = []
    for x, r in zip(logits, rows):
        p = r.params
        values, ids = torch.sort(x / p.temperature, descending=True)
        probs = torch.softmax(values.double(), -1)
        ranks = torch.arange(len(probs))
        drop = ranks >= (min(p.top_k, len(probs)) if p.top_k > 0 else len(probs))
        drop |= (probs.cumsum(-1) - probs) > p.top_p
        drop |= probs < p.min_p * probs[0]
        drop[0] = False
        cdf = probs.masked_fill(drop, 0.0).cumsum(-1)
        u = torch.rand(1, generator=r.generator, dtype=torch.float64)
        out.append(int(ids[torch.searchsorted(cdf, u * cdf[-1]).clamp(max=len(cdf) - 1)]))
    return out


CUTS = [
    dict(),
    dict(top_p=0.9),
    dict(top_p=0.5),
    dict(top_k=5),
    dict(top_k=2000),
    dict(min_p=0.05),
    dict(top_p=0.95, top_k=40, min_p=0.01),
    dict(temperature=0.3),
    dict(temperature=2.0, top_p=0.99),
]


@pytest.mark.parametrize("shape", ["peaked", "medium", "flat"])
def test_the_prefix_draw_picks_what_the_full_sort_picks(shape, monkeypatch):
    """SmolLM2-sized rows, each cut and temperature, 40 seeds each: the same token as the definition, whether
    the draw ends inside the top-512 prefix (peaked rows), the top 4096 or goes on to the full sort (flat rows)."""
    from serving.engine import sampling

    full_sorts = []
    real = sampling._sorted_cut
    monkeypatch.setattr(sampling, "_sorted_cut", lambda s, r: full_sorts.append(len(r)) or real(s, r))
    gen = torch.Generator().manual_seed(7)
    vocab, seeds = 49152, 40
    scale = {"peaked": 4.0, "medium": 1.5, "flat": 0.05}[shape]
    logits = torch.randn(len(CUTS) * seeds, vocab, generator=gen) * scale
    params = [SamplingParams(**{"temperature": 1.0, **cut}) for cut in CUTS for _ in range(seeds)]
    got = sample(logits, [Row(p, seed=i) for i, p in enumerate(params)])
    want = _sorted_reference(logits, [Row(p, seed=i) for i, p in enumerate(params)])
    assert got == want
    fell_back = sum(full_sorts)
    if shape == "peaked":
        assert fell_back < len(params) // 4  # most draws end in a prefix
    elif shape == "flat":
        assert fell_back > len(params) // 4  # the uncut rows of a flat distribution go past both


def test_a_small_vocabulary_is_sorted_whole():
    logits = torch.randn(30, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(**{"temperature": 0.8, **CUTS[i % len(CUTS)]}) for i in range(30)]
    assert sample(logits, [Row(p, seed=i) for i, p in enumerate(params)]) == _sorted_reference(
        logits, [Row(p, seed=i) for i, p in enumerate(params)]
    )


def test_no_rows_no_tokens():
    """A step whose requests all pool (embeddings) samples nothing: no logits rows, no draws."""
    assert sample(torch.zeros(0, 49152), []) == []
