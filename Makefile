# sgl_agentcache: every target builds what it needs from this repository's own files.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test test-fast demo demo-server bench bench-server bench-all bench-quick soak clean

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

## demo: the replay suite (every policy x workload, two pressure points) on CPU in a few minutes;
##       prints the tables and writes results.json and the plots to $(DEMO_OUT).
DEMO_OUT ?= demo-report
demo: setup
	SGLANG_USE_CPU_ENGINE=1 $(VENV)/bin/sgl-agentcache replay --suite --quick --out $(DEMO_OUT)

## demo-server: start SGLang on CPU with the agentcache backend and run a forked agent program.
demo-server: setup
	SGLANG_USE_CPU_ENGINE=1 $(VENV)/bin/sgl-agentcache demo

## bench: regenerate the replay-side results under bench/results/ (replay suite: every system at equal
##        pool and host tier, 10 seeds, real traces; 38 real sessions with intervals over sessions; the
##        inference attribution; the admission orders on the same sessions; tree overhead), then the
##        results blocks of README.md and bench/README.md. CPU only, 2 worker processes; about 20 minutes
##        on a quiet 2-core machine (bench/README.md has the times).
bench: setup
	SGLANG_USE_CPU_ENGINE=1 $(VENV)/bin/sgl-agentcache replay --suite --out bench/results/replay
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/real_sessions.py
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/inference_attribution.py
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/admission.py
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/tree_overhead.py
	$(PY) bench/readme_results.py --write

## bench-server: the real-server side (real SGLang CPU servers: the server benchmark, the replay against
##               the server, the L3 failover), then the results blocks; about 45 minutes on 2 cores.
bench-server: setup
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/server_recompute.py
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/replay_vs_server.py
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/l3_failover.py
	$(PY) bench/readme_results.py --write

## bench-all: both of the above (the cluster run stays separate: bench/README.md).
bench-all: bench bench-server

## bench-quick: a smoke run of the same benchmarks (small traces, few seeds) into $(QUICK_OUT); commits nothing.
QUICK_OUT ?= bench-quick
bench-quick: setup
	SGLANG_USE_CPU_ENGINE=1 $(VENV)/bin/sgl-agentcache replay --suite --quick --out $(QUICK_OUT)/replay
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/real_sessions.py --quick --out $(QUICK_OUT)
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/inference_attribution.py --quick --out $(QUICK_OUT)
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/admission.py --quick --out $(QUICK_OUT)
	SGLANG_USE_CPU_ENGINE=1 $(PY) bench/server_recompute.py --quick --out $(QUICK_OUT)

## soak: three phases of 160 s, each on a fresh CPU server on SGLang's HiCache: concurrent agents (forks,
##       pauses, prefetches, closes, aborts) with lazy pauses, then eager pauses, then two tenants, one of them
##       flooding; leak and integrity checks after each; writes bench/results/soak.json.
soak: setup
	SGLANG_USE_CPU_ENGINE=1 $(VENV)/bin/sgl-agentcache soak --seconds 160 --workers 6 --out bench/results/soak.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist *.egg-info $(DEMO_OUT) $(QUICK_OUT)
