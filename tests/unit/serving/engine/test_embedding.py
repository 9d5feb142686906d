"""Embeddings through the Scheduler core equal transformers' pooled hidden states on the same weights,
for every pooling; batched (with each other and with generation) equals alone; chunked equals unchunked;
the prefix cache serves last-token pooling; sentence-transformers configs are read."""

from __future__ import annotations

import json

import pytest
import torch

from serving.engine.embedding import pooling_config, sentence_transformers_pooling
from serving.model_files import ModelLoadError
from tests.helpers import PROMPTS, collect, encode, greedy, make_core


def reference(model, ids: list[int], mode: str) -> torch.Tensor:
    """The pooled final hidden state as sentence-transformers computes it (AutoModel's last_hidden_state)."""
    with torch.no_grad():
        h = model.hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[mode]


def embed(core, inputs: dict[str, list[int]], mode: str) -> dict[str, torch.Tensor]:
    for rid, ids in inputs.items():
        core.add_request(rid, ids, greedy(1), pooling=mode)
    out = {}
    for ev in core.run_to_completion():
        if ev.req.embedding is not None:
            out[ev.rid] = ev.req.embedding
    return out


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_alone_and_batched_equal_transformers(tiny, mode):
    inputs = {f"e{i}": encode(tiny, p) for i, p in enumerate(PROMPTS[:4])}
    alone = {rid: embed(make_core(tiny), {rid: ids}, mode)[rid] for rid, ids in inputs.items()}
    batched = embed(make_core(tiny, max_prefill_tokens=16), inputs, mode)  # chunked and batched
    for rid, ids in inputs.items():
        ref = reference(tiny, ids, mode)
        assert cos(alone[rid], ref) >= 0.9999, (rid, mode)
        assert cos(batched[rid], ref) >= 0.9999, (rid, mode)
        assert torch.allclose(batched[rid], alone[rid], atol=1e-4), (rid, mode)


def test_batched_with_generation(tiny):
    """Embedding requests share steps with decoding requests; the generated tokens do not change."""
    ids = encode(tiny, PROMPTS[0])
    solo = make_core(tiny)
    solo.add_request("g", ids, greedy(12))
    expected = collect(solo)["g"]
    core = make_core(tiny)
    core.add_request("g", ids, greedy(12))
    core.step()
    core.step()  # decoding now
    core.add_request("e", encode(tiny, PROMPTS[1]), greedy(1), pooling="mean")
    tokens, emb, steps_with_both = [], None, 0
    while core.has_work:
        steps_with_both += {"g", "e"} <= set(core.last_step.rids)
        for ev in core.step():
            tokens += ev.new_token_ids
            emb = ev.req.embedding if ev.req.embedding is not None else emb
    steps_with_both += {"g", "e"} <= set(core.last_step.rids)
    assert steps_with_both >= 1
    assert ids and tokens[-10:] == expected[-10:] and len(tokens) == 10
    assert cos(emb, reference(tiny, encode(tiny, PROMPTS[1]), "mean")) >= 0.9999


def test_last_pooling_reuses_the_prefix_cache(tiny):
    core = make_core(tiny)
    ids = encode(tiny, PROMPTS[2])
    first = embed(core, {"a": ids}, "last")["a"]
    req = core.add_request("b", ids, greedy(1), pooling="last")
    second = next(ev.req.embedding for ev in core.run_to_completion() if ev.rid == "b")
    assert req.cached_tokens == len(ids) - 1
    assert cos(first, second) >= 0.99999
    mean_req = core.add_request("c", ids, greedy(1), pooling="mean")  # reads every position: no reuse
    core.run_to_completion()
    assert mean_req.cached_tokens == 0


def test_context_limit(tiny):
    core = make_core(tiny, context_length=16)
    core.add_request("ok", list(range(1, 17)), greedy(1), pooling="mean")  # an embedding may fill the window
    with pytest.raises(ValueError, match="context window is 16"):
        core.add_request("long", list(range(1, 18)), greedy(1), pooling="mean")
    assert len(embed(core, {}, "mean")) == 1


def test_sentence_transformers_config(tmp_path):
    assert pooling_config(tmp_path, None) is None
    assert pooling_config(tmp_path, "mean").embedding_only is False
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    assert sentence_transformers_pooling(tmp_path) == ("cls", True)
    cfg = pooling_config(tmp_path, None)
    assert (cfg.mode, cfg.normalize, cfg.embedding_only) == ("cls", True, True)
    assert pooling_config(tmp_path, "last").mode == "last"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="not supported"):
        pooling_config(tmp_path, None)
