#!/usr/bin/env bash
# Download, here, the wheels a lent GPU machine lacks (it has PyTorch, numpy, matplotlib, pytest, einops, sentencepiece,
# safetensors, pyarrow ... but no internet, no nbdev and none of the packages below), into .whl/ (ignored by git), for
# its Python 3.12 on x86-64. Each is the version installed in the project's .venv (or in $PYTHON's environment), the one
# the tests passed in, after `pip install -e ".[dev,bench]"` (labml-nn: `--no-deps`).
#
#   bash .ci/gpu_wheels.sh                 # core: execnb + IPython (to run notebook cells), fastcore, the benchmark's peers
#   bash .ci/gpu_wheels.sh speech rl words # and what notebooks 11 (soundfile), 12 (gymnasium, minigrid) and 14 (datasets) need
#
# .ci/GPU.md says what to carry for which run; the working tree travels with at most 64 MiB in all.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}   # the project's venv when there is one
declare -A GROUPS_=(
  [core]="fastcore execnb ipython ipython-pygments-lexers jedi parso traitlets pexpect ptyprocess prompt_toolkit wcwidth
          stack_data executing asttokens pure_eval matplotlib-inline
          compressive-transformer-pytorch mogrifier labml labml-nn gitpython gitdb smmap"
  [speech]="soundfile cffi pycparser"
  [rl]="gymnasium farama-notifications minigrid pygame-ce"
  [words]="datasets dill multiprocess"
)
names=""
for g in core "$@"; do
  [ -n "${GROUPS_[$g]+x}" ] || { echo "unknown group '$g': use speech, rl or words" >&2; exit 2; }
  names+=" ${GROUPS_[$g]}"
done
pkgs=$($PY - $names <<'PY'
import sys, importlib.metadata as md
out = []
for n in sys.argv[1:]:
    try: out.append(f'{n}=={md.version(n)}')
    except md.PackageNotFoundError: sys.exit(f'{n} is not installed here: pip install -e ".[dev,bench]" (labml-nn: --no-deps) first')
print(' '.join(out))
PY
)
rm -rf .whl && mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pkgs
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (groups: core $*)"
