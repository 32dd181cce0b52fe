#!/usr/bin/env bash
# GPU checks on a machine with a CUDA device and no network: the GPU tests (tests/gpu) and the
# GPU<->arena copy bandwidth benchmark (benchmarks/ttft.py --gpu --quick).
#
# The project is not pip-installed: the repo root and connectors/ go on PYTHONPATH. Packages the
# machine lacks come as wheels in .whl/ (cp312, manylinux, --no-deps), installed into /tmp/site.
# Everything is logged to $OUT/gpu_check.log; the benchmark's JSON goes to $OUT/ttft_gpu.json.
# Every step runs whatever the one before it did; the script exits non-zero if any step failed.
#
# Usage: bash scripts/gpu_check.sh    (PYTHON picks the interpreter; default python3)

set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/gpu_out}
PY=${PYTHON:-python3}
SITE=/tmp/site
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
export PYTHONUNBUFFERED=1

STEPS=()
CODES=()

# run_step NAME TIMEOUT_S CMD...: runs CMD, records its exit code, never stops the script
run_step() {
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== ${name} ($(date -u +%H:%M:%S)) ==="
    local start=$SECONDS rc=0
    # through bash, so that CMD may be one of the exported functions below
    timeout --kill-after=10 "$limit" bash -c '"$@"' bash "$@" || rc=$?
    [ "$rc" -eq 124 ] && echo "${name}: timed out after ${limit} s"
    echo "=== ${name}: exit ${rc} in $((SECONDS - start)) s ==="
    STEPS+=("$name")
    CODES+=("$rc")
}

install_wheels() {
    rm -rf "$SITE"
    mkdir -p "$SITE"
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        echo "no .whl/ here: nothing to install"
        return 0
    fi
    ls -l .whl/
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl
    else
        # no pip: these wheels have no .data/ parts, so unpacking them is installing them
        echo "no pip for $PY: unpacking the wheels into $SITE"
        "$PY" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$SITE" .whl/*.whl
    fi
}

show_env() {
    local rc=0
    "$PY" - <<'EOF' || rc=$?
import sys

import torch

print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("torch.cuda.is_available()", torch.cuda.is_available())
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"cuda:{i}", torch.cuda.get_device_name(i))
EOF
    # what the project imports from the wheels, and from where
    "$PY" - <<'EOF' || rc=$?
import importlib
import importlib.metadata as md

for dist, mod in [
    ("pydantic", "pydantic"),
    ("pydantic_core", "pydantic_core"),
    ("lmdb", "lmdb"),
    ("protobuf", "google.protobuf"),
    ("grpcio", "grpc"),
    ("grpcio-health-checking", "grpc_health.v1.health"),
    ("grpcio-reflection", "grpc_reflection.v1alpha.reflection"),
    ("typing_extensions", "typing_extensions"),
]:
    m = importlib.import_module(mod)
    print(f"{dist:24} {md.version(dist):12} {m.__file__}")
import kvtier.rpc  # the generated stubs check the protobuf and grpcio runtimes
import kvtier_vllm.copies

print("kvtier imports:", kvtier.rpc.__name__, kvtier_vllm.copies.__name__, "ok")
EOF
    return "$rc"
}

bench() {
    local rc=0
    "$PY" benchmarks/ttft.py --gpu --quick --json >"$OUT/ttft_gpu.json" || rc=$?
    echo "--- $OUT/ttft_gpu.json ---"
    cat "$OUT/ttft_gpu.json"
    return "$rc"
}

main() {
    echo "gpu_check in $ROOT, $(date -u +%FT%TZ), logging to $LOG"
    run_step wheels 120 install_wheels
    export PYTHONPATH=$SITE:$ROOT:$ROOT/connectors
    echo "PYTHONPATH=$PYTHONPATH"
    run_step nvidia-smi 60 nvidia-smi -L
    run_step env 120 show_env
    run_step gpu-tests 300 "$PY" -m pytest -q -p no:cacheprovider --basetemp /tmp/kvt-gpu-pytest \
        --junitxml "$OUT/gpu_tests.xml" tests/gpu -rA
    run_step ttft-gpu 300 bench

    echo
    echo "=== summary ==="
    local failed=0 i
    for i in "${!STEPS[@]}"; do
        printf '%-12s exit %s\n' "${STEPS[$i]}" "${CODES[$i]}"
        [ "${CODES[$i]}" -eq 0 ] || failed=1
    done
    if [ "$failed" -eq 0 ]; then echo "gpu_check: all steps passed"; else echo "gpu_check: FAILED"; fi
    return "$failed"
}

export -f install_wheels show_env bench
export PY SITE OUT
main 2>&1 | tee "$LOG"
