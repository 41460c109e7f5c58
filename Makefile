# sgl_agentcache: every target builds what it needs from this repository's own files.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test test-fast demo clean

## setup: CPU dev/test virtualenv (CPU torch, sglang==0.5.23, exact lock, CPU shims, this package editable).
##        Reused while requirements/cpu-lock.txt, pyproject.toml, the shims and the script are unchanged.
setup:
	@bash tools/setup_cpu_env.sh $(VENV)

## test: the full suite, including a real SGLang server and Engine on CPU.
test: setup
	SGLANG_USE_CPU_ENGINE=1 $(PY) -m pytest -p no:cacheprovider -W ignore::UserWarning $(PYTEST_ARGS)

## test-fast: skip tests that start SGLang processes.
test-fast: setup
	SGLANG_USE_CPU_ENGINE=1 $(PY) -m pytest -m "not server and not engine" $(PYTEST_ARGS)

## demo: start SGLang on CPU with the agentcache backend and run a forked agent program.
demo: setup
	SGLANG_USE_CPU_ENGINE=1 $(VENV)/bin/sgl-agentcache demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
