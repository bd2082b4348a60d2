# Two commands do everything: `make demo` and `make test`. Both create .venv if it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

PACKERS_STAMP := .venv-packers/.packers-installed

.PHONY: demo test env packers bench clean engines test-engines engines-sglang test-engines-sglang

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel of 2.13.0 (a plain `torch` would pull a CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(BIN)/moeconv demo

# The real AutoAWQ / auto-gptq / GPTQModel / AutoRound packers live in their own venv (.venv-packers);
# tests/test_real_packers.py cross-checks moeconv's codecs against them.
packers:
	PYTHON=$(PYTHON) scripts/install-packers.sh

test: $(STAMP) packers
	$(BIN)/python -m pytest

# Optional, not part of `make test` or CI: vLLM 0.33.0 in its own venv (7-8 GB, about 10 minutes),
# then every backend's output loaded with vLLM's own model classes and weight loaders on the CPU,
# the triton outputs served through moeconv's vLLM plugin (loader, vLLM's Triton kernel), and the
# plugin's MoE parameters against stock vLLM's for each choice of vLLM's MoE oracle (differential).
ENGINES_STAMP := .venv-engines/.engines-installed

$(ENGINES_STAMP): pyproject.toml
	test -x .venv-engines/bin/python || $(PYTHON) -m venv .venv-engines
	.venv-engines/bin/pip install -q vllm==0.33.0
	# moeconv itself, beside vLLM (no deps: vLLM's torch stays), for its vllm.general_plugins entry point.
	.venv-engines/bin/pip install -q --no-deps -e . blake3 google-re2
	touch $(ENGINES_STAMP)

engines: $(ENGINES_STAMP)

test-engines: $(STAMP) $(ENGINES_STAMP)
	$(BIN)/python tests/engines/run_matrix.py
	$(BIN)/python tests/engines/run_plugin.py
	$(BIN)/python tests/engines/run_differential.py
	$(BIN)/python tests/engines/gpt_oss_bf16.py vllm

# SGLang 0.5.23 beside moeconv's outputs, on the CPU (tests/engines/sglang_load.py): its own venv, its
# pinned torch (2.14.1, the CUDA build PyPI serves; it imports without a GPU), the packages its model
# classes and loaders import (tests/engines/sglang-requirements.txt), then sglang without its GPU-kernel deps,
# then moeconv (its SGLang plugin). The triton outputs SGLang loads through the plugin are then checked with
# SGLang's own Triton MoE kernel under TRITON_INTERPRET=1 (tests/engines/sglang_plugin_check.py).
SGLANG_STAMP := .venv-sglang/.sglang-installed

$(SGLANG_STAMP): tests/engines/sglang-requirements.txt pyproject.toml
	test -x .venv-sglang/bin/python || $(PYTHON) -m venv .venv-sglang
	.venv-sglang/bin/pip install -q -r tests/engines/sglang-requirements.txt
	.venv-sglang/bin/pip install -q --no-deps sglang==0.5.23
	# moeconv itself, beside SGLang (no deps: SGLang's torch stays), for its sglang.srt.plugins entry point.
	.venv-sglang/bin/pip install -q --no-deps -e . blake3 google-re2
	touch $(SGLANG_STAMP)

engines-sglang: $(SGLANG_STAMP)

test-engines-sglang: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/python tests/engines/run_matrix_sglang.py
	$(BIN)/python tests/engines/gpt_oss_bf16.py sglang

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_convert.py

clean:
	rm -rf $(VENV) .venv-packers .venv-engines .venv-sglang build dist *.egg-info
