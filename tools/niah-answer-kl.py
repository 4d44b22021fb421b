#!/usr/bin/env python3
"""A quick proxy for a policy's needle accuracy on niah4k: KL(full || policy)
at the answer digits, teacher-forced.

For each task: BOS + the prompt + its answer as byte tokens (niah4k's
tokenizer: id = byte + 3, after a dummy-prefix space), the haystack up to
the last "\\nQuestion:" prefilled densely (--prefix), the question and the
answer decoded through each policy by `kv-bench fidelity --per-position`;
the last 7 positions predict the 7 answer digits.  Prints, per policy, the
mean KL over those positions, their top-1 agreement with full, the tasks
where some digit's top-1 differs from full's, and the mean resident bytes.

usage: niah-answer-kl.py [--bin KV_BENCH] [--tasks FILE] [--range A-B] -P SPEC...
(run from the repository root; --range indexes the lines of --tasks)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--bin', default='bin/kv-bench')
    ap.add_argument('--tasks', default='tests/data/niah4k/tasks-dev.jsonl')
    ap.add_argument('--range', default='0-19')
    ap.add_argument('-P', dest='specs', action='append', required=True)
    a = ap.parse_args()
    lo, hi = map(int, a.range.split('-'))
    lines = open(a.tasks).read().splitlines()
    n4k = 'tests/data/niah4k'
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(lo, hi + 1):
            t = json.loads(lines[i])
            s, ans = t['input'], t['outputs'][0]
            ids = [1, ord(' ') + 3] + [b + 3 for b in (s + ans).encode()]
            tf = os.path.join(tmp, '%d.txt' % i)
            open(tf, 'w').write(' '.join(map(str, ids)))
            prefix = 2 + s.rfind('\nQuestion:')
            cmd = ['nice', '-n', '10', a.bin, 'fidelity', '-m', n4k + '/niah4k.bin', '--tokenizer',
                   n4k + '/tok259.bin', '--tokens', tf, '--prefix', str(prefix), '--per-position',
                   '--json', '--threads', '1', '-q']
            for p in a.specs:
                cmd += ['-P', p]
            d = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            for r in d['results']:
                kl, ag = r['kl'][-len(ans):], r['agree'][-len(ans):]
                res.setdefault(r['policy'], []).append((i, sum(kl) / len(kl), sum(ag), len(ag),
                                                        r['resident_bytes']))
    print('%-40s %9s %7s %10s  %s' % ('policy', 'answer KL', 'top-1', 'bytes', 'tasks with a digit apart'))
    for p, v in res.items():
        print('%-40s %9.4f %7.3f %10d  %s' % (p, sum(x[1] for x in v) / len(v),
              sum(x[2] for x in v) / sum(x[3] for x in v), sum(x[4] for x in v) // len(v),
              [x[0] for x in v if x[2] < x[3]]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
