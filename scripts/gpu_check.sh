#!/usr/bin/env bash
# The CUDA/NCCL path on a GPU machine (one GPU is enough; no network needed): builds the CUDA
# variant of fastcomm; a smoke test on NCCL channels and on CUDA IPC links apart; then
# benchmarks/device_launch_queue.py (how much one stream takes before the host blocks, per kind
# of entry, without fastcomm); benchmarks/device_streams.py (stream semantics and host cost
# against torch NCCL; the run-ahead of fastcomm alone on each channel kind and CUDA queue
# setting) and benchmarks/device_ipc.py
# (same-host channels over CUDA IPC against torch NCCL; a 64 MiB ring; under MPS);
# benchmarks/device_graphs.py (a captured plan replayed, against no graph and torch NCCL's graphs;
# same-host pairs of a plan's graph go over IPC links of its own, so test_device_graphs.py and
# test_device_user_graphs.py below run them too);
# tests/test_device_collectives.py on CUDA tensors (FASTCOMM_DEVICE_TEST=cuda); the rest of
# tests/test_nccl.py (several ranks share the GPU, each with its own NCCL_HOSTID; same-host pairs
# go over IPC unless FASTCOMM_DEVICE_IPC=0); the MoE and pipeline examples on CUDA against torch
# NCCL; benchmarks/forum_mwe.py at 1, 2, 4, 8 pairs (CPU scaling on this machine's cores);
# benchmarks/pair_breakdown.py (where one pair's op spends its time, perf where it runs); and
# benchmarks/nccl_pairs.py (fastcomm vs torch NCCL).
# It writes a Markdown report to ${OUT:-reports}/gpu_check.md (each step's command, exit code,
# wall time and output tail; the whole logs go to gpu_check.log beside it, and each GPU
# benchmark's figures to a JSON file of its own: 8 files in all, the most the device machine
# sends back, so the CPU benchmarks' figures are in the report and the log only).
#
# Exit status: non-zero if the build or a test step failed or was not run (benchmark failures
# are reported, not counted).
# Python: $FASTCOMM_GPU_PYTHON, else .venv-cuda, else python3 or python, whichever has a CUDA
# build of torch and NCCL (the nvidia-nccl-cu* wheel, or FASTCOMM_NCCL_ROOT); else a new
# .venv-cuda from the configured package index, as scripts/check_cuda_build.sh makes it.
# The module is built in build/gpu-check (or $FASTCOMM_GPU_BUILD_DIR) and staged with the
# package in its pkg/ folder (the source tree's own module is left alone). The run keeps within
# FASTCOMM_GPU_CHECK_BUDGET seconds (default 530): each step has its own timeout, cut to what is
# left. FASTCOMM_GPU_CHECK_ONLY (comma-separated words) runs only the steps whose names contain
# one of them, besides the machine's description and the build (a rerun of what one run left
# out). A user-set NCCL_DEBUG reaches every rank unchanged.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
REPORT_DIR=${OUT:-reports}
mkdir -p "$REPORT_DIR"
REPORT_DIR=$(cd "$REPORT_DIR" && pwd)
REPORT=$REPORT_DIR/gpu_check.md
FULL_LOG=$REPORT_DIR/gpu_check.log
BUDGET=${FASTCOMM_GPU_CHECK_BUDGET:-530}
START=$(date +%s)
BUILD=${FASTCOMM_GPU_BUILD_DIR:-$ROOT/build/gpu-check}
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
PKG=$BUILD/pkg
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export PYTHONUNBUFFERED=1
: > "$LOGS/summary"
: > "$LOGS/body.md"
: > "$FULL_LOG"
FAILED=0
BENCH_FAILED=0
N=0
PY=""
INFO="(not probed)"

write_report() {
  {
    echo "# fastcomm GPU check"
    echo
    echo "- started: $(date -u -d "@$START" +%FT%TZ 2>/dev/null || date -u +%FT%TZ); $(nproc) cores; budget ${BUDGET} s"
    echo "- python: ${PY:-none}; ${INFO}"
    echo "- NCCL_DEBUG: ${NCCL_DEBUG:-unset}; git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
    echo
    echo "| # | step | kind | result | exit | wall s |"
    echo "| --- | --- | --- | --- | --- | --- |"
    cat "$LOGS/summary"
    echo
    cat "$LOGS/body.md"
  } > "$REPORT.tmp" && mv "$REPORT.tmp" "$REPORT"
}

# selected KIND NAME: whether FASTCOMM_GPU_CHECK_ONLY lets the step run (env, info and the
# build always run).
selected() {
  local word
  [ -z "${FASTCOMM_GPU_CHECK_ONLY:-}" ] && return 0
  case "$1:$2" in env:* | info:* | *"build the CUDA"*) return 0 ;; esac
  for word in ${FASTCOMM_GPU_CHECK_ONLY//,/ }; do
    case "$2" in *"$word"*) return 0 ;; esac
  done
  return 1
}

# step KIND NAME WANT_S COMMAND: runs COMMAND (a bash script) under `timeout`, at most WANT_S
# seconds and never past the budget; KIND "test" failures fail the run.
step() {
  local kind=$1 name=$2 want=$3 cmd=$4
  N=$((N + 1))
  local log=$LOGS/$N.log left limit rc wall result t0 t1
  left=$((BUDGET - ($(date +%s) - START) - 5))
  limit=$((want < left ? want : left))
  if ! selected "$kind" "$name"; then
    echo "== [$N] $name: not selected (FASTCOMM_GPU_CHECK_ONLY)" >&2
    echo "| $N | $name | $kind | not selected | - | 0 |" >> "$LOGS/summary"
    return 0
  fi
  if [ "$limit" -lt 10 ]; then
    rc="-"
    wall=0
    result="NOT RUN (time budget spent)"
    echo "(not run: the time budget was spent)" > "$log"
  else
    echo "== [$N] $name (timeout ${limit} s)" >&2
    t0=$(date +%s.%N)
    timeout --kill-after=15 "$limit" bash -c "$cmd" > "$log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    if [ "$rc" -eq 0 ]; then
      result="PASS"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      result="FAIL (timed out after ${limit} s)"
    else
      result="FAIL"
    fi
  fi
  case "$result" in
    PASS) ;;
    *) if [ "$kind" = test ]; then FAILED=$((FAILED + 1)); elif [ "$kind" = bench ]; then BENCH_FAILED=$((BENCH_FAILED + 1)); fi ;;
  esac
  echo "== [$N] $name: $result (exit $rc, ${wall} s)" >&2
  echo "| $N | $name | $kind | $result | $rc | $wall |" >> "$LOGS/summary"
  {
    echo "## $N. $name: $result"
    echo
    echo "- command: \`$(printf '%s\n' "$cmd" | awk 'BEGIN { ORS = "" } NR > 1 { print "; " } { print }')\`"
    echo "- exit code: $rc; wall time: $wall s; timeout: ${limit} s"
    echo
    echo '```text'
    tail -n 80 "$log" | cut -c1-400
    echo '```'
    echo
  } >> "$LOGS/body.md"
  {
    echo "===== [$N] $name: $result (exit $rc, $wall s)"
    echo "\$ $cmd"
    tail -c 1000000 "$log"
    echo
  } >> "$FULL_LOG"
  write_report
}

# ---- 1. environment: a Python with a CUDA torch and NCCL
find_python() {
  local probe='import sys, torch
if not torch.version.cuda: sys.exit(1)
import os
if not os.environ.get("FASTCOMM_NCCL_ROOT"):
    import nvidia.nccl'
  local py
  for py in "${FASTCOMM_GPU_PYTHON:-}" "$ROOT/.venv-cuda/bin/python" python3 python; do
    [ -n "$py" ] || continue
    py=$(command -v "$py" 2>/dev/null) || continue
    if "$py" -c "$probe" > /dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

PY=$(find_python || true)
if [ -z "$PY" ]; then
  step env "make .venv-cuda (no Python with a CUDA torch and NCCL found)" 240 "set -e
python3 -m venv '$ROOT/.venv-cuda'
'$ROOT/.venv-cuda/bin/python' -m pip install -q --disable-pip-version-check \"torch==\${FASTCOMM_CUDA_TORCH:-2.14.1}\" nvidia-nccl-cu13 numpy pybind11 ninja 'cmake>=3.18' pytest pytest-timeout"
  PY=$(find_python || true)
fi
if [ -z "$PY" ]; then
  echo "| - | no Python with a CUDA build of torch and NCCL | test | FAIL | - | 0 |" >> "$LOGS/summary"
  write_report
  echo "gpu_check: no Python with a CUDA torch and NCCL; report: $REPORT" >&2
  exit 1
fi
INFO=$("$PY" - 2>&1 <<'PYEOF' | tail -n 1
import glob, os, sys
import torch
try:
    import nvidia.nccl
    libs = glob.glob(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so*"))
    nccl = ", ".join(os.path.basename(p) for p in libs) or "?"
except Exception:
    nccl = os.environ.get("FASTCOMM_NCCL_ROOT", "?")
print(f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL library {nccl}")
PYEOF
)

step info "machine and GPU" 60 "nvidia-smi || true
echo
'$PY' -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available:\", torch.cuda.is_available(), \"devices:\", torch.cuda.device_count()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\")'
'$PY' -c 'import pytest; print(\"pytest\", pytest.__version__)' || '$PY' -m pip install -q --disable-pip-version-check pytest pytest-timeout || true
command -v nvcc && nvcc --version | tail -n 2
echo \"MPS control: \$(command -v nvidia-cuda-mps-control || echo none)\"
echo \"cores: \$(nproc)\"
lscpu 2>/dev/null | grep -E '^(Model name|Socket|Core|Thread|NUMA node\\(s\\)|L2|L3|Hypervisor)' || true
lscpu -e=CPU,CORE,SOCKET,NODE 2>/dev/null || true"

# ---- 2. build the CUDA variant and stage it with the package
step test "build the CUDA/NCCL variant (${BUILD#"$ROOT"/})" 300 "set -e
cd '$ROOT'
TORCH_PREFIX=\$('$PY' -c 'import torch; print(torch.utils.cmake_prefix_path)')
BIN=\$(dirname '$PY')
CMAKE=\$BIN/cmake; [ -x \"\$CMAKE\" ] || CMAKE=\$(command -v cmake)
NINJA=\$BIN/ninja; [ -x \"\$NINJA\" ] || NINJA=\$(command -v ninja || true)
GEN=(); [ -n \"\$NINJA\" ] && GEN=(-G Ninja -DCMAKE_MAKE_PROGRAM=\"\$NINJA\")
export TORCH_CUDA_ARCH_LIST=\${TORCH_CUDA_ARCH_LIST:-9.0}
\"\$CMAKE\" -S . -B '$BUILD' \"\${GEN[@]}\" -DCMAKE_BUILD_TYPE=Release -DFASTCOMM_NCCL=ON -DCMAKE_PREFIX_PATH=\"\$TORCH_PREFIX\" -DPython_EXECUTABLE='$PY' -DCMAKE_CUDA_COMPILER=\"\$CUDA_HOME/bin/nvcc\" -DCMAKE_CUDA_ARCHITECTURES=\${FASTCOMM_CUDA_ARCH:-90}
nice \"\$CMAKE\" --build '$BUILD' --target _C --parallel \$(nproc)
rm -rf '$PKG' && mkdir -p '$PKG/fastcomm'
cp fastcomm/*.py '$PKG/fastcomm/'
cp '$BUILD'/_C*.so '$PKG/fastcomm/'
cd '$PKG' && '$PY' -c 'import fastcomm, torch; assert fastcomm._C.has_nccl, \"built without the NCCL path\"; print(\"fastcomm\", fastcomm.__file__, \"has_nccl\", fastcomm._C.has_nccl)'"
BUILT=0
[ -f "$PKG/fastcomm/__init__.py" ] && ls "$PKG"/fastcomm/_C*.so > /dev/null 2>&1 && BUILT=1

# Everything below imports the staged package: the tests from its folder (pytest puts the
# working directory first on sys.path), the benchmarks through PYTHONPATH.
RUN="set -e; cd '$PKG'; export PYTHONPATH='$PKG' FASTCOMM_REQUIRE_GPU=1"
PYTEST="'$PY' -m pytest -q -s -rA -p no:cacheprovider --rootdir='$ROOT' '$ROOT/tests/test_nccl.py'"

if [ "$BUILT" = 1 ]; then
  # ---- 3. Ordered by what a session most needs to learn, each timeout about twice the step's
  # expected time (the build takes about a minute on 16 cores): first the smallest test on NCCL
  # channels and on IPC links apart, so a broken channel kind is named within a minute and the
  # later steps can be read against it; the tests on CUDA tensors and the examples (so the
  # default budget reaches them: a test step not run counts as failed); the CUDA command-buffer
  # probe and fastcomm's run-ahead per channel kind and setting; the figures against torch; the
  # variants that explain #35's; the CPU-only MWE last.
  step test "smoke: pair/triple/quad all_reduce on NCCL channels (FASTCOMM_DEVICE_IPC=0)" 60 \
    "$RUN; FASTCOMM_DEVICE_IPC=0 $PYTEST -k all_reduce_pairs_triples"
  step test "smoke: the same over CUDA IPC links (FASTCOMM_DEVICE_IPC=1), every process's streams on one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1)" 60 \
    "$RUN; FASTCOMM_DEVICE_IPC=1 CUDA_DEVICE_MAX_CONNECTIONS=1 $PYTEST -k all_reduce_pairs_triples"
  step test "tests/test_device_collectives.py, test_device_any_source.py, test_device_graphs.py and test_device_user_graphs.py on CUDA tensors (reduce, gather, scatter, all_to_all(_single), flat and coalesced forms, batch, plan, backend, recv from any source, plan graphs, plan graphs inside torch.cuda.graph)" 120 \
    "$RUN; FASTCOMM_DEVICE_TEST=cuda '$PY' -m pytest -q -s -rA -p no:cacheprovider --rootdir='$ROOT' '$ROOT/tests/test_device_collectives.py' '$ROOT/tests/test_device_any_source.py' '$ROOT/tests/test_device_graphs.py' '$ROOT/tests/test_device_user_graphs.py'"
  step test "tests/test_nccl.py (the rest; cyclic order first)" 150 "$RUN; $PYTEST -k cyclic; $PYTEST -k 'not cyclic and not all_reduce_pairs_triples'"
  step test "examples/moe.py and examples/pipeline.py --device cuda --compare --check (ranks share the GPU)" 90 \
    "$RUN; export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1; rc=0; '$PY' '$ROOT/examples/moe.py' --device cuda --compare --check --steps 20 --timeout 40 || rc=1; '$PY' '$ROOT/examples/pipeline.py' --device cuda --compare --check --steps 20 --timeout 40 || rc=1; exit \$rc"
  step bench "benchmarks/device_launch_queue.py: how many entries of each kind one stream takes behind a long kernel before the host blocks (CUDA's command buffer), by default and with CUDA_SCALE_LAUNCH_QUEUES=4x" 60 \
    "$RUN; '$PY' '$ROOT/benchmarks/device_launch_queue.py' --n 3000 --timeout 25 --json '$REPORT_DIR/device_launch_queue.json'"
  step bench "benchmarks/device_streams.py run-ahead, fastcomm alone: IPC links, NCCL channels (FASTCOMM_DEVICE_IPC=0), IPC with 32 hardware queues (CUDA_DEVICE_MAX_CONNECTIONS=32), IPC with a 4x command buffer (CUDA_SCALE_LAUNCH_QUEUES=4x), IPC without fused chunk kernels (FASTCOMM_DEVICE_IPC_FUSE_BYTES=0)" 180 \
    "$RUN; fails=0; for v in 'FASTCOMM_DEVICE_IPC=1' 'FASTCOMM_DEVICE_IPC=0' 'FASTCOMM_DEVICE_IPC=1 CUDA_DEVICE_MAX_CONNECTIONS=32' 'FASTCOMM_DEVICE_IPC=1 CUDA_SCALE_LAUNCH_QUEUES=4x' 'FASTCOMM_DEVICE_IPC=1 FASTCOMM_DEVICE_IPC_FUSE_BYTES=0'; do echo \"== \$v\"; jt=30; case \"\$v\" in *IPC=0*) jt=60;; esac; env \$v '$PY' '$ROOT/benchmarks/device_streams.py' --world 2 --ops 1000 --groups 0 --sides fc --job-timeout \$jt || { echo \"== \$v failed (exit \$?)\"; fails=\$((fails + 1)); }; done; [ \$fails -eq 0 ]"
  step bench "benchmarks/device_streams.py: run-ahead, host cost and back-to-back vs torch NCCL, memory over 10,000 pair groups" 150 \
    "$RUN; '$PY' '$ROOT/benchmarks/device_streams.py' --world 4 --ops 1000 --groups 10000 --json '$REPORT_DIR/device_streams.json'"
  step bench "benchmarks/device_ipc.py: same-host channels over CUDA IPC vs torch NCCL, 1 and 8 pairs on one GPU (400 B back to back, the MWE shape, 16 MB vs a D2D copy, memory)" 90 \
    "$RUN; '$PY' '$ROOT/benchmarks/device_ipc.py' --pairs 1,8 --ops 1000 --json '$REPORT_DIR/device_ipc.json'"
  step bench "benchmarks/device_graphs.py: a plan of 64 pair all_reduces captured (p.capture(), over the plan's IPC link) and replayed 1,000 times vs the same plan started without a graph vs torch NCCL's captured ops (at most 10 s of them)" 90 \
    "$RUN; '$PY' '$ROOT/benchmarks/device_graphs.py' --world 2 --ops 64 --replays 1000 --plain-iters 100 --side-budget 30 --torch-budget 10 --job-timeout 85 --json '$REPORT_DIR/device_graphs.json'"
  step bench "benchmarks/device_ipc.py with a 64 MiB ring (FASTCOMM_DEVICE_IPC_RING_BYTES): 16 MB in one slot" 60 \
    "$RUN; FASTCOMM_DEVICE_IPC_RING_BYTES=67108864 '$PY' '$ROOT/benchmarks/device_ipc.py' --pairs 1 --ops 300 --no-torch --json '$REPORT_DIR/device_ipc_ring64.json'"
  # Processes that share a GPU without MPS take turns on it by time slices, and every IPC op
  # hands the GPU from one to the other; under an MPS server of its own (private pipe and log
  # folders, stopped at the end) their work runs side by side.
  step bench "benchmarks/device_ipc.py under MPS (a control daemon of the step's own), 1 and 8 pairs" 150 \
    "$RUN; MPS=\$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null) || { echo 'no nvidia-cuda-mps-control here'; exit 1; }
D=\$(mktemp -d); export CUDA_MPS_PIPE_DIRECTORY=\$D/pipe CUDA_MPS_LOG_DIRECTORY=\$D/log; mkdir -p \$CUDA_MPS_PIPE_DIRECTORY \$CUDA_MPS_LOG_DIRECTORY
\"\$MPS\" -d
trap 'echo quit | \"\$MPS\"; sleep 1; tail -n 5 \$CUDA_MPS_LOG_DIRECTORY/control.log; rm -rf \$D' EXIT
'$PY' '$ROOT/benchmarks/device_ipc.py' --pairs 1,8 --ops 1000 --no-torch --job-timeout 65 --json '$REPORT_DIR/device_ipc_mps.json'"
  step bench "benchmarks/forum_mwe.py at 1, 2, 4, 8 pairs, spawned ranks (CPU, this machine's cores)" 120 \
    "$RUN; '$PY' '$ROOT/benchmarks/forum_mwe.py' --pairs 1 2 4 8 --repeat 3 --sizes 16M"
  step bench "benchmarks/pair_breakdown.py: one pair's small all_reduce taken apart, with a perf profile where perf runs (CPU)" 45 \
    "$RUN; '$PY' '$ROOT/benchmarks/pair_breakdown.py' --iters 20000 --repeat 3 --perf --job-timeout 40"
  step bench "benchmarks/nccl_pairs.py: fastcomm vs torch NCCL, ranks on one GPU" 60 \
    "$RUN; '$PY' '$ROOT/benchmarks/nccl_pairs.py' --pairs 1 4 --iters 300 --job-timeout 50"
else
  FAILED=$((FAILED + 2))
  echo "| - | tests and benchmarks | test | NOT RUN (no build) | - | 0 |" >> "$LOGS/summary"
  write_report
fi

echo "gpu_check: $FAILED failed test step(s), $BENCH_FAILED failed benchmark(s); report: $REPORT" >&2
[ "$FAILED" -eq 0 ]
