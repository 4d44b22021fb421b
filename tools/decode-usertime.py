#!/usr/bin/env python3
"""Compare two kv-run builds' decode cost by user CPU time, not wall clock.

On a shared machine a decode's wall-clock tokens/s mostly measures the
scheduler; the user CPU time of the process (getrusage of the child) does
not.  Runs are interleaved A B B A so both builds see the same load.

  python3 tools/decode-usertime.py ROUNDS MODEL BIN_A BIN_B [-n STEPS]

Each run: BIN/kv-run -m MODEL --random-prompt 1 -n STEPS --temp 0
--ctx STEPS+100 -T 1 --report -.  Prints per build the median and minimum
user seconds and the median tokens/s, then B/A ratios.
"""
import argparse
import json
import resource
import statistics as st
import subprocess

ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
ap.add_argument('rounds', type=int)
ap.add_argument('model')
ap.add_argument('bin_a')
ap.add_argument('bin_b')
ap.add_argument('-n', type=int, default=500, help='decode steps per run (default 500)')
a = ap.parse_args()
user = {a.bin_a: [], a.bin_b: []}
tps = {a.bin_a: [], a.bin_b: []}


def one(b):
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    out = subprocess.run([b + '/kv-run', '-m', a.model, '--random-prompt', '1', '-n', str(a.n), '--temp', '0',
                          '--ctx', str(a.n + 100), '-T', '1', '--report', '-'],
                         capture_output=True, text=True, check=True).stdout
    user[b].append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - r0)
    tps[b].append(json.loads(out)['tokens_per_s'])


for _ in range(a.rounds):
    for b in (a.bin_a, a.bin_b, a.bin_b, a.bin_a):
        one(b)
for b in (a.bin_a, a.bin_b):
    print(f'{b}: {len(user[b])} runs, user s median {st.median(user[b]):.4f} (min {min(user[b]):.4f}), '
          f'tok/s median {st.median(tps[b]):.0f}')
print('B/A user time: medians %.3f, minima %.3f' % (st.median(user[a.bin_b]) / st.median(user[a.bin_a]),
                                                   min(user[a.bin_b]) / min(user[a.bin_a])))
