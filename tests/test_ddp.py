"""DistributedDataParallel on the CPU with the gloo backend and 2 processes started by torchrun (notebook 06, "Many GPUs"):
the gradients of DDP steps equal those of one process on the same global batch (also in windows where one rank has no
auxiliary loss), a run checkpointed on 2 ranks resumes on 2 ranks bit for bit and on 1 rank up to floating-point summation
order, a signal that reaches one rank stops every rank after the same window, sharded evaluation equals one process's,
and the Enwik8 protocol writes its files once. The processes are tests/ddp_worker.py."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
import torch
from compressive_tutorial.train import load_checkpoint
from safetensors.torch import load_file

WORKER = Path(__file__).with_name('ddp_worker.py')
ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason='torch.distributed is not available')


def launch(phase, out, ranks, timeout=600):
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={ranks}'] if ranks > 1 else [sys.executable]
    r = subprocess.run(cmd + [str(WORKER), phase, str(out)], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f'{phase} on {ranks} rank(s) failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}'


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('ddp')
    from compressive_tutorial.enwik8 import make_enwik8_fixture
    from compressive_tutorial.cli import load_corpus
    dl, kw = make_enwik8_fixture(out/'fx')
    load_corpus('enwik8', dl, out/'fx'/'cache', **kw)   # downloaded from the fixture and extracted once, before the ranks read it
    (out/'fx'/'kw.json').write_text(json.dumps(kw))
    launch('first', out, 2)      # DDP: gradients, run A (12 steps), run B (6 steps, checkpoint), B resumed by new trainers
    launch('single', out, 1)     # one process: gradients, B resumed on 1 rank, and 12 steps straight
    return out


def test_ddp_gradients_equal_one_process(runs):
    ddp, one = load_file(str(runs/'grads-2.safetensors')), load_file(str(runs/'grads-1.safetensors'))
    shares, one_shares = ddp.pop('aux_share'), one.pop('aux_share')            # rank 0's weights: 2 x 2 / (2 + rank 1's streams)
    assert (one_shares == 1).all() and {1.0, 1.333} <= {round(x, 3) for x in shares.tolist()}, shares   # rank 1 with 2, then 1
    assert sorted(ddp) == sorted(one) and any(k.split('.')[1] == 'copt' for k in ddp)   # both optimisers, every update
    assert len({k.split('.')[0] for k in ddp if k.split('.')[1] == 'opt'}) == 6         # 8 windows: 5 single updates + 1 group of 2
    for k in one:                                    # tolerance: float32 summation order (2 halves + all-reduce vs one sum)
        scale = one[k].abs().max().item()
        assert (ddp[k] - one[k]).abs().max().item() <= 1e-5 * scale + 1e-9, k


def test_ddp_gradients_weigh_ranks_by_their_targets(runs):
    "Windows where rank 1's streams have almost no targets (-100): the 2-rank gradients are still one process's on the global batch."
    ddp, one = load_file(str(runs/'grads-uneven-2.safetensors')), load_file(str(runs/'grads-uneven-1.safetensors'))
    assert sorted(ddp) == sorted(one) and ddp
    for k in one:
        assert (ddp[k] - one[k]).abs().max().item() <= 1e-5 * one[k].abs().max().item() + 1e-9, k


def test_resume_on_two_ranks_is_exact(runs):
    a, b = load_checkpoint(runs/'A'/'last.safetensors'), load_checkpoint(runs/'B2'/'last.safetensors')
    assert a[1]['step'] == b[1]['step'] == 12 and a[1]['state_batch_size'] == b[1]['state_batch_size'] == 4
    keys = [k for k in a[0] if k.split('.')[0] in ('model', 'opt', 'copt', 'state', 'grad')]
    assert sorted(keys) == sorted(k for k in b[0] if k.split('.')[0] in ('model', 'opt', 'copt', 'state', 'grad'))
    assert any(k.startswith('state.') for k in keys) and any(k.startswith('copt.') for k in keys)
    for k in keys: assert torch.equal(a[0][k], b[0][k]), k                     # bit for bit: weights, Adam, memories
    timeless = lambda h: [{k: v for k, v in r.items() if k != 'tok_s'} for r in h]
    assert timeless(a[1]['history']) == timeless(b[1]['history'])              # the same (global) metrics


def test_resume_on_one_rank_continues_the_run(runs):
    a, c = load_checkpoint(runs/'A'/'last.safetensors'), load_checkpoint(runs/'B1'/'last.safetensors')
    assert c[1]['step'] == 12 and c[1]['world'] == 1
    worst = {k: (c[0][k] - a[0][k]).abs().max().item() for k in a[0] if k.startswith(('model.', 'state.')) and a[0][k].is_floating_point() and a[0][k].numel()}   # (empty open windows: nothing to compare)
    print('2 ranks -> checkpoint -> 1 rank, largest difference from the 2-rank run:', max(worst.values()))
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]   # summation order only
    one = load_checkpoint(runs/'A1'/'last.safetensors')
    print('1 rank straight vs 2 ranks straight:', max((one[0][k] - a[0][k]).abs().max().item() for k in worst))


def test_ddp_metrics_equal_one_process(runs):
    "The logged losses of 2 ranks are those of one process on the global batch: the task loss averaged over tokens, the auxiliary\n    loss over the streams it averaged on each rank (here unequal: rank 1's streams hold document starts)."
    a, one = load_checkpoint(runs/'A'/'last.safetensors')[1]['history'], load_checkpoint(runs/'A1'/'last.safetensors')[1]['history']
    rows = [(r, s) for r, s in zip(a, one) if 'aux' in r]
    assert len(a) == len(one) and rows and [r['step'] for r in a] == [s['step'] for s in one]
    for r, s in rows:
        for k in ('loss', 'aux'): assert abs(r[k] - s[k]) <= 1e-5 * abs(s[k]), (r['step'], k, r[k], s[k])
        for x, y in zip(r['aux_layers'], s['aux_layers']): assert abs(x - y) <= 1e-5 * abs(y), (r['step'], r['aux_layers'], s['aux_layers'])


def test_ddp_memory_sweep_equals_one_process(runs):
    "eval_across_memory_sizes(shard=True) on 2 ranks: each reads its half of the streams, and the rows are one process's."
    two, one = (json.loads((runs/f'sweep-{w}.json').read_text()) for w in (2, 1))
    assert (two['batch_sizes'], one['batch_sizes'], two['windows'], one['windows']) == ([2], [4], one['windows'], 4 * 6), (two, one)   # 2 calls x 2 sizes x 6 windows
    for a, b in zip(two['rows'] + two['listed'], one['rows'] + one['rows']):
        assert {k: v for k, v in a.items() if k != 'loss' and k != 'bpb'} == {k: v for k, v in b.items() if k != 'loss' and k != 'bpb'}
        assert abs(a['loss'] - b['loss']) <= 1e-6 * b['loss'], (a, b)


def test_ddp_evaluation_of_streams_that_do_not_split(runs):
    "evaluate(shard=True) on 3 streams and 2 ranks (a list of windows): every rank reads all of them, and the totals are one process's."
    two, one = (json.loads((runs/f'sweep-{w}.json').read_text())['odd'] for w in (2, 1))
    assert two[0] == one[0] and abs(two[1] - one[1]) <= 1e-9 * one[1], (two, one)


def test_enwik8_protocol_files_written_once(runs):
    "train_protocol under torchrun: rank 0 alone writes protocol.json and the sessions log (one session, not one per rank)."
    for w in (2, 1):
        rows = [json.loads(l) for l in (runs/f'protocol-{w}'/'sessions.jsonl').read_text().splitlines()]
        assert [(r['start_step'], r['end_step']) for r in rows] == [(0, 20)], (w, rows)
        assert json.loads((runs/f'protocol-{w}'/'protocol.json').read_text())['preset']['steps'] == 20


def test_enwik8_protocol_time_budget_agreed(runs):
    "train_protocol(max_minutes=) on 2 ranks whose clocks disagree: both stop after the same chunk (one alone would hang the other)."
    launch('minutes', runs, 2, timeout=180)
    assert json.loads((runs/'minutes-0.json').read_text()) == json.loads((runs/'minutes-1.json').read_text()) == 10


def test_signal_on_one_rank_stops_every_rank(tmp_path):
    "SIGTERM on rank 0 just after a step's stop agreement (after its all-reduce, or in the evaluation after it): not lost, not split."
    launch('signals', tmp_path, 2, timeout=300)      # before the fix: the first one was lost, the second one hung rank 1
    got = [json.loads((tmp_path/f'signals-{r}.json').read_text()) for r in (0, 1)]
    assert got[0] == got[1] == {'_agree': [15, 4], 'evaluate': [15, 4]}, got   # SIGTERM, both ranks after window 4
    for where in ('_agree', 'evaluate'): assert load_checkpoint(tmp_path/where/'last.safetensors')[1]['step'] == 4


def test_ct_train_under_torchrun(tmp_path):
    "`ct train` under torchrun with 2 processes: rank 0 reports and writes, the run resumes in one process."
    import random
    rng = random.Random(0)
    words = 'the memory of a compressive transformer keeps old states in a compressed form so that'.split()
    fixture = tmp_path/'fixture.txt'
    fixture.write_text('\n'.join(' '.join(rng.choice(words) for _ in range(12)) + '.' for _ in range(600)))
    micro = ['--preset', 'cpu-tiny', '--set', 'd_model=32', 'n_heads=2', 'd_ff=64', 'n_s=16', 'n_m=8', 'n_cm=8', 'c=2', 'batch_size=4',
             'eval_batch_size=2', 'valid_batches=4', 'progress=false', 'threads=1', '--device', 'cpu']
    cli = ['-m', 'compressive_tutorial.cli', 'train']
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', *cli, str(fixture),
                        '--out', str(tmp_path/'run'), '--steps', '6', *micro], env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count('valid bits per byte:') == 1 and 'DDP over 2 processes' in r.stdout, r.stdout   # rank 0 alone speaks
    ckpt = load_checkpoint(tmp_path/'run'/'last.safetensors')[1]
    assert (ckpt['step'], ckpt['world'], ckpt['state_batch_size']) == (6, 2, 4)
    r = subprocess.run([sys.executable, *cli, '--out', str(tmp_path/'run'), '--resume', '--steps', '8'], env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and 'steps 6 -> 8' in r.stdout, r.stdout + r.stderr[-3000:]
    assert load_checkpoint(tmp_path/'run'/'last.safetensors')[1]['world'] == 1
