"""The processes of tests/test_ddp.py: run as `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_worker.py
PHASE OUT` (2 ranks, gloo on the CPU) or as `python tests/ddp_worker.py PHASE OUT` (one process). Not a test file itself."""
import json, signal, sys, time, types
from dataclasses import asdict, replace
from pathlib import Path
import torch
from safetensors.torch import save_file
from compressive_tutorial.data import StreamLoader
from compressive_tutorial.analysis import eval_across_memory_sizes
from compressive_tutorial.cli import load_corpus
from compressive_tutorial.data import fixture_download
import compressive_tutorial.enwik8 as enwik8
from compressive_tutorial.enwik8 import ENWIK8_PRESETS, train_protocol
from compressive_tutorial.model import CompressiveTransformer, CTConfig
from compressive_tutorial.train import Trainer, TrainConfig, TrainingInterrupted, init_distributed, dist_rank_world, evaluate, seed_everything

B, N_S = 4, 8
CFG = TrainConfig(lr_max=1e-3, warmup_steps=3, decay_steps=20, update_every=2, update_every_after=5, clip_norm=None, progress=False)


def make(seed=0):
    "The same model (no dropout: the ranks' masks would differ from one process's) and the same data on every rank."
    seed_everything(seed)
    model = CompressiveTransformer(CTConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64, n_s=N_S, n_m=8, n_cm=4, c=2,
                                            compression='conv', compression_loss='attention'))
    tokens = torch.randint(0, 256, (B * N_S * 5 + 3,), generator=torch.Generator().manual_seed(1))   # the last window is padded
    M = len(tokens) - 1; starts = [b * M // B for b in range(B)]
    docs = [0, starts[2] + 2 * N_S + 1, starts[3] + 3 * N_S + 1]   # documents start in windows 2 and 3 of streams 2 and 3 (rank 1's):
    return model, StreamLoader(tokens, batch_size=B, n_s=N_S, doc_starts=docs)   # rank 1 then has 1 or 0 streams with an aux loss


def spy_aux_share(t):
    "Record the weight of every window's aux loss on this rank: world x its share of the qualifying streams."
    seen, share = [], t._aux_share
    t._aux_share = lambda rows: seen.append(share(rows)) or seen[-1]
    return seen


def spy_grads(t):
    "Record the gradients each optimiser is about to apply, at every update."
    seen = []
    for name in ('opt', 'copt'):
        o = getattr(t, name); step = o.step
        def spy(*a, _name=name, _o=o, _step=step, **k):
            seen.append({f'{_name}.{i}': p.grad.detach().clone() for i, p in enumerate(q for g in _o.param_groups for q in g['params'])
                         if p.grad is not None})
            return _step(*a, **k)
        o.step = spy
    return seen


def main(phase, out):
    out = Path(out)
    init_distributed(device='cpu')                         # gloo on the CPU, on a machine with GPUs too
    torch.set_num_threads(1)
    rank, world = dist_rank_world()
    if phase in ('first', 'single'):                       # the gradients of every update of 8 windows (one pass and more)
        model, dl = make(); t = Trainer(model, dl, cfg=CFG)
        seen, shares = spy_grads(t), spy_aux_share(t); t.fit(8)
        if rank == 0: save_file({f'{j}.{k}': v for j, s in enumerate(seen) for k, v in s.items()} | {'aux_share': torch.tensor(shares)},
                                str(out/f'grads-{world}.safetensors'))
        model, dl = make()                                 # rank 1's streams with almost no targets in every other window: each rank's
        y_masked = lambda i, y: y if i % 2 else torch.cat([y[:B // 2], torch.cat([y[B // 2:, :1], torch.full_like(y[B // 2:, 1:], -100)], 1)])
        t = Trainer(model, [b._replace(y=y_masked(i, b.y)) for i, b in enumerate(dl)], cfg=CFG)   # gradient weighs by its targets
        seen = spy_grads(t); t.fit(4)
        if rank == 0: save_file({f'{j}.{k}': v for j, s in enumerate(seen) for k, v in s.items()}, str(out/f'grads-uneven-{world}.safetensors'))
    if phase == 'first':                                  # A: 12 steps straight; B: 6 steps, checkpointed (2 ranks)
        model, dl = make(); Trainer(model, dl, cfg=CFG, ckpt_dir=out/'A').fit(12)
        model, dl = make(); Trainer(model, dl, cfg=CFG, ckpt_dir=out/'B').fit(6)
    if phase in ('first', 'single'):                       # B resumed to 12, on 2 ranks (the same processes) or on 1
        if world > 1: torch.distributed.barrier()          # rank 0 has written B's checkpoint
        model, dl = make(seed=99)
        folder = out/f'B{world}'
        t = Trainer.resume(out/'B'/'last.safetensors', model, dl, ckpt_dir=folder)
        assert t.step == 6 and t.state.batch_size == B // world, (t.step, t.state.batch_size)
        t.fit(12)
    if phase == 'single':                                 # one process straight through, for the printed difference
        model, dl = make(); Trainer(model, dl, cfg=CFG, ckpt_dir=out/'A1').fit(12)
    if phase in ('first', 'single'):                       # a memory-size sweep, sharded: each rank reads its block of streams
        model, dl = make(); seen = []
        model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
        rows = eval_across_memory_sizes(model, dl, [0, 4], skip=1, shard=True)
        listed = eval_across_memory_sizes(model, list(dl), [0, 4], skip=1, shard=True)   # a list of windows: no batch size of its own
        sizes, windows = sorted(set(seen)), len(seen)
        odd = evaluate(model, [type(b)(*(t[:3] for t in b)) for b in dl], shard=True)   # 3 streams do not split over 2 ranks: each reads all
        if rank == 0: (out/f'sweep-{world}.json').write_text(json.dumps(dict(rows=rows, listed=listed, batch_sizes=sizes, windows=windows,
                                                                           odd=[odd['tokens'], odd['nats']])))
        kw = json.loads((out/'fx'/'kw.json').read_text())  # the Enwik8 protocol on the fixture the test extracted: rank 0 alone writes its files
        data = load_corpus('enwik8', fixture_download({}), out/'fx'/'cache', **kw)
        train_protocol(out/f'protocol-{world}', replace(ENWIK8_PRESETS['tiny'], steps=20), data, progress=False)
    if phase == 'minutes':                                # train_protocol(max_minutes=): rank 1's clock 100 s ahead at every reading
        if rank == 1:
            reads = [0]
            def ahead(): reads[0] += 1; return time.perf_counter() + 100 * reads[0]
            enwik8.time = types.SimpleNamespace(perf_counter=ahead, strftime=time.strftime)
        kw = json.loads((out/'fx'/'kw.json').read_text())
        data = load_corpus('enwik8', fixture_download({}), out/'fx'/'cache', **kw)
        t = train_protocol(out/'minutes', replace(ENWIK8_PRESETS['tiny'], steps=20), data, max_minutes=3, progress=False)
        (out/f'minutes-{rank}.json').write_text(json.dumps(t.step))   # (before the fix: rank 0 went on alone and waited for ever)
    if phase == 'signals':                                # SIGTERM on rank 0 alone, at step 3, just after the stop agreement
        got = {}
        for where in ('_agree', 'evaluate'):              # ... after its all-reduce returned / in the evaluation that follows it
            model, dl = make()
            t = Trainer(model, dl, dl, cfg=TrainConfig(**{**asdict(CFG), 'eval_every': 1, 'eval_batches': 1}), ckpt_dir=out/where)
            def late(*a, _f=getattr(t, where), _t=t, **k):
                res = _f(*a, **k)
                if rank == 0 and _t.step == 3: signal.raise_signal(signal.SIGTERM)
                return res
            setattr(t, where, late)
            try: t.fit(12); got[where] = None
            except TrainingInterrupted as e: got[where] = [e.signum, e.step]
        (out/f'signals-{rank}.json').write_text(json.dumps(got))
    if world > 1: torch.distributed.barrier(); torch.distributed.destroy_process_group()   # no rank closes its connections early


if __name__ == '__main__': main(*sys.argv[1:])
