# qwen-trt — the two newcomer commands are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
GPU ?= a10
MODEL ?=
QUANT ?=
TINY ?= .models/tiny-qwen3
# A machine without an NVIDIA driver gets torch 2.13.0 (a CPU build where one is at hand);
# a GPU machine gets the normal CUDA build. Override with TORCH_SPEC / TORCH_PIP_ARGS.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.4,torch==2.13.0)
TORCH_PIP_ARGS ?=

.PHONY: setup demo test docs-settings test-compat test-kernels tiny chat engine bench bench-constrained bench-http bench-ui bench-health bench-front-door bench-sanitize onnx serve loadtest check-clients clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	$(PIP) install -q -e ".[dev]"
	touch $@

tiny: setup
	test -f $(TINY)/config.json || $(VENV)/bin/qwen-trt tiny-model $(TINY)

# Chat app in the browser; on the offline tiny model when there is no GPU and no MODEL given.
# No file watcher: it only matters while editing app.py, and on a busy machine it floods the
# terminal with "Inotify queue overflowed".
STREAMLIT_ARGS ?= --browser.gatherUsageStats false --server.fileWatcherType none
demo: setup
	@if [ -z "$(MODEL)" ] && [ -z "$(HAS_GPU)" ]; then \
	  $(MAKE) --no-print-directory tiny; \
	  echo "No GPU here: running the app on the offline tiny demo model ($(TINY)); its replies are gibberish by design."; \
	  $(VENV)/bin/streamlit run app.py $(STREAMLIT_ARGS) -- --model $(TINY); \
	else \
	  $(VENV)/bin/streamlit run app.py $(STREAMLIT_ARGS) -- $(if $(MODEL),--model $(MODEL)); \
	fi

chat: setup
	$(VENV)/bin/qwen-trt chat $(if $(MODEL),--model $(MODEL),--model $(TINY))

# CPU test suite (CUDA and TensorRT-LLM tests skip themselves without a GPU / tensorrt_llm).
test: setup
	$(PY) -m pytest -q

# README's configuration table and docs/settings.md, made from qwen_trt/settings.py (the one
# source of every QWEN_TRT_* variable); tests/test_settings.py fails when they are stale.
docs-settings:
	$(PY) -m qwen_trt.settings --write

# The core suite again under transformers 4.57 (what TensorRT-LLM 1.2 pins), in its own venv.
COMPAT_VENV ?= .venv-tf457
CORE_TESTS := tests/test_tiny_model.py tests/test_detokenizer.py tests/test_chat_session.py \
	tests/test_torch_backend.py tests/test_generation.py tests/test_model_source.py tests/test_cli.py
test-compat:
	test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS) "transformers==4.57.*" \
	  tokenizers safetensors huggingface_hub tqdm pytest
	$(COMPAT_VENV)/bin/pip install -q --no-deps -e .
	$(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(CORE_TESTS)

# The fast path's Triton kernels in Triton's CPU interpreter. Triton is not a dependency of the
# CPU install (and must not replace the one a CUDA torch pins), so a copy goes in its own folder.
TRITON_DIR ?= .venv-triton
TRITON_SPEC ?= triton==3.5.0
test-kernels: setup
	test -d $(TRITON_DIR)/triton || $(PIP) install -q --target $(TRITON_DIR) --no-deps "$(TRITON_SPEC)"
	QWEN_TRT_TRITON_PATH=$(TRITON_DIR) $(PY) -m pytest -q -p no:cacheprovider tests/test_fast_kernels_interpret.py tests/test_paged_kernels_interpret.py tests/test_quant_kernels_interpret.py

# The OpenAI-compatible API on 127.0.0.1:8000 (the tiny model when there is no GPU and no MODEL);
# SERVE_ARGS="--port 9000 --api-key KEY ..." passes more flags (qwen-trt serve --help).
serve: setup
	@if [ -z "$(MODEL)" ] && [ -z "$(HAS_GPU)" ]; then \
	  $(MAKE) --no-print-directory tiny; \
	  echo "No GPU here: serving the offline tiny demo model ($(TINY)); its replies are gibberish by design."; \
	  $(VENV)/bin/qwen-trt serve --model $(TINY) $(SERVE_ARGS); \
	else \
	  $(VENV)/bin/qwen-trt serve $(if $(MODEL),--model $(MODEL)) $(SERVE_ARGS); \
	fi

# aiperf (NVIDIA's load tester) against qwen-trt serve on the tiny model, offline, on CPU, in its
# own venv (aiperf needs Python >= 3.11 and pins huggingface-hub < 2). Figures: docs/benchmarks.md.
# Knobs (environment, see scripts/loadtest.sh): CONCURRENCY=1,4 REQUESTS=16 ISL OSL TURNS=1.
AIPERF_VENV ?= .venv-aiperf
AIPERF_PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3.13 || echo python3)
AIPERF_SPEC ?= aiperf==0.13.0 "huggingface-hub<2"
loadtest: setup tiny
	test -x $(AIPERF_VENV)/bin/aiperf || { $(AIPERF_PYTHON) -m venv $(AIPERF_VENV) && \
	  $(AIPERF_VENV)/bin/pip install -q $(AIPERF_SPEC); }
	AIPERF=$(AIPERF_VENV)/bin/aiperf SERVE=$(VENV)/bin/qwen-trt scripts/loadtest.sh $(if $(MODEL),$(MODEL),$(TINY))

# QUANT=fp8 | int4_awq | int8_wo | int4_wo: a quantized engine in engines/<gpu>-<quant>/.
# Real clients against qwen-trt serve on the tiny model: schemathesis from its /openapi.json and
# from OpenAI's spec (tests/openai_schemas/endpoints.json): no 5xx, replies match the spec; then
# Open WebUI with its default settings in headless Chromium (the model listed, a chat streams a
# reply). Not in CI: schemathesis and Open WebUI (~7 GB) install in their own venvs. Runs are
# recorded in docs/deploy.md.
CLIENTS_VENV ?= .venv-clients
SCHEMATHESIS_SPEC ?= schemathesis>=4,<5
WEBUI_VENV ?= .venv-webui
WEBUI_SPEC ?= open-webui==0.12.4
check-clients: setup tiny
	test -x $(CLIENTS_VENV)/bin/schemathesis || { python3 -m venv $(CLIENTS_VENV) && \
	  $(CLIENTS_VENV)/bin/pip install -q "$(SCHEMATHESIS_SPEC)"; }
	ST=$(CLIENTS_VENV)/bin/schemathesis SERVE=$(VENV)/bin/qwen-trt scripts/check_clients.sh $(if $(MODEL),$(MODEL),$(TINY))
	test -x $(WEBUI_VENV)/bin/open-webui || { python3 -m venv $(WEBUI_VENV) && \
	  $(WEBUI_VENV)/bin/pip install -q "$(WEBUI_SPEC)"; }
	$(PY) scripts/check_webui.py --webui $(WEBUI_VENV)/bin/open-webui --serve $(VENV)/bin/qwen-trt

engine: setup
	$(VENV)/bin/qwen-trt build --gpu $(GPU) $(if $(MODEL),--model $(MODEL)) $(if $(QUANT),--quant $(QUANT))

bench: setup
	$(VENV)/bin/qwen-trt bench $(BENCH_ARGS)

# What constrained decoding and logprobs cost on the fast path (GPU; MODEL = a checkpoint with
# its tokenizer, e.g. python -m qwen_trt.bench.shaped_model DIR): qwen_trt/bench/constrained.py.
bench-constrained: setup
	mkdir -p bench-results
	$(PY) -m qwen_trt.bench.constrained --model $(MODEL) --out bench-results/constrained.json $(BENCH_CONSTRAINED_ARGS)

# On-screen latency of the chat app in headless Chromium (tiny model): docs/app.md.
# The served path vs the in-process runner on one closed-loop workload (qwen_trt.bench.served):
# make bench-http MODEL=DIR [BENCH_HTTP_ARGS="--concurrency 1,8,32,64 --max-batch 32"]
bench-http: setup
	$(VENV)/bin/qwen-trt bench --http --model $(MODEL) --out bench-results/served.json $(BENCH_HTTP_ARGS)

bench-ui: setup
	$(PY) -m qwen_trt.bench.ui_latency --turns 1,100 --repeats 3 --uncapped --out bench-results/ui-latency.json $(BENCH_UI_ARGS)

# /health latency while the API handles one 10 MB request (tiny model, CPU): docs/deploy.md.
bench-health: setup
	$(PY) -m qwen_trt.bench.health_latency --mb 10 --out bench-results/health-latency.json $(BENCH_HEALTH_ARGS)

# The API's cost per request and per token against a paced fake engine (CPU): docs/benchmarks.md.
# make bench-front-door [MODEL=DIR with a tokenizer] [BENCH_FRONT_DOOR_ARGS="--words 400"]
bench-front-door: setup
	$(PY) -m qwen_trt.bench.front_door $(if $(MODEL),--model $(MODEL)) --out bench-results/front-door.json $(BENCH_FRONT_DOOR_ARGS)

# CPU time of the app's Markdown sanitiser per streamed chunk and per reply (seconds to run).
bench-sanitize: setup
	$(PY) -m qwen_trt.bench.sanitize_speed --out bench-results/sanitize-speed.json

onnx: setup tiny
	$(VENV)/bin/qwen-trt export-onnx $(if $(MODEL),--model $(MODEL),--model $(TINY)) --out build/out/onnx $(if $(FORCE),--force)

clean:
	rm -rf build/out .pytest_cache
