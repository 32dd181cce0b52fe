#!/usr/bin/env bash
# Install kvtier into .venv and run kvtierd on the embedded default (arena in /dev/shm, lmdb under
# $XDG_STATE_HOME/kvtier, no object store). Extra arguments go to `kvtier serve`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${KVTIER_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e .
exec "$VENV/bin/kvtier" serve "$@"
