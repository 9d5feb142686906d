"""When a request ends on the token it just sampled: EOS, one of its stop token ids, or its length.

Stop *strings* are the Detokenizer's (they need text); the context window is folded into
`Req.max_new_tokens` when the request is queued.
"""

from __future__ import annotations

from protocol.reasons import FinishReason
from serving.engine.loader import LoadedModel
from serving.engine.request import Req


def eos_ids(loaded: LoadedModel) -> frozenset[int]:
    """The model's EOS ids: its config's, its generation config's and its tokenizer's."""
    ids: set[int] = set()
    gen_cfg = getattr(loaded.hf_model, "generation_config", None)
    for src in (loaded.hf_model.config.eos_token_id, getattr(gen_cfg, "eos_token_id", None), loaded.eos_token_id()):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(x) for x in src)
    return frozenset(ids)


def finish_reason(req: Req, tok: int, eos: frozenset[int]) -> FinishReason | None:
    """Why `req` ends with `tok`, its latest output token (recorded in `matched_stop` for a stop id); None: it
    goes on.  EOS and stop ids end nothing within the first min_tokens outputs (the sampler masks them there
    too, `serving.engine.sampling.mask_stops`)."""
    if len(req.output_ids) > req.params.min_tokens:
        if tok in eos and not req.params.ignore_eos:
            return FinishReason.STOP
        if tok in req.stop_ids:
            req.matched_stop = tok
            return FinishReason.STOP
    if len(req.output_ids) >= req.max_new_tokens:
        return FinishReason.LENGTH
    return None
