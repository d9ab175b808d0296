"""How many training steps each of notebook 09's two GPU runs can take in the seconds left to a lent machine's command.

    python3 .ci/gpu_steps.py $OUT/15_performance.ipynb SECONDS_LEFT   # prints the steps (a multiple of 100, 300..5000)

The step time is the one measured in the same command by notebook 15's GPU benchmark (`ours-ct`'s training tokens/s at
the same sizes, bf16, 16 x 512 tokens a step; notebook 09's CT has smaller memories, so this errs long), times 1.8 for
what the trainer adds (dropout, clipping, the evaluations every 500 steps, checkpoints). 90 s are kept for the set-up
cells, the final evaluations and the figures. Without a benchmark result from this command (the
cell not run, or failed before it) it prints 1000.
"""
import json, re, sys

def steps(nb_path:str, seconds_left:float, tokens_per_step:int=16 * 512) -> int:
    try:
        nb = json.load(open(nb_path))
        text = ''.join(''.join(o.get('text', '')) for c in nb['cells'] if c.get('id') == 'b1500032'   # only if it ran in this command
                       and c.get('metadata', {}).get('ct_gpu_ran') for o in c.get('outputs', []))
        tps = float(re.search(r'^ours-ct\s+([\d,]+)', text, re.M).group(1).replace(',', ''))
    except (OSError, ValueError, AttributeError, KeyError) as e:
        print(f'no benchmark result in {nb_path} ({type(e).__name__}): 1000 steps', file=sys.stderr); return 1000
    per_run = (seconds_left - 90) / 2
    n = int(per_run / (1.8 * tokens_per_step / tps)) // 100 * 100
    print(f'ours-ct trains {tps:,.0f} tokens/s: {tokens_per_step / tps * 1e3:.1f} ms a step; {per_run:.0f} s a run -> {n} steps',
          file=sys.stderr)
    return max(300, min(5000, n))

if __name__ == '__main__': print(steps(sys.argv[1], float(sys.argv[2])))
