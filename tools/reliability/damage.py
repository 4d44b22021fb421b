#!/usr/bin/python3
"""Damaged-input sweep of every parser the tools expose (issue 14).

Each parser gets valid seed inputs, and from them damaged ones: truncations,
single and multiple byte flips (biased to the first kilobyte, where headers
live), runs of 0x00/0xff, inserted and deleted bytes.  Every input goes to
the tool that reads it (by default the ASan+UBSan build, build/asan/bin),
under a timeout.  Per parser the script counts the inputs, the exit
statuses, crashes (death by a signal, or an exit status outside the
sysexits table the tools use), hangs (timeouts) and sanitizer reports (log
files: ASan and UBSan write to a directory, so a report cannot hide behind
an expected exit status).  It prints one JSON object and exits 1 if
anything crashed, hung or was reported.

  tools/reliability/damage.py [--bin DIR] [--scale F] [--jobs N] [--seed S]

--scale 1 is about 20,000 inputs (about 25 minutes on two cores).
"""
import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
S260 = os.path.join(ROOT, 'tests/data/stories260K')
MODEL = os.path.join(S260, 'stories260K.bin')
TOK = os.path.join(S260, 'tok512.bin')
OK_EXIT = {0, 64, 65, 66, 69, 73, 74}   # 70 (internal) is counted apart
TIMEOUT = 60


def damage(rng, b):
    """One damaged copy of bytes b."""
    b = bytearray(b)
    kind = rng.randrange(6)
    if not b or kind == 0:                           # truncation
        return bytes(b[:rng.randrange(len(b) + 1)])
    hot = min(len(b), 1024)
    def pos():
        return rng.randrange(hot) if rng.random() < 0.7 else rng.randrange(len(b))
    if kind == 1:                                     # one byte
        b[pos()] = rng.randrange(256)
    elif kind == 2:                                   # one bit
        i = pos()
        b[i] ^= 1 << rng.randrange(8)
    elif kind == 3:                                   # several bytes
        for _ in range(rng.randrange(2, 16)):
            b[pos()] = rng.randrange(256)
    elif kind == 4:                                   # a run of 00 or ff
        i, n = pos(), rng.randrange(1, 64)
        b[i:i + n] = bytes([rng.choice((0, 255))]) * len(b[i:i + n])
    else:                                             # insert or delete
        i = pos()
        if rng.random() < 0.5:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        else:
            del b[i:i + rng.randrange(1, 16)]
    return bytes(b)


def run(cmd, env, cwd):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=TIMEOUT)
        return p.returncode, p.stderr[-300:].decode('utf-8', 'replace'), time.time() - t0
    except subprocess.TimeoutExpired:
        return 'hang', '', time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--bin', default=os.path.join(ROOT, 'build/asan/bin'))
    ap.add_argument('--scale', type=float, default=1.0)
    ap.add_argument('--jobs', type=int, default=2)
    ap.add_argument('--seed', type=int, default=14)
    a = ap.parse_args()
    B = lambda t: os.path.join(a.bin, t)
    work = tempfile.mkdtemp(prefix='kv-damage.')
    san = os.path.join(work, 'san')
    os.mkdir(san)
    env = dict(os.environ, OMP_NUM_THREADS='1', NO_COLOR='1',
               ASAN_OPTIONS='detect_leaks=1:log_path=%s/asan' % san,
               UBSAN_OPTIONS='halt_on_error=1:print_stacktrace=1:log_path=%s/ubsan' % san)

    # seeds
    dump = os.path.join(work, 'dump.kvc')
    subprocess.run([B('kv-run'), '-m', MODEL, '--tokenizer', TOK, '-p', 'Once upon a time there was', '-n', '0',
                    '--dump-kv', dump], env=env, check=True, stderr=subprocess.DEVNULL)
    prof = os.path.join(work, 'profile.json')
    with open(prof, 'wb') as f:
        subprocess.run([B('kv-profile'), dump, '--json'], env=env, check=True, stdout=f, stderr=subprocess.DEVNULL)
    # the part kv-run --profile reads, so that damage lands in it
    deploy = json.dumps({'deploy': json.load(open(prof))['deploy']}).encode()
    tasks = os.path.join(work, 'tasks.jsonl')
    with open(tasks, 'w') as f:
        for i, (num, key) in enumerate([('1234567', 'cat'), ('7654321', 'dog')]):
            f.write(json.dumps({'index': i, 'input': 'The special magic number for %s is %s. Once upon a time.'
                                '\nQuestion: What is the special magic number for %s?\nAnswer: ' % (key, num, key),
                                'outputs': [num], 'length': 64}) + '\n')
    store = os.path.join(work, 'store')
    subprocess.run([B('kv-tree'), 'init', store], env=env, check=True)
    subprocess.run([B('kv-tree'), 'put', store, dump], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    chunk = os.path.join(store, 'chunks', sorted(os.listdir(os.path.join(store, 'chunks')))[0])
    kvc_seeds = [os.path.join(ROOT, 'tests/fuzz/corpus/kvc', n) for n in sorted(os.listdir(
        os.path.join(ROOT, 'tests/fuzz/corpus/kvc')))] + [dump]
    read = lambda p: open(p, 'rb').read()
    policies = ['full', 'quant:bits=2,group=32,residual=16', 'sparse:k=4,sink=2,window=8,select=exact',
                '0-1=full;2-4=sparse:topk_frac=0.25', 'streaming:sink=4,window=16', 'dsq:window=16,salient=0.2',
                '*=quant:bits=4;0=full:dtype=f16', 'sparse:c=4,k=8,reduce=max']

    # parser: (n inputs, seeds, command builder(path or text) -> argv, kind)
    P = {
        'kvc': (5000, [read(p) for p in kvc_seeds], lambda f: [B('kv-info'), '--json', f], 'file'),
        'gguf': (2500, [read(os.path.join(ROOT, 'tests/data/gguf/llama-2-tiny-random.gguf'))],
                 lambda f: [B('kv-run'), '-m', f, '-p', 'Once', '-n', '1', '--ctx', '32'], 'file'),
        'llama2c': (2000, [read(MODEL)], lambda f: [B('kv-run'), '-m', f, '--tokenizer', TOK, '-p', 'Once',
                                                   '-n', '1'], 'file'),
        'tokenizer': (2500, [read(TOK)], lambda f: [B('kv-run'), '-m', MODEL, '--tokenizer', f, '-p',
                                                   'Once upon a time', '-n', '1'], 'file'),
        'profile': (2000, [read(prof), deploy, deploy] + [read(os.path.join(ROOT, 'tests/fuzz/corpus/deploy', n)) for n in
                                          sorted(os.listdir(os.path.join(ROOT, 'tests/fuzz/corpus/deploy')))],
                    lambda f: [B('kv-run'), '-m', MODEL, '--tokenizer', TOK, '--profile', f, '-p', 'Once', '-n',
                               '1'], 'file'),
        'ruler-jsonl': (2000, [read(tasks)] + [read(os.path.join(ROOT, 'tests/fuzz/corpus/niah', n)) for n in
                                               sorted(os.listdir(os.path.join(ROOT, 'tests/fuzz/corpus/niah')))],
                        lambda f: [B('kv-bench'), 'ruler', '-m', MODEL, '-t', TOK, '--tasks', f, '--limit', '1',
                                   '--gen', '1', '--json'], 'file'),
        'policy-string': (2500, [p.encode() for p in policies],
                          lambda s: [B('kv-run'), '-m', MODEL, '--tokenizer', TOK, '--policy', s, '-p', 'Once',
                                     '-n', '1'], 'arg'),
        'tree-index': (1000, [read(os.path.join(store, 'index.json'))], None, 'index'),
        'tree-chunk': (500, [read(chunk)], None, 'chunk'),
    }
    rng = random.Random(a.seed)
    jobs = []
    for name, (n, seeds, cmd, kind) in P.items():
        for i in range(max(1, int(n * a.scale))):
            jobs.append((name, i, damage(rng, rng.choice(seeds)), cmd, kind))

    def one(job):
        name, i, data, cmd, kind = job
        d = os.path.join(work, 'in', name, str(i))
        os.makedirs(d)
        if kind == 'arg':
            s = data.replace(b'\0', b'').decode('utf-8', 'replace')
            argv = cmd(s)
        elif kind in ('index', 'chunk'):
            st = os.path.join(d, 'store')
            shutil.copytree(store, st)
            target = os.path.join(st, 'index.json') if kind == 'index' else \
                os.path.join(st, os.path.relpath(chunk, store))
            with open(target, 'wb') as f:
                f.write(data)
            argv = [B('kv-tree'), 'check', st]
        else:
            f = os.path.join(d, 'input')
            with open(f, 'wb') as fh:
                fh.write(data)
            argv = cmd(f)
        rc, err, dt = run(argv, env, d)
        shutil.rmtree(d, ignore_errors=True)
        return name, rc, err, dt, argv

    res = {n: {'inputs': 0, 'exit': {}, 'crashes': 0, 'hangs': 0, 'internal': 0, 'seconds': 0.0} for n in P}
    examples = []
    t0 = time.time()
    with cf.ThreadPoolExecutor(max_workers=a.jobs) as ex:
        for name, rc, err, dt, argv in ex.map(one, jobs):
            r = res[name]
            r['inputs'] += 1
            r['seconds'] += dt
            key = str(rc)
            r['exit'][key] = r['exit'].get(key, 0) + 1
            if rc == 'hang':
                r['hangs'] += 1
            elif rc == 70:
                r['internal'] += 1
            elif rc not in OK_EXIT:
                r['crashes'] += 1
                if len(examples) < 10:
                    examples.append({'parser': name, 'exit': rc, 'stderr': err})
    reports = sorted(os.listdir(san))
    for r in res.values():
        r['seconds'] = round(r['seconds'], 1)
    out = {'bin': a.bin, 'seed': a.seed, 'scale': a.scale, 'inputs': sum(r['inputs'] for r in res.values()),
           'crashes': sum(r['crashes'] for r in res.values()), 'hangs': sum(r['hangs'] for r in res.values()),
           'internal': sum(r['internal'] for r in res.values()), 'sanitizer_reports': len(reports),
           'wall_seconds': round(time.time() - t0, 1), 'parsers': res, 'examples': examples}
    if reports:
        out['report_heads'] = [open(os.path.join(san, x), errors='replace').read()[:600] for x in reports[:5]]
    json.dump(out, sys.stdout, indent=1)
    print()
    shutil.rmtree(work, ignore_errors=True)
    return 1 if out['crashes'] or out['hangs'] or reports else 0


if __name__ == '__main__':
    sys.exit(main())
