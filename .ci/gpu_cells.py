#!/usr/bin/env python
"""Run a notebook's `#| gpu` cells where nbdev is not installed (a lent GPU machine), and bring their outputs home.

    python .ci/gpu_cells.py run nbs/09_books_char.ipynb --out $OUT/09_books_char.ipynb   # on the GPU machine
    python .ci/gpu_cells.py run nbs/09_books_char.ipynb --cells 7c21237b 7c21237c ...   # only these flagged cells
    python .ci/gpu_cells.py merge RETURNED.ipynb nbs/09_books_char.ipynb                  # here, then nbdev_clean
    python .ci/gpu_cells.py dry nbs/11_speech.ipynb --out /tmp/dry/11_speech.ipynb        # here, before a lease

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

`dry` runs a notebook's gpu cells on this CPU at toy sizes, before a lease: a copy of the notebook with the substitutions of
`SHRINK` (each must still match exactly as often as it says, or the table is out of date and `dry` says which line), run
as `run` runs it, its runs kept in a temporary folder. It catches what would stop a cell on the GPU machine (a NameError,
a wrong argument, a crash in a plot) in a minute, not the results.
"""
import argparse, ast, json, os, re, sys, tempfile, time
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


# notebook -> (environment, [(code, toy code, how often the code occurs in the notebook)]): its gpu cells, and the cells
# they need, at sizes that run in a minute or two on a 2-core CPU. Notebook 15's gpu cells do nothing without CUDA.
SHRINK = {
    '09_books_char': ({'CT_GPU_STEPS': '8'}, [
        ("dict(d_model=512, n_heads=8, n_layers=8, d_ff=2048, n_s=512, dropout=0.1)", "dict(d_model=32, n_heads=2, n_layers=2, d_ff=64, n_s=32, dropout=0.1)", 1),
        ("equal_cost_pair(512,", "equal_cost_pair(64,", 2),
        ("batch_size=16, eval_windows=32, eval_batch_size=16, device='cuda'", "batch_size=2, eval_windows=4, eval_batch_size=2, device='cpu'", 1),
        ("StreamLoader(gpu_data['valid'], 16, gpu_ct_cfg.n_s)", "StreamLoader(gpu_data['valid'], 2, gpu_ct_cfg.n_s)", 1),
        ("n_windows=32)", "n_windows=8)", 2),
        ("[0, 128, 256, 512, 1024], max_batches=32", "[0, 32, 64], max_batches=8", 1)]),
    '11_speech': ({}, [
        ("GPU_STEPS = 2_000", "GPU_STEPS = 12", 1),
        ("dict(d_model=512, n_heads=8, n_layers=8, d_ff=2048, n_s=768)", "dict(d_model=32, n_heads=2, n_layers=2, d_ff=64, n_s=48)", 1),
        ("equal_cost_pair(1536,", "equal_cost_pair(96,", 1),
        ("WaveNetConfig(d_res=352, d_skip=704, d_out=1024, kernel_size=2, n_layers=30, dilation_cycle=10)",
         "WaveNetConfig(d_res=16, d_skip=32, d_out=64, kernel_size=2, n_layers=4, dilation_cycle=2)", 1),
        ("chunk=3840, eval_every=250, eval_streams=16, eval_chunks=8", "chunk=480, eval_every=5, eval_streams=2, eval_chunks=2", 1),
        ("            device='cuda',\n", "            device='cpu',\n", 1),
        ("(768, 768, 1536, 3070))", "(48, 48, 96, 7))", 1),                   # the sizes' own test, at the toy sizes
        ("assert abs(G['wavenet']['params'] / G['txl']['params'] - 1) < 0.05, G", "", 1),   # (a toy WaveNet is not the TXL's size)
        ("StreamLoader(gpu_data['valid'], 8, GPU_CONFIGS['ct'].n_s)", "StreamLoader(gpu_data['valid'], 2, GPU_CONFIGS['ct'].n_s)", 1),
        ("StreamLoader(gpu_data['test'], 16, 3840)", "StreamLoader(gpu_data['test'], 2, 480)", 1),
        ("max_batches=8, n_cm=0", "max_batches=2, n_cm=0", 1),
        ("generate(gpu[k]['model'], 1.0, seed=0)", "generate(gpu[k]['model'], 0.01, seed=0)", 1),
        ("on {hardware('cuda')}", "on {hardware('cpu')}", 1)]),
    '13_enwik8': ({'CT_PRESET': 'tiny', 'CT_CORPUS': 'books', 'CT_STEPS': '10'}, [   # the cells take the preset's device
        ("evaluate_protocol(gpu_trainer.model, gpu_preset, gpu_data)", "evaluate_protocol(gpu_trainer.model, gpu_preset, gpu_data, valid_batches=4, test_batches=4)", 1)]),
    '14_books_subword': ({}, [
        ("VOCAB = 16_000", "VOCAB = 512", 1),
        ("GPU_STEPS = 4_000", "GPU_STEPS = 8", 1),
        ("d_model=512, n_heads=8, n_layers=8, d_ff=2048, n_s=512, dropout=0.1)", "d_model=32, n_heads=2, n_layers=2, d_ff=64, n_s=32, dropout=0.1)", 1),
        ("equal_cost_pair(1024, c=2,", "equal_cost_pair(64, c=2,", 1),
        ("max_lines=200_000", "max_lines=20_000", 1),
        ("device='cuda'", "device='cpu'", 2)]),
}


def shrunk(nb:dict, name:str) -> dict:
    "`nb` (a notebook's json) with `SHRINK[name]`'s substitutions made in its code cells; refused if one no longer matches as often as it says."
    if name not in SHRINK: raise SystemExit(f"no toy sizes for {name} in SHRINK ({', '.join(SHRINK)}): add its substitutions to .ci/gpu_cells.py")
    cells = [c for c in nb['cells'] if c['cell_type'] == 'code']
    for old, new, n in SHRINK[name][1]:
        found = sum(src(c).count(old) for c in cells)
        if found != n: raise SystemExit(f"SHRINK[{name!r}]: {old!r} occurs {found} time(s) in the notebook, not {n}: the notebook changed; "
                                        "update the substitution in .ci/gpu_cells.py")
        for c in cells: c['source'] = src(c).replace(old, new)
    return nb


def dry(nb_path:Path, out:Path, cells:list|None=None) -> int:
    "Run the gpu cells (only `cells`, if given) of a toy copy of the notebook (`shrunk`) on this machine; its runs go to a temporary folder."
    nb_path = Path(nb_path).resolve()                            # (`run` moves into its folder)
    env, _ = SHRINK.get(nb_path.stem, ({}, None))
    nb = shrunk(json.loads(nb_path.read_text()), nb_path.stem)
    copy = nb_path.with_name(f'_dry_{nb_path.name}')             # beside it: the notebook's relative paths hold (ignored by git, nbdev)
    saved = dict(os.environ)
    with tempfile.TemporaryDirectory() as runs:
        os.environ.update({'CT_CACHE_DIR': runs, 'CT_RUNS_DIR': runs, **env})   # (the data: the shared folder, as on the GPU machine)
        copy.write_text(json.dumps(nb))
        try: return run(copy, out, {'gpu'}, cells)
        finally: copy.unlink(); os.environ.clear(); os.environ.update(saved)


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
    d = sub.add_parser('dry', help="run a notebook's gpu cells at toy sizes on this machine (SHRINK), before a lease")
    d.add_argument('notebook', type=Path); d.add_argument('--out', type=Path, required=True)
    d.add_argument('--cells', nargs='+', metavar='ID', help='run only these gpu cells (cell ids); the unflagged ones all run')
    a = ap.parse_args(argv)
    if a.cmd == 'dry': return dry(a.notebook, a.out, a.cells)
    flags = set(a.flags.split())
    if unknown := flags - tst_flags(): ap.error(f"--flags {' '.join(sorted(unknown))}: not in settings.ini's tst_flags {sorted(tst_flags())}")
    return run(a.notebook, a.out, flags, a.cells) if a.cmd == 'run' else merge(a.returned, a.target, flags, a.allow_cpu)


if __name__ == '__main__': sys.exit(main())
