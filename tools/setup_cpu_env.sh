#!/usr/bin/env bash
# Build the CPU-only development/test environment from this repository's own files.
#
#   tools/setup_cpu_env.sh [VENV_DIR]     (default: .venv)
#
# Installs, in order: CPU torch (pinned), sglang==0.5.23 without its CUDA-heavy
# dependency list, the exact lock in requirements/cpu-lock.txt (--no-deps, so
# nothing resolves to a CUDA wheel), this project in editable mode, and the two
# CPU-only shims (`sgl-agentcache cpu-setup`, from sgl_agentcache/cpu_setup/).
# The venv is reused while the inputs (lock, shims, pyproject, this script) are
# unchanged: a stamp file holds their hash.
#
# The sgl_kernel placeholder installed here is for CPU tests only. It must never
# be installed next to a real GPU SGLang (it would shadow the real kernels):
# cpu-setup refuses a CUDA/ROCm torch or a visible GPU, and the placeholder
# refuses to import next to a GPU build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23

inputs_hash=$(cat requirements/cpu-lock.txt pyproject.toml tools/setup_cpu_env.sh \
  sgl_agentcache/cpu_setup/*.py sgl_agentcache/cpu_setup/shims/*.py sgl_agentcache/cpu_setup/shims/sgl_kernel/*.py \
  | sha256sum | cut -c1-16)
stamp="$VENV/.sgl_agentcache-env-$inputs_hash"
if [[ -f "$stamp" ]]; then
  echo "setup: $VENV is up to date ($inputs_hash)"
  exit 0
fi

echo "setup: building $VENV ($inputs_hash)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# pip install, with the noise of this machine's unused local index entries filtered out.
pip_install() {
  local log rc=0
  log=$(mktemp)
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
  rm -f "$log"
  return $rc
}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" > "$constraints"

# 1. CPU torch. Every later call is constrained to it, so nothing can swap in a CUDA build.
# Elsewhere, point TORCH_INDEX_URL at a CPU wheel index (e.g. PyTorch's /whl/cpu) to avoid a CUDA build.
pip_install "torch==$TORCH_VERSION" -c "$constraints" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# 2. SGLang itself; its declared dependencies are CUDA builds we cannot use here.
pip_install --no-deps "sglang==$SGLANG_VERSION"
# 3. The exact set of packages SGLang imports on CPU plus our test/bench tooling.
pip_install --no-deps -r requirements/cpu-lock.txt -c "$constraints"
# 4. This project, editable.
pip_install --no-deps --no-build-isolation -e . -c "$constraints"
# 5. CPU shims: the sgl_kernel placeholder and torchvision op schemas (start-up .pth hook).
"$VENV/bin/sgl-agentcache" cpu-setup

SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" - <<'PY'
import torch, sglang, sgl_agentcache
import sglang.srt.mem_cache.unified_radix_cache  # the module our backend subclasses
assert not torch.cuda.is_available(), "CPU environment expected"
print(f"setup: ok torch={torch.__version__} sglang={sglang.__version__}")
PY
touch "$stamp"
