"""SGLang's native `/generate` body and response (`text`, `output_ids`, `meta_info`)."""

from __future__ import annotations

import msgspec

from protocol.sampling_params import SamplingParams
from serving.frontend.errors import bad_request
from serving.frontend.http.routes.openai_api import Front, check_ignored
from serving.frontend.tokenizer_manager.req_state import Collected, GenerateReqInput


class GenerateSampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    speculative: bool = True  # false: never speculated (--speculative)
    skip_special_tokens: bool = True


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, dict=True):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSampling = msgspec.field(default_factory=GenerateSampling)
    stream: bool = False
    rid: str | None = None
    cache_salt: str | None = None  # narrows the prefix-cache namespace, as on the OpenAI routes
    priority: int | None = None  # --priority-order (default lower first); at best the tenant's


def generate_input(req: GenerateRequest, front: Front) -> GenerateReqInput:
    """The body as a GenerateReqInput (unknown fields as on the OpenAI routes: refused unless
    --allow-unknown-fields)."""
    ignored = check_ignored(req, "/generate", front)
    max_stop = front.max_stop
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of `text` and `input_ids`", param="text")
    sp = req.sampling_params
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    if len(stop) > max_stop or any(not s or len(s) > 256 for s in stop):
        raise bad_request(f"at most {max_stop} stop strings of 1 to 256 characters", param="stop")
    if sp.max_new_tokens is not None and sp.max_new_tokens < 1:
        raise bad_request(f"max_new_tokens must be >= 1, got {sp.max_new_tokens}", param="max_new_tokens")
    fields = {
        f: getattr(sp, f) for f in sp.__struct_fields__ if f not in ("stop", "skip_special_tokens", "max_new_tokens")
    }
    return GenerateReqInput(
        prompt=req.text if req.text is not None else req.input_ids,
        sampling=SamplingParams(max_new_tokens=1, **fields),
        max_new_tokens=sp.max_new_tokens,
        stop=stop,
        skip_special_tokens=sp.skip_special_tokens,
        stream=req.stream,
        rid=req.rid,
        cache_salt=req.cache_salt,
        priority=req.priority,
        ignored_fields=ignored,
    )


def generate_body(result: Collected) -> dict:
    finish = None
    if result.finish_reason is not None:
        finish = {"type": result.finish_reason}
        if result.matched_stop is not None:
            finish["matched"] = result.matched_stop
    return {
        "text": result.text,
        "output_ids": result.output_ids,
        "meta_info": {
            "id": result.rid,
            "finish_reason": finish,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cached_tokens": result.cached_tokens,
        },
    }
