"""Accuracy of each reduced-precision mode against float32, on the same model and inputs.

    .venv/bin/python -m bench.accuracy [--model smollm2-135m] [--modes bfloat16,int8]

For each mode: next-token top-1 agreement with float32 over every teacher-forced position
of `PROMPTS` (60 prompts), the largest |Δlogit| seen there, and the perplexity of both
on `TEXT` (a fixed passage).  Prints a table; the tests assert the bounds (perplexity
within 1 % of float32 for bfloat16, 3 % for int8).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from serving.args import ServerArgs
from serving.engine.batch import Work, build_batch
from serving.engine.loader import LoadedModel, load_model
from serving.engine.model_runner import ModelRunner

SUBJECTS = [
    "the ocean",
    "a small town",
    "the history of printing",
    "volcanoes",
    "a chess game",
    "bread baking",
    "the moon landing",
    "honeybees",
    "a rainy afternoon",
    "railway timetables",
    "the human heart",
    "ancient Rome",
]
FORMS = [
    "Write a short paragraph about {}.",
    "Explain {} to a child.",
    "List three facts about {}:",
    "Q: What is interesting about {}?\nA:",
    "Once upon a time, {} was",
]
PROMPTS = [form.format(s) for s in SUBJECTS for form in FORMS]  # 60 prompts
TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year nobody visited it but the "
    "keeper and the gulls. Each evening he climbed the spiral stair, trimmed the wick, polished the great lens and "
    "wrote a line in the log: the wind, the state of the sea, the ships that passed. In winter the storms came in "
    "from the west and the spray reached the gallery windows, so that the light seemed to shine through rain even "
    "on clear nights. The keeper did not mind. He had learned to read the weather from the colour of the water and "
    "the shape of the clouds, and he could tell a fishing boat from a cargo steamer by the sound of its engine long "
    "before it came into view. When the supply boat arrived each month it brought flour, oil, letters and "
    "newspapers a week old, and he read every page, even the advertisements, because they told him how the world "
    "was changing while he kept his small fire burning at the edge of it."
)


@dataclass
class Report:
    mode: str
    top1_agreement: float  # fraction of positions whose argmax equals float32's
    max_abs_logit_diff: float
    perplexity: float
    perplexity_fp32: float

    @property
    def perplexity_change(self) -> float:
        return self.perplexity / self.perplexity_fp32 - 1


def runner_for(model: LoadedModel, dtype: str, quantization: str = "none") -> ModelRunner:
    return ModelRunner(
        model,
        ServerArgs(
            model=model.name, dtype=dtype, quantization=quantization, max_total_tokens=2048, max_running_requests=4
        ),
    )


def all_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """float32 logits of every position of `ids` (teacher forcing), in one prefill."""
    row = runner.pool.admit(len(ids))
    try:
        fb = build_batch([], [Work(row, 0, ids, True)], runner.pool, runner.window)
        fb.logits_rows = None  # every position, not only the last
        with torch.inference_mode():
            return runner.model.forward(fb, runner.pool.kv).float()
    finally:
        runner.pool.release(row, len(ids))  # its slots too: nothing here is cached


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


def compare(model: LoadedModel, modes: list[tuple[str, str]], prompts: list[str] = PROMPTS) -> list[Report]:
    """Each (dtype, quantization) mode against float32 on the same prompts and text."""
    encoded = [model.tokenizer(p)["input_ids"] for p in prompts]
    text_ids = model.tokenizer(TEXT)["input_ids"]
    ref = runner_for(model, "float32")
    ref_logits = [all_logits(ref, ids) for ids in encoded]
    ppl_ref = perplexity(all_logits(ref, text_ids), text_ids)
    del ref
    reports = []
    for dtype, quant in modes:
        runner = runner_for(model, dtype, quant)
        agree = total = 0
        worst = 0.0
        for ids, want in zip(encoded, ref_logits):
            got = all_logits(runner, ids)
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += len(ids)
            worst = max(worst, float((got - want).abs().max()))
        ppl = perplexity(all_logits(runner, text_ids), text_ids)
        reports.append(Report(quant if quant != "none" else dtype, agree / total, worst, ppl, ppl_ref))
    return reports


MODES = {
    "bfloat16": ("bfloat16", "none"),
    "int8": ("auto", "int8"),
    "gguf": ("auto", "gguf"),
    **{q: ("auto", q) for q in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k")},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="bfloat16,int8")
    a = ap.parse_args()
    model = load_model(a.model)
    reports = compare(model, [MODES[m] for m in a.modes.split(",")])
    print(
        f"model {a.model}; {len(PROMPTS)} prompts (teacher-forced positions); perplexity on a "
        f"{len(model.tokenizer(TEXT)['input_ids'])}-token passage"
    )
    print("| mode | top-1 agreement with float32 | max abs Δlogit | perplexity | float32 perplexity | change |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in reports:
        print(
            f"| {r.mode} | {100 * r.top1_agreement:.2f} % | {r.max_abs_logit_diff:.3f} | {r.perplexity:.3f} | "
            f"{r.perplexity_fp32:.3f} | {100 * r.perplexity_change:+.2f} % |"
        )


if __name__ == "__main__":
    main()
