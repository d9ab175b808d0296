#!/usr/bin/env bash
# The owed GPU work, one step per argument, on a lent GPU machine: no internet, no nbdev, PyTorch already installed,
# the repository as the working directory, $OUT a folder whose files come back. .ci/GPU.md gives the plan.
#
#   bash .ci/gpu_session.sh tests bench                # the CUDA tests (pytest) and the GPU benchmark
#   bash .ci/gpu_session.sh nb:09_books_char           # a notebook's `#| gpu` cells (with the cells they need)
#
# Each step's log and results go to $OUT: hardware.txt, pytest.log, bench-gpu.json + bench.log, NAME.ipynb + NAME.log.
# STEP_LIMIT_S=540 interrupts a step (SIGINT, as Ctrl-C: the trainers checkpoint and stop) after 540 s, so that the
# command ends inside the machine's 10-minute limit with its files written; run it again to go on.
# Carried wheels (.whl/, from .ci/gpu_wheels.sh) are installed once per machine into /tmp/site; a carried data/books
# (a copy of ../shared/data/books) is found through CT_DATA_DIR. Run folders (runs/) stay on the machine while it is
# warm, so a step stopped at the command's time limit continues from its last checkpoint when it is run again.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ ! -f /tmp/site/.done ] && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done || { echo "installing the carried wheels failed" >&2; exit 1; }
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg PYTHONUNBUFFERED=1
[ -d data/books ] && export CT_DATA_DIR="$PWD/data"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c 'import torch; print("torch", torch.__version__, "| cuda", torch.version.cuda, "| bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())'
} | tee -a "$OUT/hardware.txt"

limit() { if [ "${STEP_LIMIT_S:-0}" -gt 0 ]; then timeout -s INT -k 30 "$STEP_LIMIT_S" "$@"; else "$@"; fi; }
rc=0
for step in "$@"; do
  t0=$SECONDS; echo "== $step"
  case "$step" in
    tests) limit $PY -m pytest -q -rA -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" ;;
    bench) limit $PY -m compressive_tutorial.cli bench --preset gpu --json "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench.log" ;;
    nb:*)  name=${step#nb:}; name=${name%.ipynb}
           limit $PY .ci/gpu_cells.py run "nbs/$name.ipynb" --out "$OUT/$name.ipynb" 2>&1 | tee "$OUT/$name.log" ;;
    *) echo "unknown step '$step': tests, bench or nb:NOTEBOOK" >&2; exit 2 ;;
  esac
  s=${PIPESTATUS[0]}; [ "$s" -eq 0 ] || rc=$s
  echo "== $step: exit $s after $((SECONDS - t0)) s"
done
exit $rc
