#!/usr/bin/env bash
# The owed GPU work, one step per argument, on a lent GPU machine: no internet, no nbdev, PyTorch already installed,
# the repository as the working directory, $OUT a folder whose files come back. .ci/GPU.md gives the plan.
#
#   bash .ci/gpu_session.sh tests bench                # the tests (pytest: CUDA ones first) and the GPU benchmark
#   bash .ci/gpu_session.sh cuda                       # only the CUDA tests
#   bash .ci/gpu_session.sh nb:15_performance          # a notebook's `#| gpu` cells (with the cells they need)
#   bash .ci/gpu_session.sh nb:09_books_char:7c21237b,7c21237c   # only these gpu cells (ids), beside the unflagged ones
#
# Each step's log and results go to $OUT: hardware.txt, pytest.log (pytest-cuda.log), bench-gpu.json + bench.log, NAME.ipynb + NAME.log,
# and NAME-runs.tgz for a notebook that saves its runs under nbs/runs/NAME (JSON results, and the last checkpoint of each
# run a time budget stopped, in RUN.ckpt/; unpacked here with tar -xzf in the repository, carried into the next lease).
# No notebook with gpu cells saves there today: notebooks 09, 11, 13 and 14 keep their runs under data/runs, on the
# machine, so a run stopped at the time limit goes on only in a call made while the machine is still warm.
# LIMIT_S=540 interrupts the step running 540 s after the command started (SIGINT, as Ctrl-C: the trainers checkpoint
# and stop) and skips the rest, so that the command ends inside the machine's 10-minute limit with its files written;
# run it again to go on.
# Carried wheels (.whl/, from .ci/gpu_wheels.sh) are installed once per machine into /tmp/site; a carried data/books
# (a copy of ../shared/data/books) is found through CT_DATA_DIR. Run folders (runs/) stay on the machine while it is
# warm, so a step stopped at the command's time limit continues from its last checkpoint when it is run again.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
wheels=$(ls .whl/*.whl 2>/dev/null)
if [ -n "$wheels" ] && [ "$wheels" != "$(cat /tmp/site/.installed 2>/dev/null)" ]; then   # new or other wheels: (re)install
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    && echo "$wheels" >/tmp/site/.installed || { echo "installing the carried wheels failed" >&2; exit 1; }
fi
site=${wheels:+:/tmp/site}   # only where there are wheels (.whl/, carried): a /tmp/site left on a developer's machine must not shadow its packages
export PYTHONPATH="$PWD$site${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg PYTHONUNBUFFERED=1
[ -d data/books ] && export CT_DATA_DIR="$PWD/data"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c 'import torch; print("torch", torch.__version__, "| cuda", torch.version.cuda, "| bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())'
} | tee -a "$OUT/hardware.txt"

limit() {   # run "$@" until LIMIT_S seconds after the command started, then SIGINT (and SIGKILL 20 s later)
  [ "${LIMIT_S:-0}" -gt 0 ] || { "$@"; return; }
  timeout -s INT -k 20 $((LIMIT_S - SECONDS)) "$@"
}
rc=0   # pytest runs with -p no:logging: with -rA it would print, for every passing test, the DEBUG records torch.compile logs
for step in "$@"; do
  if [ "${LIMIT_S:-0}" -gt 0 ] && [ $((LIMIT_S - SECONDS)) -lt 30 ]; then echo "== $step: skipped, LIMIT_S=$LIMIT_S is reached"; rc=124; continue; fi
  t0=$SECONDS; echo "== $step"
  case "$step" in
    tests) first=(tests/test_*cuda*.py tests/test_fast_paths.py); rest=()   # the CUDA checks first: a time limit cuts the CPU ones
           for f in tests/test_*.py; do [[ " ${first[*]} " == *" $f "* ]] || rest+=("$f"); done
           limit $PY -m pytest -q -rA -p no:cacheprovider -p no:logging "${first[@]}" "${rest[@]}" 2>&1 | tee "$OUT/pytest.log" ;;
    cuda)  # only the CUDA checks (-k cuda: the tests/test_*cuda*.py files whole, and the tests of test_fast_paths.py whose name
           # or case says cuda), each stopped after 180 s where pytest-timeout is installed, without the benchmark's smoke test
           # when nb:15_performance runs the whole benchmark in the same command
           to=$($PY -c 'import pytest_timeout' 2>/dev/null && echo --timeout=180)
           limit $PY -m pytest -q -rA -p no:cacheprovider -p no:logging $to tests/test_*cuda*.py tests/test_fast_paths.py -k cuda \
             ${CT_SKIP_BENCH_SMOKE:+--deselect tests/test_attention_cuda.py::test_gpu_benchmark_smoke} 2>&1 | tee "$OUT/pytest-cuda.log" ;;
    bench) limit $PY -m compressive_tutorial.cli bench --preset gpu --json "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench.log" ;;
    nb:*)  name=${step#nb:}; ids=""; [[ $name == *:* ]] && { ids=${name#*:}; name=${name%%:*}; }; name=${name%.ipynb}
           limit $PY .ci/gpu_cells.py run "nbs/$name.ipynb" --out "$OUT/$name.ipynb" ${ids:+--cells ${ids//,/ }} 2>&1 | tee "$OUT/$name.log" ;;
    *) echo "unknown step '$step': tests, cuda, bench or nb:NOTEBOOK" >&2; exit 2 ;;
  esac
  s=${PIPESTATUS[0]}; [ "$s" -eq 0 ] || rc=$s
  if [[ $step == nb:* ]] && [ -d "nbs/runs/$name" ]; then   # a run folder does not outlive the machine: its results come back
    find "nbs/runs/$name" \( -name '*.json' -o -path '*.ckpt/last.safetensors' -size -32M \) -print0 |   # results, small runs to go on
      tar -czf "$OUT/$name-runs.tgz" --null -T - && echo "== saved results: $OUT/$name-runs.tgz"
  fi
  echo "== $step: exit $s after $((SECONDS - t0)) s"
done
exit $rc
