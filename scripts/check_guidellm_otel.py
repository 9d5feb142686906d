"""Load a `python -m loadtest.replay.export` file with GuideLLM's own trace reader and print what it
would replay.  Run it with a Python that has GuideLLM 0.8 (kept out of the project's venv):

    python -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install 'guidellm==0.8.*'
    /tmp/guidellm-venv/bin/python scripts/check_guidellm_otel.py spans.jsonl [--tokenizer DIR]

For each data kind it reads the file through `TraceDatasetDeserializer` (the path
`guidellm run --data kind=...,path=FILE` takes) and walks the conversations GuideLLM
builds: `otel` (needs `gen_ai.input.messages` on each span; a conversation per trace id,
error spans dropped) and `trace_synthetic` (the file's `timestamp`/`input_length`/
`output_length` columns, one shared timeline, synthetic prompts).  It prints, per kind, the
conversations and requests loaded, their token totals and the first arrival offsets, or
the error GuideLLM raised.  `--tokenizer` is a local Hugging Face tokenizer directory
(default: sightline's cached tiny-random model) for the synthetic prompts.  Exit code 0
when every kind asked for (`--kinds`, default both) loaded at least one request.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(kind: str, path: Path, tokenizer: str) -> dict:
    from guidellm.data.deserializers.trace_common import TraceDatasetDeserializer
    from guidellm.schemas.data.entrypoints import DataArgs
    from transformers import AutoTokenizer

    config = DataArgs.model_validate({"kind": kind, "source": {"kind": "json_file", "path": str(path)}})
    dataset = TraceDatasetDeserializer()(config, lambda: AutoTokenizer.from_pretrained(tokenizer), 42)
    conversations, turns, prompt_tokens, output_tokens, offsets = 0, 0, 0, 0, []
    for row in dataset:
        graph = json.loads(row["conversation_turns"])
        conversations += 1
        for turn in graph["turns"]:
            cols = turn["columns"]
            turns += 1
            prompt_tokens += sum(cols.get("prompt_tokens_count_column") or [0])
            output_tokens += sum(cols.get("output_tokens_count_column") or [0])
            offsets += cols.get("relative_timestamp_column") or []
    return {
        "kind": kind,
        "conversations": conversations,
        "requests": turns,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "first_offsets_s": [round(o, 3) for o in sorted(offsets)[:8]],
    }


def default_tokenizer() -> str:
    found = sorted((Path.home() / ".cache" / "sightline" / "models").glob("tiny-random*"))
    return str(found[0]) if found else "gpt2"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--kinds", default="otel,trace_synthetic")
    ap.add_argument("--tokenizer", default=None)
    a = ap.parse_args()
    import importlib.metadata

    print(
        f"guidellm {importlib.metadata.version('guidellm')}; {a.file}: "
        f"{sum(1 for line in a.file.open() if line.strip())} lines"
    )
    ok = True
    for kind in a.kinds.split(","):
        try:
            result = load(kind, a.file, a.tokenizer or default_tokenizer())
            print(json.dumps(result))
            ok &= result["requests"] > 0
        except Exception as exc:  # noqa: BLE001 - report what GuideLLM said, go on with the next kind
            print(json.dumps({"kind": kind, "error": f"{type(exc).__name__}: {exc}"}))
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
