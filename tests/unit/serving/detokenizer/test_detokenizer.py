"""Incremental detokenization (serving.detokenizer.incremental) with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from protocol.io_struct import BatchTokenIDOutput, DetokParams, Logprobs, TokenOut
from serving.detokenizer.incremental import DecodeState
from serving.detokenizer.manager import DetokenizerManager

TEXTS = [
    "Hello 👋 世界 🎉 naïve — done",
    "日本語のテキストと絵文字 🙂🙃 mixed with English.",
    "🇫🇷 flags, ZWJ 👩‍💻 and combining é é",
]


def feed_one_by_one(tok, ids: list[int], params: DetokParams | None = None) -> list[str]:
    state = DecodeState(tok, params or DetokParams())
    return [state.feed([t], final=(i == len(ids) - 1)).text for i, t in enumerate(ids)]


@pytest.mark.parametrize("text", TEXTS)
def test_emoji_and_cjk_stream_without_broken_characters(tiny, text):
    tok = tiny.tokenizer
    ids = tok(text)["input_ids"]
    deltas = feed_one_by_one(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens were held back mid-character


def test_unfinished_character_is_flushed_at_the_end(tiny):
    tok = tiny.tokenizer
    ids = tok("ok 🎉")["input_ids"][:-1]  # cut inside the emoji's bytes
    deltas = feed_one_by_one(tok, ids)
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")


def test_abort_flushes_held_bytes(tiny):
    tok = tiny.tokenizer
    ids = tok("ok 🎉")["input_ids"][:-1]
    state = DecodeState(tok, DetokParams())
    texts = [state.feed([t], final=False).text for t in ids]
    texts.append(state.feed([], final=True).text)
    assert "".join(texts) == tok.decode(ids)


def test_stop_string_trims_and_is_never_streamed_in_part(tiny):
    tok = tiny.tokenizer
    text = "The answer is 42. Then the story goes on and on."
    ids = tok(text)["input_ids"]
    state = DecodeState(tok, DetokParams(stop=["goes on", "never"]))
    out, matched, consumed = "", None, 0
    for t in ids:
        e = state.feed([t], final=False)
        out += e.text
        consumed += e.consumed
        assert "goes" not in out  # the half-generated stop string was held back
        if e.matched_stop:
            matched = e.matched_stop
            break
    assert matched == "goes on" and out == text[: text.index("goes on")]
    assert consumed < len(ids) and state.stopped
    assert state.feed([1, 2, 3], final=True).text == ""  # tokens past the stop are ignored


def test_stop_string_spanning_tokens_and_prompt_context(tiny):
    tok = tiny.tokenizer
    ids = tok(" alpha beta gamma delta")["input_ids"]
    state = DecodeState(tok, DetokParams(stop=["a gam"], prompt_tail=tok("Say:")["input_ids"]))
    out = "".join(state.feed([t], final=False).text for t in ids)
    assert out == " alpha bet"


def test_decode_window_stays_short(tiny):
    """Linear total work: each step decodes a window, never the whole output."""
    tok = tiny.tokenizer
    ids = tok("word " * 400)["input_ids"]
    state = DecodeState(tok, DetokParams())
    widest = 0
    for t in ids:
        state.feed([t], final=False)
        widest = max(widest, len(state.ids) - state.prefix_offset)
    assert widest <= 4 and "".join(tok.decode(ids)) == "word " * 400


def test_manager_drops_unknown_rids_and_forgets_finished(tiny):
    mgr = DetokenizerManager(tiny.tokenizer)
    first = TokenOut(rid="a", new_token_ids=tiny.tokenizer("Hi")["input_ids"], detok=DetokParams())
    out = mgr.handle_batch(BatchTokenIDOutput(outputs=[first, TokenOut(rid="ghost", new_token_ids=[5])]))
    assert [o.rid for o in out.outputs] == ["a"] and out.outputs[0].text == "Hi"
    end = TokenOut(rid="a", new_token_ids=[], finish_reason="abort")
    assert mgr.handle_batch(BatchTokenIDOutput(outputs=[end])).outputs[0].finish_reason == "abort"
    assert mgr.reqs == {}
    mgr.handle_batch(BatchTokenIDOutput(outputs=[TokenOut(rid="a", new_token_ids=[7])]))
    drops = {(d.message_type, d.reason): d.count for d in mgr.stats().stale_drops}
    assert drops == {("BatchTokenIDOutput", "unknown_rid"): 1, ("BatchTokenIDOutput", "abort"): 1}


def test_outputs_carry_their_worker_and_a_gone_worker_leaves_no_state(tiny):
    mgr = DetokenizerManager(tiny.tokenizer)
    ids = tiny.tokenizer("Hello there")["input_ids"]
    first = [TokenOut(rid=f"r{w}", new_token_ids=ids[:1], detok=DetokParams(), worker=w) for w in (1, 2)]
    out = mgr.handle_batch(BatchTokenIDOutput(outputs=first))
    assert [(o.rid, o.worker) for o in out.outputs] == [("r1", 1), ("r2", 2)]
    mgr.worker_gone(1)
    assert set(mgr.reqs) == {"r2"} and mgr.reqs["r2"].worker == 2
    late = mgr.handle_batch(
        BatchTokenIDOutput(
            outputs=[
                TokenOut(rid="r1", new_token_ids=ids[1:2], worker=1),  # still in flight when the worker died
                TokenOut(
                    rid="r3", new_token_ids=ids[:1], detok=DetokParams(), worker=1
                ),  # a first output: no new state
                TokenOut(rid="r2", new_token_ids=ids[1:2], finish_reason="length", worker=2),
            ]
        )
    )
    assert [o.rid for o in late.outputs] == ["r2"] and not mgr.reqs
    assert mgr.drops.counts[("BatchTokenIDOutput", "worker_gone")] == 1
    assert mgr.drops.counts[("BatchTokenIDOutput", "unknown_rid")] == 1


def _numbered(n: int) -> Logprobs:
    """Logprobs whose values say which token they belong to: token i has -i and alternatives [i, i + 1]."""
    return Logprobs(
        token_logprobs=[-float(i) for i in range(n)],
        top_ids=[[i, i + 1] for i in range(n)],
        top_logprobs=[[-float(i), -float(i) - 1] for i in range(n)],
    )


def test_logprobs_are_cut_where_a_stop_string_cuts_the_batch(tiny):
    tok = tiny.tokenizer
    mgr = DetokenizerManager(tok)
    ids = tok(" one two STOP three four")["input_ids"]
    prompt = Logprobs(token_logprobs=[-1.5, -2.5])
    first = TokenOut(
        rid="a", new_token_ids=ids[:2], detok=DetokParams(stop=["STOP"]), logprobs=_numbered(2), prompt_logprobs=prompt
    )
    (out,) = mgr.handle_batch(BatchTokenIDOutput(outputs=[first])).outputs
    assert out.prompt_logprobs == prompt and out.logprobs == _numbered(2)  # nothing consumed is cut
    rest = ids[2:]
    (out,) = mgr.handle_batch(
        BatchTokenIDOutput(outputs=[TokenOut(rid="a", new_token_ids=rest, logprobs=_numbered(len(rest)))])
    ).outputs
    consumed = len(out.output_ids)
    assert out.finish_reason == "stop" and out.matched_stop == "STOP" and 0 < consumed < len(rest)
    assert out.logprobs == _numbered(consumed) and out.prompt_logprobs is None  # only on the first output
    assert "STOP" not in out.text and "three" not in out.text


def test_include_stop_str_in_output_keeps_the_stop_string(tiny):
    tok = tiny.tokenizer
    text = "The answer is 42. Then the story goes on and on."
    ids = tok(text)["input_ids"]
    state = DecodeState(tok, DetokParams(stop=["goes on"], include_stop_str_in_output=True))
    out = ""
    for t in ids:
        e = state.feed([t], final=False)
        out += e.text
        if e.matched_stop:
            break
    assert e.matched_stop == "goes on" and out == text[: text.index("goes on") + len("goes on")]
