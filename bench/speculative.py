"""What prompt-lookup speculation (`--speculative ngram`) gains, in-process: one stream's decode tokens/s with
speculation on and off, on shipped prompts whose answers copy their input and on free text.

    .venv/bin/python -m bench.speculative [--model smollm2-135m] [--gen-len 128] [--rounds 3] [--held-out]

Each prompt (chat-templated) is run greedy to EOS or `--gen-len` tokens, alone, on an engine with speculation
and on one without (the same weights, float32 or `--quantization gguf`); only the steps after the first token
are timed (prefill is the same in both).  The arms alternate over `--rounds` rounds; the medians are compared,
with the spread (min-max over the rounds) of each.  Greedy outputs must be the same tokens: the bench says so
per prompt.
Acceptance is the accepted ÷ proposed draft tokens, and tokens per step the output tokens ÷ decode steps.
Tokens per CPU second (the process's CPU time over the same steps) are compared too: steadier than wall time
on a machine something else also runs on.  The goal: copy-heavy ≥ 1.5× at one stream, free text within 3 %
of off.  `--held-out` adds prompts of the same kinds that the speculation's settings were not chosen on
(`HELD_OUT`); `--only NAME...` runs just those named.  A benchmark prints numbers; it asserts nothing.
"""

from __future__ import annotations

import os
import statistics
import time

if __name__ == "__main__":  # as the server's Scheduler runs (--thread-wait-policy passive); read when torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.common import write_json

CODE = '''def compute_total(items, tax_rate):
    """Sum the prices of the items and add the tax."""
    subtotal = 0.0
    for item in items:
        if item.quantity <= 0:
            continue
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def print_receipt(items, tax_rate):
    for item in items:
        print(f"{item.name}: {item.quantity} x {item.price:.2f}")
    print(f"Total: {compute_total(items, tax_rate):.2f}")'''

RECORD = (
    "Order 48213 was placed on 12 March 2024 by Maria Lopez (maria.lopez@example.com, phone +34 612 345 678). "
    "She lives at 27 Calle Mayor, Madrid, Spain. The order contains 3 items: a blue ceramic teapot, two linen "
    "napkins and a bamboo tray. Payment was made by credit card and the parcel ships with DHL, tracking number "
    "JD014600003581."
)

WORKLOADS: dict[str, tuple[str, str]] = {  # name → (kind, the user's message)
    "code_edit": (
        "copy",
        "Rewrite this code with one change: rename the variable `subtotal` to `net`. Keep everything else "
        f"exactly the same and reply with the full code only.\n\n```python\n{CODE}\n```",
    ),
    "json_extract": (
        "copy",
        "Extract these fields as JSON, copying the values exactly as written: order_id, date, name, email, "
        f"phone, address, items, payment, carrier, tracking_number.\n\n{RECORD}",
    ),
    "free_text": ("free", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
}
# Prompts the proposer and draft-length policy were not tuned on: in-process only (bench.speculative_peers
# runs WORKLOADS), so a change that helps the shipped prompts is seen to help others of their kind too
HELD_OUT: dict[str, tuple[str, str]] = {
    "json_invoice": (
        "copy",
        "Extract these fields as JSON, copying the values exactly as written: invoice_number, issue_date, "
        "due_date, vendor, customer, vat_id, total, currency, bank.\n\nInvoice INV-2291 from Nordlicht Tools "
        "GmbH (VAT DE811907980) was issued on 3 May 2025 to Harbour Lane Bakery, 14 Quay Street, Cork. It is due "
        "on 2 June 2025. The total is 1,284.50 EUR, to be paid to IBAN DE44 5001 0517 5407 3249 31.",
    ),
    "json_people": (
        "copy",
        "Return a JSON list with one object per person (keys: name, role, city) from this text:\n\nDr. Aisha "
        "Rahman is the lead engineer in Toronto. Tomasz Nowak works as a data analyst in Warsaw. Lucia Ferreira, "
        "a product designer, is based in Lisbon. Kenji Watanabe manages support from Osaka.",
    ),
    "free_recipe": ("free", "Explain how to bake sourdough bread at home for a beginner."),
}


def chat_ids(tokenizer, message: str) -> list[int]:
    messages = [{"role": "user", "content": message}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_one(core, ids: list[int], gen_len: int, tag: str) -> tuple[list[int], float, float, int]:
    """(output tokens, wall and CPU seconds of the steps after the first token, those steps) of one greedy
    request alone."""
    from protocol.sampling_params import SamplingParams

    core.add_request(tag, ids, SamplingParams(max_new_tokens=gen_len, temperature=0.0))
    out: list[int] = []
    while not out:
        out += [t for ev in core.step() for t in ev.new_token_ids]
    seconds = cpu = 0.0
    steps = 0
    while core.has_work:
        t0, c0 = time.perf_counter(), time.process_time()
        events = core.step()
        seconds += time.perf_counter() - t0
        cpu += time.process_time() - c0
        steps += 1
        out += [t for ev in events for t in ev.new_token_ids]
    core.flush_cache()
    return out, seconds, cpu, steps


def main() -> None:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a name, directory or .gguf file, as --model takes")
    ap.add_argument("--quantization", default="none", help="as the server's flag (gguf: a GGUF file in its types)")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-tokens", type=int, default=None, help="--speculative-num-tokens (default: the server's)")
    ap.add_argument("--ngram-min", type=int, default=None, help="--speculative-ngram-min (default: the server's)")
    ap.add_argument("--held-out", action="store_true", help="also run the HELD_OUT prompts")
    ap.add_argument("--only", nargs="+", help="run only these workloads (names of WORKLOADS or HELD_OUT)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()

    from serving.args import ServerArgs
    from serving.engine.loader import load_model
    from serving.engine.scheduler_core import SchedulerCore

    loaded = load_model(a.model)
    threads = len(os.sched_getaffinity(0))  # the cores it may run on (taskset), not the machine's
    base = {"model": a.model, "dtype": "float32", "quantization": a.quantization, "num_threads": threads}
    flags = {"speculative_num_tokens": a.num_tokens, "speculative_ngram_min": a.ngram_min}
    extra = {name: value for name, value in flags.items() if value is not None}
    cores = {
        "off": SchedulerCore(loaded, ServerArgs(**base)),
        "on": SchedulerCore(loaded, ServerArgs(**base, speculative="ngram", **extra)),
    }
    for core in cores.values():
        run_one(core, chat_ids(loaded.tokenizer, "Hi"), 4, "warmup")
    doc: dict[str, object] = {"model": a.model, "threads": threads, "gen_len": a.gen_len, "rounds": a.rounds}
    doc["workloads"] = {}
    workloads = {**WORKLOADS, **HELD_OUT} if a.held_out or a.only else WORKLOADS
    for name, (kind, message) in workloads.items():
        if a.only and name not in a.only:
            continue
        ids = chat_ids(loaded.tokenizer, message)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        cpu_rates: dict[str, list[float]] = {"off": [], "on": []}
        outs, steps = {}, {}
        spec = cores["on"].spec
        before = (spec.proposed, spec.accepted)
        for r in range(a.rounds):
            for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
                out, seconds, cpu, n = run_one(cores[arm], ids, a.gen_len, f"{name}-{r}-{arm}")
                rates[arm].append((len(out) - 1) / seconds)
                cpu_rates[arm].append((len(out) - 1) / cpu)
                outs[arm], steps[arm] = out, n
        proposed, accepted = spec.proposed - before[0], spec.accepted - before[1]
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        row = {
            "kind": kind,
            "prompt_tokens": len(ids),
            "output_tokens": len(outs["on"]),
            "identical": outs["on"] == outs["off"],
            "tok_s_off": off,
            "tok_s_on": on,
            "speedup": on / off,
            "cpu_speedup": statistics.median(cpu_rates["on"]) / statistics.median(cpu_rates["off"]),
            "spread_off": [min(rates["off"]), max(rates["off"])],
            "spread_on": [min(rates["on"]), max(rates["on"])],
            "acceptance": accepted / proposed if proposed else None,
            "tokens_per_step": (len(outs["on"]) - 1) / steps["on"] if steps["on"] else None,
        }
        doc["workloads"][name] = row
        print(workload_line(f"{a.model} {name}", row, rates, f"medians of {a.rounds} rounds, {threads} thread(s)"))
    if a.json:
        write_json(a.json, doc)


def speculative_lines(doc: dict) -> list[str]:
    """`bench.table`'s lines of a run's JSON: one per workload."""
    how = f"medians of {doc['rounds']} rounds, {doc['threads']} thread(s)"
    rows = doc["workloads"].items()
    spreads = {name: {"off": row["spread_off"], "on": row["spread_on"]} for name, row in rows}
    return [workload_line(f"speculation {doc['model']} {name}", row, spreads[name], how) for name, row in rows]


def workload_line(what: str, row: dict, rates: dict[str, list[float]], how: str) -> str:
    """One workload's line: the rates with their spread, the speedup, acceptance and tokens per step."""
    off, on = rates["off"], rates["on"]
    acc = f"{row['acceptance'] * 100:.0f} %" if row["acceptance"] is not None else "none proposed"
    return (
        f"{what} ({row['kind']}, {row['prompt_tokens']} prompt, {row['output_tokens']} output tokens): "
        f"off {row['tok_s_off']:.1f} tok/s [{min(off):.1f}-{max(off):.1f}], on {row['tok_s_on']:.1f} tok/s "
        f"[{min(on):.1f}-{max(on):.1f}]: speedup {row['speedup']:.2f}x; acceptance {acc}, "
        f"{row['tokens_per_step']:.2f} tokens/step; per CPU second {row['cpu_speedup']:.2f}x; "
        f"identical: {row['identical']} ({how})"
    )


def speculative_peers_lines(doc: dict) -> list[str]:
    """bench.speculative_peers' table of a run's JSON (also `bench.table`'s): one row per workload and arm,
    then per workload sightline with speculation over llama.cpp's best arm."""
    lines = [
        f"speculation beside llama-server, one stream, streaming, greedy, {doc['threads']} thread(s) each, "
        f"up to {doc['gen_len']} tokens, medians of {doc['rounds']} round(s) [min-max]; decode tok/s excludes TTFT",
        "| workload | server | setting | decode tok/s | × own off | acceptance | output tokens | TTFT p50 ms |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    tail = []
    for wl, w in doc["workloads"].items():
        for r in w["arms"].values():
            acc = f"{100 * r['acceptance']:.0f} %" if r["acceptance"] is not None else "–"
            speedup = f"{r['speedup']:.2f}×" if r["speedup"] else "–"
            tokens = "/".join(str(t) for t in sorted(set(r["output_tokens"])))
            lines.append(
                f"| {wl} ({w['kind']}) | {r['server']} | {r['setting']} | {r['tok_s']:.1f} "
                f"[{r['spread'][0]:.1f}-{r['spread'][1]:.1f}] | {speedup} | {acc} | {tokens} | {r['ttft_ms']:.0f} |"
            )
        if w["sightline_over_llama_best"] is not None:
            tail.append(
                f"{wl}: sightline ngram ÷ llama-server's best ({w['llama_best']}): "
                f"{w['sightline_over_llama_best']:.2f}×"
            )
    notes = [f"llama-server: skipped: {doc['llama_skipped']}"] if doc.get("llama_skipped") else []
    if doc.get("llama_command"):
        notes.append(f"llama-server command (F32, no speculation; each arm adds its flags): {doc['llama_command']}")
    return lines + tail + notes


if __name__ == "__main__":
    main()
