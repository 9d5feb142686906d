"""Turn a workload into one concrete request: the path and the JSON body.

Completions prompts are random token ids (exact lengths, valid for any tokenizer whose
vocabulary covers `token_id_range`); chat prompts are short user messages with a
random tag so no two are identical.  A workload with `system_prompt_tokens: N` starts
every request with the same prefix, fixed by N alone (the same in every run and every
Locust process): chat, a system message of about N tokens of plain English words;
completions, N fixed token ids before the random ones.  Every request streams and asks
for the usage chunk, so the client has the server's exact token counts (and how many
prompt tokens the prefix cache served).
"""

from __future__ import annotations

import random
from functools import lru_cache

from loadtest.config import Plan, Workload

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
DEFAULT_PROMPTS = (
    "Write a haiku about the sea.",
    "Explain what a hash table is to a ten-year-old.",
    "List three uses of copper and say why each works.",
    "What is the capital of France, and what is it famous for?",
    "Tell a short story about a robot learning to paint.",
)
# Common words that byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM) hold as one token
# with their leading space, so a system prompt of n words and periods is about n tokens.
WORDS = tuple(
    """the of and to in is that for it with as was on be at by this have from or one had not but
what all were when we there can an your which their said if do will each about how up out them then she
many some so these would other into has more her two like him see time could no make than first been its
who now people my made over did down only way find use may water long little very after words called just
where most know answer question short clear help user always never write read model system data rule list
number good new old day work world part place year back give well also through much before line right too
any same tell does set three want air play small end put home hand large even here must big high such
follow act why ask change went light kind off need house try again point page letter name open""".split()
)


@lru_cache(maxsize=8)
def system_prompt(n_tokens: int) -> str:
    """About `n_tokens` tokens of English words in sentences; the same text for the same n."""
    rng = random.Random(f"sightline-system-prompt-{n_tokens}")
    sentences: list[str] = []
    budget = n_tokens - 8  # the opening sentence
    while budget > 1:
        k = min(rng.randint(8, 16), budget - 1)
        words = [rng.choice(WORDS) for _ in range(k)]
        sentences.append(" ".join([words[0].capitalize(), *words[1:]]) + ".")
        budget -= k + 1  # the words and the period
    return " ".join(["You are the assistant of a load test."] + sentences)


@lru_cache(maxsize=8)
def shared_prefix_ids(n_tokens: int, token_id_range: tuple[int, int]) -> tuple[int, ...]:
    """`n_tokens` fixed token ids from the range; the same ids for the same arguments."""
    rng = random.Random(f"sightline-shared-prefix-{n_tokens}")
    return tuple(rng.randint(*token_id_range) for _ in range(n_tokens))


def pick_workload(plan: Plan, rng: random.Random) -> Workload:
    weights = [plan.scenario.mix[w.name] for w in plan.workloads]
    return rng.choices(plan.workloads, weights)[0]


def build_request(w: Workload, plan: Plan, rng: random.Random) -> tuple[str, dict]:
    if w.endpoint == "embeddings":  # a batch of token-id inputs (exact lengths), float vectors back
        lo, hi = w.prompt_tokens
        inputs = [
            [rng.randint(*plan.token_id_range) for _ in range(rng.randint(lo, hi))]
            for _ in range(rng.randint(*w.inputs))
        ]
        return PATHS[w.endpoint], {"model": plan.model, "input": inputs}
    body: dict = {
        "model": plan.model,
        "temperature": w.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if w.max_tokens is not None:  # else the server's default: what is left of the context window
        body["max_tokens"] = rng.randint(*w.max_tokens)
    if w.ignore_eos:
        body["ignore_eos"] = True
    if w.endpoint == "chat":
        text = rng.choice(w.prompts or DEFAULT_PROMPTS)
        body["messages"] = [{"role": "user", "content": f"[{rng.randrange(10**6)}] {text}"}]
        if w.system_prompt_tokens:
            body["messages"].insert(0, {"role": "system", "content": system_prompt(w.system_prompt_tokens)})
    else:
        lo, hi = w.prompt_tokens
        prefix = list(shared_prefix_ids(w.system_prompt_tokens, tuple(plan.token_id_range)))
        body["prompt"] = prefix + [rng.randint(*plan.token_id_range) for _ in range(rng.randint(lo, hi))]
    return PATHS[w.endpoint], body
