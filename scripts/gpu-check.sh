#!/usr/bin/env bash
# The GPU check, from a fresh clone on a machine with an NVIDIA GPU, in under 8 minutes:
#
#   1. installs vLLM's CUDA build at the supported version with kvtier (its `vllm` extra) into a
#      virtual environment of its own (KVTIER_GPU_VLLM picks the version, default 0.32.0);
#   2. runs tests/gpu: the arena registered with cudaHostRegister, copies on a side stream;
#   3. runs benchmarks/gpu_e2e.py on CUDA: embedded and sidecar, exact greedy outputs against
#      vLLM alone, external hits in a fresh engine, a draft pool with its own KV dtype;
#   4. runs benchmarks/ttft.py --gpu: GPU<->arena copy bandwidth against cudaMemcpyAsync from
#      pinned memory, in the same run.
#
# Prints one JSON object on stdout; the steps' output goes to $OUT/gpu-check.log (OUT defaults
# to ./gpu-check-out). Exits 0 when every step passed, 1 when one failed or could not run, and 2
# when this machine has no NVIDIA GPU.
#
# Where no package index is reachable, vLLM cannot be installed: the script then runs steps 2
# and 4 with the machine's python3 (PYTHON picks another) and the wheels in .whl/ (cp312,
# manylinux, --no-deps) for what it lacks, and reports step 3 as not run.

set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
VLLM_VERSION=${KVTIER_GPU_VLLM:-0.32.0}
PY=${PYTHON:-python3}
# the environment it installs: large, and nothing a reader of the results needs
WORK=${KVTIER_GPU_WORK:-/tmp/kvtier-gpu-check}
mkdir -p "$OUT/steps" "$WORK"
LOG=$OUT/gpu-check.log
: >"$LOG"
export PYTHONUNBUFFERED=1
STARTED=$SECONDS

if ! nvidia-smi -L >>"$LOG" 2>&1; then
  printf '{"gpu": false, "ok": false, "reason": "no NVIDIA GPU: nvidia-smi -L failed"}\n'
  exit 2
fi

# step NAME LIMIT_S CMD...: runs CMD with a time limit, its output to the log; records exit
# status and seconds in $OUT/steps/NAME.json; never stops the script
step() {
  local name=$1 limit=$2 begun=$SECONDS rc=0
  shift 2
  echo "=== $name ($(date -u +%T)) ===" >>"$LOG"
  # through bash, so that CMD may be a function exported below
  timeout --kill-after=10 "$limit" bash -c '"$@"' bash "$@" >>"$LOG" 2>&1 || rc=$?
  [ "$rc" -eq 124 ] && echo "$name: timed out after $limit s" >>"$LOG"
  printf '{"exit": %d, "seconds": %d}\n' "$rc" $((SECONDS - begun)) >"$OUT/steps/$name.json"
  echo "=== $name: exit $rc in $((SECONDS - begun)) s ===" >>"$LOG"
  return "$rc"
}

install_vllm() {
  # a machine with no index reachable fails here in seconds, not after every retry below
  "$PY" -m pip index versions vllm --retries 0 --timeout 10 2>/dev/null |
    grep -q "\b$VLLM_VERSION\b" || {
    echo "no package index reachable here lists vllm $VLLM_VERSION"
    return 1
  }
  "$PY" -m venv "$WORK/venv" &&
    "$WORK/venv/bin/python" -m pip install --quiet --disable-pip-version-check --retries 1 \
      --timeout 20 "$ROOT[vllm,s3]" "vllm==$VLLM_VERSION" pytest pytest-timeout pyyaml
}

# the machine's own python with the carried wheels and the checkout on the path
fallback_env() {
  local site=$WORK/site
  rm -rf "$site" && mkdir -p "$site"
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      .whl/*.whl
  fi
  export PYTHONPATH=$site:$ROOT:$ROOT/connectors
}

export -f install_vllm
export OUT PY ROOT VLLM_VERSION WORK
if step install-vllm 300 install_vllm; then
  RUN=$WORK/venv/bin/python
  VLLM=installed
else
  fallback_env
  RUN=$PY
  VLLM="not installed: no package index reachable, or the install failed (see the log)"
fi
echo "python: $RUN; vLLM: $VLLM" >>"$LOG"

step gpu-tests 240 "$RUN" -m pytest -q -p no:cacheprovider --basetemp /tmp/kvt-gpu-tests \
  --junitxml "$OUT/gpu-tests.xml" tests/gpu -rA
if [ "$VLLM" = installed ]; then
  step e2e 300 "$RUN" -m benchmarks.gpu_e2e --require-cuda --out "$OUT/e2e.json" \
    --cache-dir /tmp/kvt-gpu-e2e
fi
step bandwidth 240 bash -c "'$RUN' -m benchmarks.ttft --gpu --quick --json >'$OUT/bandwidth.json'"

"$PY" - "$OUT" "$VLLM" "$VLLM_VERSION" $((SECONDS - STARTED)) <<'PYEOF'
import json, subprocess, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, vllm, version, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])

def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

steps = {p.stem: load(p) for p in sorted((out / "steps").glob("*.json"))}
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
tests = None
if (out / "gpu-tests.xml").exists():
    suite = ET.parse(out / "gpu-tests.xml").getroot().find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
e2e = load(out / "e2e.json") or {"ran": False, "reason": f"vLLM {version}: {vllm}"}
result = {
    "gpu": gpu,
    "vllm": {"version": version, "status": vllm},
    "seconds": seconds,
    "steps": steps,
    "gpu_tests": tests,
    "e2e": e2e,
    "bandwidth": load(out / "bandwidth.json"),
}
result["ok"] = bool(
    vllm == "installed"
    and all(s and s["exit"] == 0 for s in steps.values())
    and tests and tests["tests"] > 0 and not tests["failures"] and not tests["errors"]
    and e2e.get("ok")
)
print(json.dumps(result, indent=1, sort_keys=True))
sys.exit(0 if result["ok"] else 1)
PYEOF
