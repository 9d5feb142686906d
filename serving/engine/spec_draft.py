"""A draft model's proposals (`--speculative draft --speculative-model M`): a smaller model of the target's
tokenizer, run in the engine process beside it, guesses each speculated request's next tokens greedily.

The draft is a second `ModelRunner` (the same loading, forward and KV pool code as the target's) with a pool
of its own: one row per speculated request, holding the K/V of the tokens in `DraftSeq.tokens`.  A proposal
of k tokens first feeds what the draft has not seen of the request's tokens (the target's last token, and
on a first proposal the whole prompt) as one chunk, then each guessed token but the last as a decode row:
k draft forwards for k tokens.  Only positions that match the request's tokens are kept: `verified` drops
those of the draft tokens the target refused, and a proposal first drops any position that no longer
matches (a step that failed and was rerun), so the draft's K/V is always that of the request's own prefix.

Greedy drafting makes the proposal deterministic (its distribution q is one-hot), so the acceptance rule of
`serving.engine.spec_accept` (keep x with probability p(x), else draw from p without x) is the exact one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving import startup_phases
from serving.args import ServerArgs
from serving.engine.batch import Work
from serving.engine.loader import LoadedModel, load_model
from serving.engine.model_runner import ModelRunner
from serving.engine.spec_propose import Proposer
from serving.model_errors import ModelLoadError
from serving.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from serving.engine.request import Req

log = logging.getLogger(__name__)


def parameter_count(config: Any) -> int:
    """A decoder-only transformer's parameters from its config (embedding, attention, MLP, norms, an untied
    lm_head): what the draft-smaller-than-target check compares, whatever format the weights are in."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * config.intermediate_size
    embeddings = config.vocab_size * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden


def tokenizer_identity(path: Path) -> tuple[Any, ...] | None:
    """What makes two tokenizers the same: tokenizer.json's model (vocabulary, merges) and added tokens;
    None without a tokenizer.json."""
    try:
        tok = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    added = sorted((t.get("id"), t.get("content")) for t in tok.get("added_tokens") or ())
    return json.dumps(tok.get("model"), sort_keys=True), tuple(added)


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft that cannot propose for this target: an encoder, another tokenizer, more parameters."""
    if draft.encoder:
        raise ModelLoadError(f"--speculative-model {draft.name} is an encoder: a draft must be a generative model")
    same = tokenizer_identity(target.path), tokenizer_identity(draft.path)
    sizes = draft.hf_model.config.vocab_size, target.hf_model.config.vocab_size
    if (sizes[0] != sizes[1]) if None in same else (same[0] != same[1]):
        raise ModelLoadError(
            f"--speculative-model {draft.name} does not share {target.name}'s tokenizer "
            f"(vocabulary {sizes[0]} vs {sizes[1]} tokens, or different tokens): "
            "a draft must use the target's tokenizer"
        )
    mine, theirs = parameter_count(draft.hf_model.config), parameter_count(target.hf_model.config)
    if mine > theirs:
        raise ModelLoadError(
            f"--speculative-model {draft.name} has more parameters ({mine / 1e6:.1f}M) than {target.name} "
            f"({theirs / 1e6:.1f}M): a draft must be the smaller model"
        )


@dataclass
class DraftSeq:
    """One request's row in the draft's pool and the tokens whose K/V it holds, position by position."""

    row: int
    tokens: list[int] = field(default_factory=list)


class DraftProposer(Proposer):
    """Proposals from a draft model (see the module docstring); `Proposer`'s interface."""

    method = "draft"

    def __init__(self, target: LoadedModel, args: ServerArgs) -> None:
        with startup_phases.counted_as("draft_model"):
            draft = load_model(args.speculative_model, cache_dir=args.cache_dir_path)
            check_pair(target, draft)
            # a GGUF target served in its own types does not make a safetensors draft one: that draft runs exact
            own = "none" if args.quantization == "gguf" and draft.gguf is None else args.quantization
            self.runner = ModelRunner(draft, dataclasses.replace(args, quantization=own))
        self.pool = self.runner.pool
        self.vocab = target.hf_model.config.vocab_size  # a draft's padded embedding rows are never proposed
        self.seqs: dict[str, DraftSeq] = {}
        self.fail_log = RateLimitedLog(log)
        log.info("speculative draft model %s (%s, %s)", draft.name, draft.architecture, self.runner.precision.dtype)

    def propose(self, req: Req, k: int) -> list[int]:
        return self.propose_all([(req, k)])[0]

    def propose_all(self, asks: list[tuple[Req, int]]) -> list[list[int]]:
        """Every request's draft, one batch a draft position: first each request's unseen tokens (a decode row
        for one, a chunk for more), then a decode row per request still short of its k.  A draft forward that
        fails proposes nothing this step (the target's step goes on without drafts)."""
        drafts: list[list[int]] = [[] for _ in asks]
        todo: list[tuple[int, DraftSeq, int]] = []  # (index in asks, its row, its k)
        room = self.pool.free_slots
        for i, (req, k) in enumerate(asks):
            st = self._caught_up(req)
            k = min(k, self.runner.context_len - len(req.seq))
            need = len(req.seq) - len(st.tokens) + k - 1 if st is not None else 0
            if st is not None and k >= 1 and need <= room:
                room -= need
                todo.append((i, st, k))
        fed = [(i, st, asks[i][0].seq[len(st.tokens) :]) for i, st, _ in todo]
        try:
            while fed:
                self._forward(fed, drafts)
                fed = [(i, st, [drafts[i][-1]]) for i, st, k in todo if len(drafts[i]) < k]
        except Exception as exc:  # noqa: BLE001 - a draft is an optimisation: the requests decode without one
            self.fail_log.report("draft model forward failed; no drafts this step", exc)
            return [[] for _ in asks]
        return drafts

    def _caught_up(self, req: Req) -> DraftSeq | None:
        """`req`'s row (None: the pool has no row free), holding no position that is not `req`'s and at least its
        last token to feed, whose logits guess the next."""
        st = self.seqs.get(req.rid)
        if st is None:
            if not self.pool.free_rows:
                return None
            st = self.seqs[req.rid] = DraftSeq(self.pool.admit())
        seq = req.seq
        same = len(st.tokens) if seq[: len(st.tokens)] == st.tokens else _common(seq, st.tokens)
        self._roll_back(st, min(same, len(seq) - 1))
        return st

    def _forward(self, fed: list[tuple[int, DraftSeq, list[int]]], drafts: list[list[int]]) -> None:
        """One draft forward over each (request's index, its row, the tokens to feed it); once it succeeded, those
        tokens count in the row and the argmax of each one's last row is appended to its draft."""
        order = [f for f in fed if len(f[2]) == 1] + [f for f in fed if len(f[2]) > 1]  # logits: decodes first
        work = [Work(st.row, len(st.tokens), tokens, True) for _, st, tokens in order]
        decodes = sum(len(tokens) == 1 for _, _, tokens in order)
        logits = self.runner.forward(work[:decodes], work[decodes:])
        for (i, st, tokens), guess in zip(order, logits[:, : self.vocab].argmax(-1).tolist()):
            st.tokens += tokens
            drafts[i].append(guess)

    def verified(self, req: Req, proposed: int, accepted: int) -> None:
        """Before the target's tokens are appended: the draft keeps the positions of the tokens it kept."""
        st = self.seqs.get(req.rid)
        if st is not None:
            self._roll_back(st, len(req.seq) + accepted)

    def forget(self, req: Req) -> None:
        st = self.seqs.pop(req.rid, None)
        if st is not None:
            self.pool.release(st.row, len(st.tokens))

    def _roll_back(self, st: DraftSeq, keep: int) -> None:
        """The draft's K/V past position `keep` freed: those tokens are not (or no longer) the request's."""
        if keep < len(st.tokens):
            self.pool.free(self.pool.req_to_token[st.row, keep : len(st.tokens)].clone())
            del st.tokens[keep:]


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of `a` and `b`."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
