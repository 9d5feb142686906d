"""Turn a workload into one concrete request: the path and the JSON body.

Completions prompts are random token ids (exact lengths, valid for any tokenizer whose
vocabulary covers `token_id_range`); chat prompts are short user messages with a
random tag so no two are identical.  Every request streams and asks for the usage
chunk, so the client has the server's exact token counts.
"""

from __future__ import annotations

import random

from loadtest.config import Plan, Workload

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DEFAULT_PROMPTS = (
    "Write a haiku about the sea.",
    "Explain what a hash table is to a ten-year-old.",
    "List three uses of copper and say why each works.",
    "What is the capital of France, and what is it famous for?",
    "Tell a short story about a robot learning to paint.",
)


def pick_workload(plan: Plan, rng: random.Random) -> Workload:
    weights = [plan.scenario.mix[w.name] for w in plan.workloads]
    return rng.choices(plan.workloads, weights)[0]


def build_request(w: Workload, plan: Plan, rng: random.Random) -> tuple[str, dict]:
    body: dict = {
        "model": plan.model, "max_tokens": rng.randint(*w.max_tokens), "temperature": w.temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if w.ignore_eos:
        body["ignore_eos"] = True
    if w.endpoint == "chat":
        text = rng.choice(w.prompts or DEFAULT_PROMPTS)
        body["messages"] = [{"role": "user", "content": f"[{rng.randrange(10**6)}] {text}"}]
    else:
        lo, hi = w.prompt_tokens
        body["prompt"] = [rng.randint(*plan.token_id_range) for _ in range(rng.randint(lo, hi))]
    return PATHS[w.endpoint], body
