"""The runner of `#| gpu` cells for machines without nbdev (.ci/gpu_cells.py): it runs what `nbdev_test --flags gpu`
runs and keeps the outputs, and `merge` brings back the flagged cells' outputs and nothing else."""
import importlib.util, json, os
from pathlib import Path
import pytest

pytest.importorskip('execnb')
ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location('gpu_cells', ROOT / '.ci' / 'gpu_cells.py')
gc = importlib.util.module_from_spec(spec); spec.loader.exec_module(gc)


def notebook(path, *cells):
    "A notebook of code cells (markdown if a source starts with '# ') with ids c0, c1, ..."
    def cell(i, s):
        if s.startswith('# '): return {'cell_type': 'markdown', 'id': f'c{i}', 'metadata': {}, 'source': s}
        return {'cell_type': 'code', 'id': f'c{i}', 'metadata': {}, 'source': s, 'outputs': [], 'execution_count': None}
    nb = {'cells': [cell(i, s) for i, s in enumerate(cells)], 'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
    path.write_text(json.dumps(nb)); return path


def outputs(path):
    return [''.join(''.join(o.get('text', '')) for o in c.get('outputs', [])) for c in json.loads(path.read_text())['cells']]


def test_run_and_merge(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                          # `run` moves into the notebook's folder, as nbdev_test does
    nb = notebook(tmp_path / 'a.ipynb', '# Title', 'x = 1\nprint("fast")', '#| slow\nprint("slow")',
                  '#| gpu\nprint(x + 1)', '#| eval: false\nprint("never")')
    out = tmp_path / 'out' / 'a.ipynb'
    assert gc.main(['run', str(nb), '--out', str(out)]) == 0
    assert outputs(out) == ['', 'fast\n', '', '2\n', '']         # the slow and eval:false cells did not run
    with pytest.raises(SystemExit, match='without CUDA'): gc.main(['merge', str(out), str(nb)])   # here: a CPU's outputs
    assert outputs(nb) == ['', '', '', '', '']                    # refused whole, nothing copied
    assert gc.main(['merge', str(out), str(nb), '--allow-cpu']) == 0
    assert outputs(nb) == ['', '', '', '2\n', '']                 # only the gpu cell's outputs came back
    assert gc.main(['run', str(nb), '--out', str(out), '--flags', 'slow']) == 0
    assert outputs(out) == ['', 'fast\n', 'slow\n', '2\n', '']   # other flags: the gpu cell is skipped, its old output kept


def test_run_keeps_the_stdout_of_a_cell_ending_in_semicolon(tmp_path, monkeypatch):
    "execnb alone drops everything such a cell printed (its training log, its table); Jupyter hides only the value."
    monkeypatch.chdir(tmp_path)
    nb = notebook(tmp_path / 'e.ipynb', '#| gpu\nprint("log")\n[1];', '#| gpu\nif True:\n    print("in")\n    2;  ')
    out = tmp_path / 'e_out.ipynb'
    assert gc.main(['run', str(nb), '--out', str(out)]) == 0
    cells = json.loads(out.read_text())['cells']
    assert outputs(out) == ['log\n', 'in\n']
    assert [o['output_type'] for c in cells for o in c['outputs']] == ['stream', 'stream']   # the value stays hidden
    assert [gc.src(c) for c in cells] == [gc.src(c) for c in json.loads(nb.read_text())['cells']]   # the source as it was


def test_run_only_named_cells(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = notebook(tmp_path / 'd.ipynb', 'x = 1', '#| gpu\nprint("a")', '#| gpu\nprint("b", x)')
    out = tmp_path / 'd_out.ipynb'
    assert gc.main(['run', str(nb), '--out', str(out), '--cells', 'c2']) == 0
    assert outputs(out) == ['', '', 'b 1\n']                     # c1 skipped, the unflagged c0 ran
    with pytest.raises(SystemExit, match='not flagged'): gc.main(['run', str(nb), '--out', str(out), '--cells', 'c0'])


def test_error_stops_and_keeps_what_ran(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = notebook(tmp_path / 'b.ipynb', '#| gpu\nprint("first")', '#| gpu\nraise ValueError("boom")', '#| gpu\nprint("after")')
    out = tmp_path / 'b_out.ipynb'
    assert gc.main(['run', str(nb), '--out', str(out)]) == 1
    errors = [o for o in json.loads(out.read_text())['cells'][1]['outputs'] if o['output_type'] == 'error']
    assert outputs(out)[0] == 'first\n' and errors[0]['ename'] == 'ValueError' and outputs(out)[2] == ''
    assert gc.main(['merge', str(out), str(nb), '--allow-cpu']) == 1   # an error is reported
    assert outputs(nb) == ['first\n', '', '']                    # the cell that failed keeps its old (here: no) outputs


def test_merge_takes_only_cells_that_ran(tmp_path, monkeypatch):
    "Two commands running different gpu cells of one notebook: each returned copy still holds the committed outputs of the cells it did not run, and merging both in turn keeps both new results."
    monkeypatch.chdir(tmp_path)
    nb = notebook(tmp_path / 'm.ipynb', '#| gpu\nprint("A new")', '#| gpu\nprint("B new")')
    committed = json.loads(nb.read_text())
    for c, old in zip(committed['cells'], ('A old\n', 'B old\n')): c['outputs'] = [{'output_type': 'stream', 'name': 'stdout', 'text': old}]
    nb.write_text(json.dumps(committed))
    for cell in ('c0', 'c1'): assert gc.main(['run', str(nb), '--out', str(tmp_path / f'{cell}.ipynb'), '--cells', cell]) == 0
    assert outputs(tmp_path / 'c0.ipynb') == ['A new\n', 'B old\n']   # the other cell's old outputs travel back too
    for cell in ('c0', 'c1'): assert gc.main(['merge', str(tmp_path / f'{cell}.ipynb'), str(nb), '--allow-cpu']) == 0
    assert outputs(nb) == ['A new\n', 'B new\n']
    assert all(gc.RAN not in c['metadata'] for c in json.loads(nb.read_text())['cells'])   # the mark stays out of the repository


def test_session_brings_back_a_notebooks_saved_results(tmp_path):
    "`.ci/gpu_session.sh nb:NAME`: the JSON results the notebook saved under nbs/runs/NAME, and the last checkpoints of runs stopped on the way (RUN.ckpt/), come back in $OUT as one tarball (nothing else from there), so the next lease can carry them in."
    import shutil, subprocess, sys, tarfile
    (tmp_path / '.ci').mkdir()
    for f in ('gpu_session.sh', 'gpu_cells.py'): shutil.copy(ROOT / '.ci' / f, tmp_path / '.ci' / f)
    shutil.copy(ROOT / 'settings.ini', tmp_path)                   # (its tst_flags)
    (tmp_path / 'nbs').mkdir()
    notebook(tmp_path / 'nbs' / 'r.ipynb', 'import pathlib', '#| gpu\nd = pathlib.Path("runs/r/big"); d.mkdir(parents=True)\n'
             '(d / "a-seed0.json").write_text("{}"); (d / "weights.bin").write_bytes(b"x")\n'
             'c = d / "b-seed0.ckpt"; c.mkdir(); (c / "last.safetensors").write_bytes(b"y"); (c / "last.prev.safetensors").write_bytes(b"z")')
    out = tmp_path / 'out'
    env = {**__import__('os').environ, 'OUT': str(out), 'PYTHON': sys.executable}
    p = subprocess.run(['bash', str(tmp_path / '.ci' / 'gpu_session.sh'), 'nb:r'], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    with tarfile.open(out / 'r-runs.tgz') as t:                    # the results and the runs to continue, not other weights
        assert sorted(t.getnames()) == ['nbs/runs/r/big/a-seed0.json', 'nbs/runs/r/big/b-seed0.ckpt/last.safetensors']


def test_merge_takes_each_cell_on_its_own(tmp_path, capsys):
    "A cell edited here since it ran is not copied (its outputs are another code's); one that failed there and was fixed here, one edited that never ran, and one new since, keep what they had; the others' results still come back."
    nb = notebook(tmp_path / 'c.ipynb', '#| gpu\nprint(1)', '#| gpu\nprint("ok")', '#| gpu\nprint("fixed")', '#| gpu\nprint("edited")', '#| gpu\nprint("new")')
    got = json.loads(notebook(tmp_path / 'ret.ipynb', '#| gpu\nprint(2)', '#| gpu\nprint("ok")', '#| gpu\nprint("typo")',
                              '#| gpu\nprint("before")').read_text())
    for c, out in zip(got['cells'], ('2\n', 'ok\n', None, None)):
        if out: c['outputs'], c['metadata'][gc.RAN] = [{'output_type': 'stream', 'name': 'stdout', 'text': out}], True
    got['cells'][2]['metadata'][gc.RAN] = True
    got['cells'][2]['outputs'] = [{'output_type': 'error', 'ename': 'NameError', 'evalue': 'typo', 'traceback': []}]
    (tmp_path / 'ret.ipynb').write_text(json.dumps(got))
    assert gc.main(['merge', str(tmp_path / 'ret.ipynb'), str(nb)]) == 1
    assert outputs(nb) == ['', 'ok\n', '', '', '']
    said = capsys.readouterr().out
    assert "changed here since they ran (run them again on the GPU machine): ['c0']" in said and "error: ['c2']" in said
    assert "not run there, kept as they were: ['c3']" in said and "new or renamed since), kept as they were: ['c4']" in said


def test_merge_needs_cell_ids(tmp_path):
    nb = notebook(tmp_path / 'n.ipynb', '#| gpu\nprint(1)')
    bare = json.loads(nb.read_text()); del bare['cells'][0]['id']; nb.write_text(json.dumps(bare))
    with pytest.raises(SystemExit, match='has no id'): gc.main(['merge', str(nb), str(nb)])


def test_standalone_problems():
    cells = lambda *ss: {'cells': [{'cell_type': 'code', 'source': s} for s in ss]}
    assert gc.standalone_problems(cells('a = 1', '#| slow\nb = 2', '#| gpu\nprint(a)')) == []
    assert gc.standalone_problems(cells('a = 1', '#| slow\nb = 2', '#| gpu\nprint(a, b)')) == ['cell 2 reads b, defined only in cells it runs without']
    assert gc.standalone_problems(cells('#| slow\nb = 2', '#| gpu\nb = 3\nprint(b)')) == []   # it makes its own


def test_repo_gpu_cells_stand_alone():
    "Every notebook's gpu cells need only cells that run beside them (not `#| slow` ones): a GPU session is too short to find out there."
    for p in sorted((ROOT / 'nbs').glob('[0-9]*.ipynb')):
        assert gc.standalone_problems(json.loads(p.read_text())) == [], p.name


def test_repo_shrink_tables_match_the_notebooks():
    "`dry`'s toy sizes still apply to every notebook whose gpu cells run without CUDA: a stale table fails here, not before a lease."
    for p in sorted((ROOT / 'nbs').glob('[0-9]*.ipynb')):
        nb = json.loads(p.read_text())
        if not any(gc.flagged(c, {'gpu'}) for c in nb['cells']) or p.stem == '15_performance': continue   # (15's need CUDA)
        toy = gc.shrunk(json.loads(p.read_text()), p.stem)     # each substitution found as often as it says
        assert [gc.src(c) for c in toy['cells']] != [gc.src(c) for c in nb['cells']], p.name


def test_dry_runs_a_toy_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = notebook(tmp_path / 'toy.ipynb', 'import os\nSTEPS = 5_000', '#| gpu\nprint(STEPS, os.environ["CT_RUNS_DIR"] != "", os.environ["X"])')
    monkeypatch.setitem(gc.SHRINK, 'toy', ({'X': 'x'}, [('STEPS = 5_000', 'STEPS = 3', 1)]))
    monkeypatch.delenv('X', raising=False)
    out = tmp_path / 'out.ipynb'
    assert gc.main(['dry', str(nb), '--out', str(out)]) == 0
    assert outputs(out) == ['', '3 True x\n']                  # the toy size, a runs folder of its own, the table's environment
    assert 'X' not in os.environ and sorted(q.name for q in tmp_path.iterdir()) == ['out.ipynb', 'toy.ipynb']   # nothing left behind
    assert outputs(nb) == ['', '']                              # the notebook itself untouched
    monkeypatch.setitem(gc.SHRINK, 'toy', ({}, [('STEPS = 5_000', 'STEPS = 3', 2)]))
    with pytest.raises(SystemExit, match=r"SHRINK\['toy'\]: 'STEPS = 5_000' occurs 1 time\(s\) in the notebook, not 2: the notebook changed"):
        gc.main(['dry', str(nb), '--out', str(out)])
    with pytest.raises(SystemExit, match='no toy sizes for other in SHRINK'): gc.main(['dry', str(notebook(tmp_path / 'other.ipynb', 'x = 1')), '--out', str(out)])


def test_gpu_steps_sizes_the_runs_from_the_benchmark(tmp_path):
    "`.ci/gpu_steps.py`: notebook 09's steps from the CT's measured training tokens/s, the seconds left and the trainer's margin."
    spec = importlib.util.spec_from_file_location('gpu_steps', ROOT / '.ci' / 'gpu_steps.py')
    gs = importlib.util.module_from_spec(spec); spec.loader.exec_module(gs)
    table = ('implementation      train tok/s   x lucidrains\n'
             'ours-ct                 193,196          1.77x\nours-ct-compiled        203,980          1.94x\n')
    nb = {'cells': [{'cell_type': 'code', 'id': 'b1500032', 'source': '', 'metadata': {'ct_gpu_ran': True},
                     'outputs': [{'output_type': 'stream', 'name': 'stdout', 'text': table}]}]}
    (tmp_path / 'nb.ipynb').write_text(json.dumps(nb))
    nb['cells'][0]['metadata'] = {}; (tmp_path / 'old.ipynb').write_text(json.dumps(nb))
    assert gs.steps(str(tmp_path / 'old.ipynb'), 511) == 1000       # the committed result of another machine: not this one's
    step_s = 16 * 512 / 193_196                                      # 42.4 ms; 1.8 x that per trained step, 90 s kept back
    assert gs.steps(str(tmp_path / 'nb.ipynb'), 511) == int((511 - 90) / 2 / (1.8 * step_s)) // 100 * 100 == 2700
    assert gs.steps(str(tmp_path / 'nb.ipynb'), 10_000) == 5000     # never more than the notebook's default
    assert gs.steps(str(tmp_path / 'nb.ipynb'), 100) == 300         # nor fewer than 300
    assert gs.steps(str(tmp_path / 'missing.ipynb'), 511) == 1000   # no benchmark: a fixed, short size
