#!/usr/bin/env bash
# Our lifecycle on SGLang's own HiCache on a CUDA GPU (issue #36 item 7), against SGLang's HiCache alone.
#
# Needs: a GPU machine with SGLang 0.5.23 and its CUDA stack (sgl_kernel, flashinfer) and this package
# installed (`pip install ".[serve,bench]"`); no network, no weights (random-weight model built here).
# Runs bench/server_recompute.py in --gpu mode: the same branch_heavy traces, device pool and host
# tokens for both systems, HiCache with --hicache-io-backend kernel --hicache-mem-layout page_first
# --hicache-write-policy write_back, both under --schedule-policy lpm; passes interleaved.
#
#   bash bench/gpu/hicache_lifecycle.sh            # results in bench/gpu/results/
#   OUT=/some/dir bash bench/gpu/hicache_lifecycle.sh
#
# Budget (estimates, not measured: no GPU run yet): QUICK=1 (two passes of the quick trace, a few minutes
# with start-ups) fits a short lent slot; the default (3 traces x 6 passes of the full trace) is longer.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-bench/gpu/results}"
PY="${PYTHON:-python}"
BACKENDS="hicache-wb-lpm,agentcache-lpm"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')"
"$PY" -c "import sglang, sgl_kernel; assert sglang.__version__ == '0.5.23', sglang.__version__"
if [[ "${QUICK:-0}" == "1" ]]; then
  exec "$PY" bench/server_recompute.py --gpu --quick --backends "$BACKENDS" --out "$OUT"
fi
exec "$PY" bench/server_recompute.py --gpu --backends "$BACKENDS" --trace-seeds 3 --out "$OUT"
