#!/usr/bin/env python
"""Run a notebook's `#| gpu` cells where nbdev is not installed (a lent GPU machine), and bring their outputs home.

    python .ci/gpu_cells.py run nbs/09_books_char.ipynb --out $OUT/09_books_char.ipynb   # on the GPU machine
    python .ci/gpu_cells.py run nbs/09_books_char.ipynb --cells 7c21237b 7c21237c ...   # only these flagged cells
    python .ci/gpu_cells.py merge RETURNED.ipynb nbs/09_books_char.ipynb                  # here, then nbdev_clean

`run` executes the notebook the way `nbdev_test --flags gpu` does (from the notebook's folder, every code cell except
those flagged with another of settings.ini's `tst_flags` or `#| eval: false`, stopping at the first error), with
execnb's shell, so it needs only execnb and IPython there (.ci/gpu_wheels.sh fetches them). It keeps the outputs of the
cells it ran and writes the notebook to `--out` after every flagged cell (with `--cells`, it runs only the flagged cells
named, by cell id, beside every unflagged one): a command stopped at its time limit still
returns what finished, and running it again re-runs only what a cell does not find in its run caches.

`merge` copies the outputs of the flagged cells, and of nothing else, from the returned notebook into the repository's
one, matching cells by id, each cell on its own: it leaves as they were a cell whose source changed here since the run
and a cell that ended in an error (and says so), and refuses a run that found no CUDA device. The other cells keep their committed
outputs (which come from the runs their text describes). See .ci/GPU.md for the whole session.
"""
import argparse, ast, json, os, re, sys, time
from pathlib import Path

RAN = 'ct_gpu_ran'   # cell metadata `run` sets on each cell it executed: `merge` takes outputs only from those (the others hold
                     # the outputs the notebook was committed with)
CPU = 'ct_gpu_on_cpu'   # notebook metadata `run` sets where it found no CUDA device: `merge` refuses its gpu cells' outputs

def _cuda() -> bool:
    try: import torch; return torch.cuda.is_available()
    except ImportError: return False

ROOT = Path(__file__).resolve().parent.parent


def src(c) -> str: return c['source'] if isinstance(c['source'], str) else ''.join(c['source'])


def directives(source:str) -> dict:
    "nbdev's cell directives: the `#| name args` lines at the top of a cell, as {name: args}; `#| eval: false` -> {'eval:': 'false'}."
    out = {}
    for line in source.splitlines():
        m = re.match(r'\s*#\|\s*(\S+)\s*(.*)$', line)
        if m: out[m.group(1)] = m.group(2).strip()
        elif line.strip(): break
    return out


def tst_flags() -> set:
    "settings.ini's `tst_flags`: the flags whose cells `nbdev_test` skips unless asked for them."
    from configparser import ConfigParser
    c = ConfigParser(delimiters=['=']); c.read(ROOT / 'settings.ini', encoding='utf-8')
    return set(c['DEFAULT'].get('tst_flags', '').split())


def skipped(cell, flags:set) -> bool:
    "What `nbdev_test --flags FLAGS` leaves out: markdown, `#| eval: false`, and cells flagged with another test flag."
    if cell['cell_type'] != 'code': return True
    d = directives(src(cell))
    if d.get('eval:', '').lower() == 'false': return True
    return bool((tst_flags() - flags) & d.keys())


def flagged(cell, flags:set) -> bool:
    return cell['cell_type'] == 'code' and bool(flags & directives(src(cell)).keys())


def _names(source:str) -> tuple:
    "(names a cell binds, names it reads before binding them itself); shell and magic lines are ignored."
    code = '\n'.join('' if l.lstrip().startswith(('%', '!')) else l for l in source.splitlines())
    tree = ast.parse(code)
    bound = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)): bound.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): bound.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)): bound |= {(a.asname or a.name).split('.')[0] for a in n.names}
        elif isinstance(n, ast.arg): bound.add(n.arg)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return bound, read - bound


def standalone_problems(nb:dict, flags:frozenset=frozenset({'gpu'})) -> list:
    "Names a flagged cell reads that only cells `run` skips (e.g. `#| slow`) define: it would fail where it is run."
    fast, slow, out = set(), set(), []
    for i, c in enumerate(nb['cells']):
        if c['cell_type'] != 'code': continue
        try: bound, read = _names(src(c))
        except SyntaxError: continue                     # cell magics (%%...) and the like: nothing to learn
        if flagged(c, flags):
            missing = sorted(n for n in read if n in slow and n not in fast)
            if missing: out.append(f"cell {i} reads {', '.join(missing)}, defined only in cells it runs without")
        if skipped(c, flags): slow |= bound
        else: fast |= bound
    return out


def _runnable(source:str) -> str:
    "The code to give execnb for `source`: execnb drops all of a cell's stdout when it ends with ';' (Jupyter hides only its value), so end such a cell with `None` instead, which hides the value too."
    s = source.rstrip()
    return s[:-1] + '\nNone' if s.endswith(';') else source


def run(nb_path:Path, out:Path, flags:set, cells:list|None=None) -> int:
    "Execute like `nbdev_test --flags FLAGS` (only the flagged `cells`, if given), keeping the outputs; write to `out` after each flagged cell; 0 if all ran."
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell
    nb, out = read_nb(nb_path), Path(out).resolve()
    if cells is not None:
        known = {c.get('id') for c in nb.cells if flagged(c, flags)}
        if unknown := set(cells) - known: raise SystemExit(f"--cells {' '.join(sorted(unknown))}: not flagged {sorted(flags)} cells of {nb_path} ({sorted(known)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    # (IN_TEST is not set, unlike nbdev_test: the notebooks pin torch to one CPU thread under it, for a 2-core machine running
    # several notebooks at once; here one notebook has the GPU machine's cores)
    if 'gpu' in flags and not _cuda():                          # `merge` refuses these outputs unless told they may come from a CPU
        print('no CUDA device here: the gpu cells run on the CPU', flush=True); nb.metadata[CPU] = True
    os.chdir(nb_path.resolve().parent)                          # as nbdev_test: paths in the notebook are relative to it
    sh, t_all = CaptureShell(nb_path.resolve()), time.time()
    for i, c in enumerate(nb.cells):
        if skipped(c, flags) or (cells is not None and flagged(c, flags) and c.get('id') not in cells): continue
        t, shown = time.time(), c.source
        c.outputs, c.source = [], _runnable(shown)              # a cell that now prints nothing keeps no stale outputs
        try: sh.cell(c)
        finally: c.source = shown; c.metadata[RAN] = True
        err = [o for o in c.get('outputs', []) if o.get('output_type') == 'error']
        tag = ' [' + ','.join(sorted(flags & directives(c.source).keys())) + ']' if flagged(c, flags) else ''
        print(f'cell {i}{tag}: {time.time() - t:.1f} s' + (' ERROR' if err else ''), flush=True)
        if flagged(c, flags) or err: write_nb(nb, out)
        if err:
            print('\n'.join(err[0].get('traceback', [])[-8:]), file=sys.stderr)
            return 1
    write_nb(nb, out)
    print(f'{nb_path.name}: all cells ran in {time.time() - t_all:.0f} s -> {out}')
    return 0


def merge(returned:Path, target:Path, flags:set, allow_cpu:bool=False) -> int:
    "Copy the outputs of the flagged cells that ran in `returned` into `target` (matched by cell id), each cell on its own; 0 unless one ended in an error or changed here since it ran."
    got, nb = json.loads(Path(returned).read_text()), json.loads(Path(target).read_text())
    if 'gpu' in flags and got.get('metadata', {}).get(CPU) and not allow_cpu:
        raise SystemExit(f"{returned} ran its gpu cells on a machine without CUDA: its outputs are not the GPU's results, and "
                         "nothing was copied (pass --allow-cpu to take them anyway).")
    if any(flagged(c, flags) and not c.get('id') for c in nb['cells']):
        raise SystemExit(f"{target}: a flagged cell has no id, and merge matches cells by id (nbformat 4.5): save the notebook with a "
                         "current Jupyter (or nbdev_clean it), run it again on the GPU machine, then merge.")
    by_id = {c.get('id'): c for c in got['cells'] if c.get('id')}
    n, empty, failed, idle, changed, absent = 0, [], [], [], [], []
    for c in nb['cells']:                                        # each cell on its own: one that cannot be taken stops no other
        if not flagged(c, flags): continue
        cid, r = c.get('id'), by_id.get(c.get('id'))
        if r is None: absent.append(cid); continue               # new or renamed since the run
        if not r.get('metadata', {}).get(RAN): idle.append(cid); continue   # not run there: what it holds is the old outputs
        outs = r.get('outputs', [])
        if any(o.get('output_type') == 'error' for o in outs): failed.append(cid); continue   # keep the old outputs
        if src(r) != src(c): changed.append(cid); continue      # ran as other code than the repository's now: not its results
        c['outputs'], c['execution_count'] = outs, r.get('execution_count')
        n += 1
        if not outs: empty.append(cid)
    Path(target).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    print(f'{target}: outputs of {n} flagged cell(s) copied from {returned}' +
          (f'; {empty} ran and printed nothing' if empty else '') +
          (f'; not run there, kept as they were: {idle}' if idle else '') +
          (f'; not in it (new or renamed since), kept as they were: {absent}' if absent else '') +
          (f'; NOT copied, they ended in an error: {failed}' if failed else '') +
          (f'; NOT copied, changed here since they ran (run them again on the GPU machine): {changed}' if changed else ''))
    return 1 if failed or changed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest='cmd', required=True)
    r = sub.add_parser('run', help="execute a notebook's cells as `nbdev_test --flags` does and keep the outputs")
    r.add_argument('notebook', type=Path); r.add_argument('--out', type=Path, required=True)
    r.add_argument('--cells', nargs='+', metavar='ID', help='run only these flagged cells (cell ids); the unflagged ones all run')
    m = sub.add_parser('merge', help="copy the flagged cells' outputs from a returned notebook into the repository's")
    m.add_argument('returned', type=Path); m.add_argument('target', type=Path)
    m.add_argument('--allow-cpu', action='store_true', help="take gpu cells' outputs from a run that found no CUDA device (tests)")
    for p in (r, m): p.add_argument('--flags', default='gpu', help='space-separated flags to run (default: gpu)')
    a = ap.parse_args(argv)
    flags = set(a.flags.split())
    if unknown := flags - tst_flags(): ap.error(f"--flags {' '.join(sorted(unknown))}: not in settings.ini's tst_flags {sorted(tst_flags())}")
    return run(a.notebook, a.out, flags, a.cells) if a.cmd == 'run' else merge(a.returned, a.target, flags, a.allow_cpu)


if __name__ == '__main__': sys.exit(main())
