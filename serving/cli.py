"""`sightline` command line: every ServerArgs field is a flag of each engine subcommand.

    sightline serve [FLAGS]               serve the model over HTTP (OpenAI-compatible API)
    sightline prepare-model [MODEL ...]   convert and cache models, build the native kernels (`make setup`)
    sightline generate --prompt TEXT      run the engine in-process on one prompt and print the text
    sightline models [--json]             list the registered model families and the bundled models

`python -m serving ...` is the same command.
"""

from __future__ import annotations

import argparse
import sys
import time

from serving.args import QUANTIZATIONS, ServerArgs


def _generate(ns: argparse.Namespace) -> int:
    from protocol.sampling_params import SamplingParams
    from serving.engine.loader import load_model
    from serving.engine.scheduler_core import SchedulerCore
    from serving.model_files import ModelLoadError

    args = ServerArgs.from_cli(ns)
    try:
        model = load_model(args.model, cache_dir=args.cache_dir_path, served_name=args.served_model_name)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    params = SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, seed=ns.seed)
    core = SchedulerCore(model, args)
    text = ns.prompt
    if not ns.raw and model.tokenizer.chat_template:
        text = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": ns.prompt}], tokenize=False, add_generation_prompt=True
        )
    ids = model.tokenizer(text)["input_ids"]
    try:
        req = core.add_request("cli", ids, params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    core.run_to_completion()
    dt = time.perf_counter() - t0
    print(model.tokenizer.decode(req.output_ids, skip_special_tokens=True))
    print(
        f"[{len(ids)} prompt + {len(req.output_ids)} new tokens, finish_reason={req.finish_reason.value}, "
        f"{dt:.2f} s, model loaded in {model.load_seconds:.1f} s]",
        file=sys.stderr,
    )
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from serving.frontend.launch import run_server

    return run_server(ServerArgs.from_cli(ns))


def _prepare(ns: argparse.Namespace) -> int:
    """The models converted and cached, then the native kernels built for this machine: a first start (a
    container's, a test run's) then finds both, instead of converting and compiling (~12 s of g++) itself."""
    import time

    from serving.model_files import main as loader_main

    rc = loader_main(ns.models)
    if rc == 0:
        from serving.models.layers import native

        t0 = time.perf_counter()
        try:
            print(f"native kernels: {native.build()} ({time.perf_counter() - t0:.1f} s)")
        except (OSError, RuntimeError) as exc:  # no g++: the server uses its torch implementations
            print(f"native kernels not built: {exc}", file=sys.stderr)
    return rc


def _models(ns: argparse.Namespace) -> int:
    import json

    from serving.model_files import bundled_models
    from serving.models.registry import FAMILIES

    # Every family is built from the same shared layers, so every engine mode applies to each; an encoder
    # (BERT) serves embeddings only, without a prefix cache, and is never read from a GGUF file.
    quantizations = [q for q in QUANTIZATIONS if q != "auto"]
    modes = {"dtype": ["float32", "bfloat16"], "quantization": quantizations, "prefix_cache": True}
    encoder = {
        "quantization": [q for q in quantizations if q != "gguf"],
        "prefix_cache": False,
        "embeddings_only": True,
    }
    families = [
        {
            "family": f.name,
            "architectures": list(f.architectures),
            "implementation": f.impl.__name__,
            "honours": f.honours,
            **modes,
            **(encoder if f.encoder else {}),
        }
        for f in FAMILIES
    ]
    bundled = bundled_models()
    if ns.json:
        print(json.dumps({"families": families, "bundled": bundled}, indent=2))
        return 0
    print("Model families (--model: a local Hugging Face directory or a .gguf file of any of them):")
    for f in families:
        print(f"  {f['family']:<8} {', '.join(f['architectures']):<26} {f['honours']}")
    print(
        f"  every decoder family: --dtype float32|bfloat16|auto, --quantization {'|'.join(quantizations)}, prefix "
        "caching; encoders: embeddings only, no prefix cache, no GGUF"
    )
    print("Bundled models (--model NAME):")
    for b in bundled:
        print(f"  {b['name']:<16} {b['description']}  [{b['status']}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sightline", description="Observability-first LLM serving stack.")
    sub = ap.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="serve the model over HTTP: OpenAI-compatible API, SSE streaming")
    ServerArgs.add_cli_args(srv)
    srv.set_defaults(func=_serve)
    prep = sub.add_parser("prepare-model", help="convert and cache models and build the native kernels ahead of time")
    prep.add_argument("models", nargs="*", help="model specs (default: smollm2-135m tiny-random)")
    prep.set_defaults(func=_prepare)
    gen = sub.add_parser("generate", help="generate from one prompt with the in-process engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    ServerArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)
    models = sub.add_parser("models", help="list the registered model families and the bundled models")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.set_defaults(func=_models)
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as exc:  # ServerArgs validation
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
