"""`ct` under the faults of issue 12, end to end: interrupts, divergence, shared and damaged run folders.

The notebooks test the mechanisms (06: checkpoints, locks, signals; 10: the commands); these tests use the command
line the way a user does. Signals, locks and kills need a real second process, so those run `ct` in a subprocess;
the others call `main([...])` in this process, which behaves the same and is faster.
"""
import json, math, os, shlex, shutil, signal, subprocess, sys, time
from pathlib import Path
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from compressive_tutorial.cli import main, make_parser

CT = [sys.executable, '-m', 'compressive_tutorial.cli']
TINY = ['--preset', 'cpu-tiny', '--set', 'd_model=32', 'n_heads=2', 'd_ff=64', 'n_s=16', 'n_m=8', 'n_cm=8', 'c=2',
        'batch_size=4', 'eval_batch_size=2', 'valid_batches=4', 'progress=false', 'threads=1', '--device', 'cpu']


def ct(capsys, *argv) -> tuple:  # (exit status, stdout, stderr)
    "`ct argv...` in this process."
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, status=None):
    "An error is one line `ct CMD: error: ...` with a non-zero status, never a traceback."
    assert code != 0 and (status is None or code == status), (code, err)
    assert 'Traceback' not in err, err
    lines = [l for l in err.splitlines() if l.strip() and ': warning: ' not in l]
    assert len(lines) == 1 and lines[0].startswith('ct ') and ': error: ' in lines[0], err
    return lines[0]


def ckpt_meta(path) -> dict:
    "The JSON of a checkpoint, read without the library (works for any version of it)."
    with safe_open(str(path), framework='pt') as f: return json.loads(f.metadata()['meta'])


def strict_json(path):
    "Parse a JSON file, refusing NaN and Infinity (which json.dumps writes by default but JSON does not allow)."
    def bad(c): raise ValueError(f'{path} holds {c}, which is not JSON')
    return json.loads(Path(path).read_text(), parse_constant=bad)


@pytest.fixture(scope='session')
def corpus(tmp_path_factory) -> Path:
    "About 40 kB of pseudo-text: enough for train, valid and test splits of a tiny run."
    import random
    rng = random.Random(0)
    words = 'the memory of a compressive transformer keeps old states in a compressed form so that'.split()
    p = tmp_path_factory.mktemp('corpus')/'fixture.txt'
    p.write_text('\n'.join(' '.join(rng.choice(words) for _ in range(12)) + '.' for _ in range(600)))
    return p


@pytest.fixture(scope='session')
def trained(corpus, tmp_path_factory) -> Path:
    "A finished 6-step run, in a folder whose name has a space (hints must quote it)."
    out = tmp_path_factory.mktemp('runs')/'tiny run'
    assert main(['train', str(corpus), '--out', str(out), '--steps', '6', *TINY]) == 0
    return out


def copy_run(src:Path, dst:Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def start(*argv, env=None) -> subprocess.Popen:
    "Start `ct argv...` in a subprocess and return once it has started training (its 'data:' line)."
    p = subprocess.Popen([*CT, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    for line in p.stdout:
        if line.lstrip().startswith('data:'): return p
    p.wait(); raise AssertionError(f'ct exited {p.returncode} before training: {p.stderr.read()}')


# ------------------------------------------------------------------------------------------------- interrupts
@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM])
def test_interrupt_writes_checkpoint_and_prints_resume_command(corpus, tmp_path, sig):
    out = tmp_path/'my run'
    p = start('train', corpus, '--out', out, '--steps', 100_000, *TINY)
    time.sleep(1.5)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert 'Traceback' not in err, err
    step = ckpt_meta(out/'last.safetensors')['step']
    assert 0 < step < 100_000
    cmd = next(l.split('continue with: ', 1)[1] for l in err.splitlines() if 'continue with: ' in l)
    argv = shlex.split(cmd)
    assert argv[:2] == ['ct', 'train'] and argv[argv.index('--out') + 1] == str(out) and '--resume' in argv, cmd
    assert shlex.quote(str(out)) in cmd                                     # quoted: the folder name has a space
    r = subprocess.run([*CT, *argv[1:], '--steps', str(step + 2)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f'steps {step:,} -> {step + 2:,}' in r.stdout                   # it continued from the checkpoint


def test_checkpoints_by_default(corpus, tmp_path):
    "A run killed without warning (SIGKILL) still leaves a checkpoint: the presets checkpoint as they go."
    out = tmp_path/'killed'
    p = start('train', corpus, '--out', out, '--steps', 100_000, *TINY)
    deadline = time.time() + 60
    while not (out/'last.safetensors').exists() and time.time() < deadline: time.sleep(0.2)
    p.kill(); p.communicate()
    step = ckpt_meta(out/'last.safetensors')['step']
    assert 0 < step < 100_000


# ------------------------------------------------------------------------------------------------- divergence
def test_divergence_stops_the_run_and_keeps_the_good_checkpoint(capsys, corpus, tmp_path):
    out = tmp_path/'diverged'
    code, _, err = ct(capsys, 'train', corpus, '--out', out, '--steps', 40, *TINY, '--set', 'lr_max=1e6', 'ckpt_every=1')
    line = one_line_error(code, err, 1)
    assert 'diverged at step' in line, line
    if (out/'results.json').exists(): strict_json(out/'results.json')       # never NaN in a results file
    ck = out/'last.safetensors'                                             # the last good checkpoint: finite...
    assert all(bool(torch.isfinite(t).all()) for t in load_file(ck).values() if t.is_floating_point())
    code, res, err = ct(capsys, 'eval', out, '--batches', 2)                # ...and it evaluates to a finite number
    assert code == 0 and math.isfinite(float(res.split('bits per byte: ')[1])), err
    code, _, err = ct(capsys, 'sample', out, '--prompt', 'the', '--n', 5)
    assert code == 0, err


def test_results_json_is_json(trained):
    res = strict_json(trained/'results.json')
    assert math.isfinite(res['valid']['bpb'])


# ------------------------------------------------------------------------------------------------- shared folders
def test_two_runs_cannot_share_a_folder(capsys, corpus, tmp_path):
    out = tmp_path/'shared'
    a = start('train', corpus, '--out', out, '--steps', 100_000, *TINY)
    try:
        code, _, err = ct(capsys, 'train', corpus, '--out', out, '--steps', 5, *TINY)
        line = one_line_error(code, err)
        assert 'in use' in line and str(a.pid) in line, line
        code, _, err = ct(capsys, 'train', '--out', out, '--resume')
        assert code != 0 and 'Traceback' not in err
    finally:
        a.send_signal(signal.SIGINT); a.communicate(timeout=60)
    assert a.returncode == 130
    assert ckpt_meta(out/'last.safetensors')['model']['config']['d_model'] == 32    # the folder holds run A's checkpoint


# ------------------------------------------------------------------------------------------------- checkpoint identity
def test_checkpoint_of_another_model_is_refused(capsys, corpus, trained, tmp_path):
    for sets, field in ((['n_m=16'], 'n_m'), (['d_model=16'], 'd_model')):  # same shapes, other memory; other shapes
        other = tmp_path/f'other-{field}'
        assert ct(capsys, 'train', corpus, '--out', other, '--steps', 2, *TINY, '--set', *sets)[0] == 0
        mixed = copy_run(trained, tmp_path/f'mixed-{field}')
        shutil.copy(other/'last.safetensors', mixed/'last.safetensors')     # a foreign checkpoint in the run folder
        for cmd in (['eval', mixed, '--batches', 2], ['sample', mixed, '--prompt', 'the', '--n', 3]):
            line = one_line_error(*ct(capsys, *cmd)[::2])
            assert field in line, line


def test_damaged_tensor_data_is_refused_and_not_overwritten(capsys, trained, tmp_path):
    run = copy_run(trained, tmp_path/'damaged')
    ck = run/'last.safetensors'
    raw = bytearray(ck.read_bytes())
    start_ = 8 + int.from_bytes(raw[:8], 'little')                          # after the JSON header: tensor data
    mid = (start_ + len(raw)) // 2
    raw[mid:mid + 2000] = bytes(255 - b for b in raw[mid:mid + 2000])
    ck.write_bytes(raw)
    line = one_line_error(*ct(capsys, 'eval', run, '--batches', 2)[::2], status=1)
    assert 'damaged' in line, line
    code, _, err = ct(capsys, 'train', '--out', run, '--resume', '--steps', 8)
    one_line_error(code, err)
    assert ck.read_bytes() == raw                                           # the evidence is left as it was


# ------------------------------------------------------------------------------------------------- resume semantics
def test_resume_with_more_steps_stretches_the_schedule(capsys, corpus, trained, tmp_path):
    run = copy_run(trained, tmp_path/'stretched')            # made for 6 steps: its warmup rounds to 0; a new 30-step run's is 1
    code, out, err = ct(capsys, 'train', '--out', run, '--resume', '--steps', 30)
    assert code == 0, err
    fresh = tmp_path/'fresh30'
    assert ct(capsys, 'train', corpus, '--out', fresh, '--steps', 30, *TINY)[0] == 0
    got, want = (json.loads((p/'config.json').read_text())['train'] for p in (run, fresh))
    for k in ('warmup_steps', 'decay_steps', 'update_every_after'): assert got[k] == want[k], (k, got[k], want[k])
    one_line_error(*ct(capsys, 'train', '--out', run, '--resume', '--steps', 3)[::2], status=2)   # fewer than done


def test_resume_inside_a_group_keeps_its_switch(capsys, corpus, tmp_path):
    """A run stopped inside a §5.5.1 group keeps the switch that aligns its groups (the pending gradients' group), and so does
    one that the new switch would put inside a group; the rest of the schedule stretches as for a new run."""
    small = ['--preset', 'colab', '--set', 'd_model=32', 'n_heads=2', 'd_ff=64', 'n_layers=2', 'n_s=16', 'n_m=8', 'n_cm=8', 'c=2',
             'batch_size=4', 'eval_batch_size=2', 'valid_batches=4', 'progress=false', 'threads=1', '--device', 'cpu']
    run = tmp_path/'grouped'
    assert ct(capsys, 'train', corpus, '--out', run, '--steps', 8, *small)[0] == 0   # switch at 5: windows 5-7 of a group pending
    assert json.loads((run/'config.json').read_text())['train']['update_every_after'] == 5
    code, out, err = ct(capsys, 'train', '--out', run, '--resume', '--steps', 30)
    assert code == 0, err
    got = json.loads((run/'config.json').read_text())['train']
    assert (got['update_every_after'], got['warmup_steps'], got['decay_steps']) == (5, 1, 29), got
    run = tmp_path/'boundary'                                                  # stopped on a group boundary: 9 steps, switch 5, groups of 4;
    assert ct(capsys, 'train', corpus, '--out', run, '--steps', 9, *small)[0] == 0   # a 13-step run's switch (8) would put step 9
    assert ct(capsys, 'train', '--out', run, '--resume', '--steps', 13)[0] == 0     # inside its group [8, 11], window 8 missing
    assert json.loads((run/'config.json').read_text())['train']['update_every_after'] == 5

# ------------------------------------------------------------------------------------------------- small cases
def test_model_too_large_for_memory_is_refused_up_front(capsys, corpus, tmp_path):
    code, out, err = ct(capsys, 'train', corpus, '--out', tmp_path/'huge', *TINY, '--set', 'd_model=1000000000')
    line = one_line_error(code, err, 2)
    assert 'about' in line and 'bytes' in line.lower(), line
    assert not (tmp_path/'huge').exists()


def test_demo_refuses_an_unwritable_plot_before_training(capsys):
    t0 = time.perf_counter()
    code, out, err = ct(capsys, 'demo', '--plot', '/nonexistent/x.png', '--steps', 50)
    line = one_line_error(code, err, 2)
    assert '/nonexistent' in line and out == '' and time.perf_counter() - t0 < 10


def test_demo_refuses_a_plot_folder_root_cannot_write_before_training(capsys):
    if not Path('/proc').is_dir(): pytest.skip('no /proc')
    t0 = time.perf_counter()                                # os.access says yes to root; creating a file there fails
    code, out, err = ct(capsys, 'demo', '--plot', '/proc/x.png', '--steps', 50)
    line = one_line_error(code, err, 2)
    assert '/proc/x.png' in line and 'cannot write' in line and out == '' and time.perf_counter() - t0 < 10


@pytest.mark.parametrize('device', ['foo', 'meta', 'cuda:99'])
def test_bad_device_is_refused_before_anything(capsys, corpus, trained, tmp_path, device):
    code, out, err = ct(capsys, 'train', corpus, '--out', tmp_path/'r', *TINY[:-1], device)   # TINY ends with --device cpu
    line = one_line_error(code, err, 2)
    assert device in line and ('cuda:N' in line or 'no such device' in line), line
    assert not (tmp_path/'r').exists()                      # no config.json written, no folder made
    for cmd in (['eval', trained], ['sample', trained, '--prompt', 'x'], ['demo', '--steps', 50]):
        line = one_line_error(*ct(capsys, *cmd, '--device', device)[::2], status=2)
        assert f'--device {device}:' in line, line
    line = one_line_error(*ct(capsys, 'bench', '--preset', 'cpu', '--set', f'device={device}')[::2], status=2)
    assert f'device={device}' in line, line


def test_bench_refuses_a_json_folder_before_running(capsys, tmp_path):
    t0 = time.perf_counter()
    code, out, err = ct(capsys, 'bench', '--preset', 'cpu', '--json', tmp_path)
    line = one_line_error(code, err, 2)
    assert 'is a folder' in line and out == '' and time.perf_counter() - t0 < 10


def test_demo_plot_goes_where_git_ignores_it(capsys):
    root = Path(__file__).resolve().parents[1]
    if not (root/'.git').exists(): pytest.skip('not a git checkout')
    default = make_parser().parse_args(['demo']).plot
    r = subprocess.run(['git', 'check-ignore', '-q', default], cwd=root)
    assert r.returncode == 0, f'the default plot {default} is not git-ignored'


def test_binary_bytes_as_txt_warn(capsys, tmp_path):
    p = tmp_path/'binary.txt'
    p.write_bytes(torch.randint(0, 256, (60_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes())
    code, _, err = ct(capsys, 'train', p, '--out', tmp_path/'bin', '--steps', 1, *TINY)
    assert 'warning' in err and 'text' in err, err


def test_data_dir_without_books_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv('CT_DATA_DIR', str(tmp_path))
    line = one_line_error(*ct(capsys, 'train', 'books', '--out', tmp_path/'b', *TINY)[::2], status=1)
    assert 'CT_DATA_DIR' in line and 'books' in line, line


def test_hints_quote_paths(capsys, trained, tmp_path):
    run = copy_run(trained, tmp_path/"it's here")
    code, out, err = ct(capsys, 'train', '--out', run, '--resume', '--steps', 7)
    assert code == 0, err
    hints = [l for l in out.splitlines() if str(run) in l or 'ct eval' in l]
    assert hints and all(shlex.quote(str(run)) in l for l in hints), hints


@pytest.mark.parametrize('case', ['no folder', 'not a run', 'no checkpoint', 'damaged config', 'pickle'])
def test_errors_are_one_line(capsys, trained, tmp_path, case):
    run = tmp_path/'run'
    if case != 'no folder': run.mkdir()
    if case in ('no checkpoint', 'damaged config', 'pickle'): shutil.copy(trained/'config.json', run/'config.json')
    if case == 'damaged config': (run/'config.json').write_text('{"format": "compressive_tutorial.cli/1", "kind": ')
    if case == 'pickle': torch.save({'w': torch.ones(2)}, run/'last.safetensors')
    for cmd in (['eval', run], ['sample', run, '--prompt', 'x'], ['train', '--out', run, '--resume']):
        one_line_error(*ct(capsys, *cmd)[::2])


@pytest.mark.parametrize('case', ['weights only', 'another kind'])
def test_resume_refuses_a_checkpoint_that_is_not_a_run_of_this_kind(capsys, corpus, trained, tmp_path, case):
    from compressive_tutorial.checkpoint import save_checkpoint
    run = copy_run(trained, tmp_path/'run')
    if case == 'weights only':                                          # what `save_checkpoint` writes for a model alone (notebook 90)
        weights = {k: v for k, v in load_file(str(trained/'last.safetensors')).items() if k.startswith('model.')}
        save_checkpoint(run/'last.safetensors', weights, {})
        want = 'holds weights only'
    else:                                                               # a Transformer-XL run's checkpoint in a CT run's folder
        txl = tmp_path/'txl'
        sets = [a for a in TINY if not a.startswith(('n_cm=', 'c='))]
        assert ct(capsys, 'train', corpus, '--out', txl, '--model', 'txl', '--steps', 2, *sets)[0] == 0
        shutil.copy(txl/'last.safetensors', run/'last.safetensors')
        want = 'holds a TransformerXL'
    for steps in ([], ['--steps', 30]):                                 # (--steps used to be checked first: "already at step")
        line = one_line_error(*ct(capsys, 'train', '--out', run, '--resume', *steps)[::2])
        assert want in line, line


def test_out_that_is_a_file_is_refused(capsys, corpus, tmp_path):
    f = tmp_path/'afile'; f.write_text('not a folder')
    line = one_line_error(*ct(capsys, 'train', corpus, '--out', f, '--steps', 2, *TINY)[::2])
    assert 'is a file' in line, line
