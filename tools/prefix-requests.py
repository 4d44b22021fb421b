#!/usr/bin/env python3
"""Requests that share long prefixes, for kv-bench prefix (one JSON object a line).

niah:      N different questions on one needle haystack: the haystack of a
           RULER-format task file (tests/data/niah4k/tasks-dev.jsonl) with K
           needles planted, the same for every request, then a per-request
           tail of haystack sentences (--tail, a share of the prompt) and the
           question about one needle; "outputs" holds its answer.  With the
           default --tail 0.1 about 90% of each prompt is shared.
synthetic: token-id requests of --length tokens: BOS, a random prefix of
           --shared of the length common to all, and a random rest per request.

  tools/prefix-requests.py niah --tasks tests/data/niah4k/tasks-dev.jsonl --length 1024 -n 8 > req.jsonl
  tools/prefix-requests.py synthetic --vocab 128256 --length 32768 --shared 0.9 -n 4 > req.jsonl
"""
import argparse, json, random, re, sys

NEEDLE = "The special magic number for {k} is {v}. "
QUESTION = "\nQuestion: What is the special magic number for {k}?\nAnswer: "


def niah(a):
    tasks = [json.loads(l) for l in open(a.tasks) if l.strip()]
    t = min((t for t in tasks if t.get("length", 0) >= a.length), key=lambda t: t["length"], default=tasks[-1])
    hay = t["input"].split("\nQuestion:")[0]
    hay = re.sub(r"The special magic number for [^.]*? is \d+\. ", "", hay)
    sents = [s.strip() + "." for s in hay.split(".") if len(s.strip()) > 3]
    rnd = random.Random(a.seed)
    # keys as the training data has them: single words, taken from the task file's own needles
    pool = sorted({k for x in tasks for k in re.findall(r"The special magic number for (\w+) is", x["input"])})
    keys = rnd.sample(pool, a.needles)
    vals = ["%07d" % rnd.randrange(10 ** 7) for _ in keys]
    # the shared haystack: (1 - tail) of the budget, needles at random depths
    budget = int(a.length * (1 - a.tail))
    shared, i = [], 0
    while len(" ".join(shared)) < budget - len(keys) * 60:
        shared.append(sents[i % len(sents)]); i += 1
    for k, v in zip(keys, vals):
        shared.insert(rnd.randrange(len(shared) + 1), NEEDLE.format(k=k, v=v).strip())
    shared = " ".join(shared) + " "
    for r in range(a.n):
        tail, j = [], rnd.randrange(len(sents))
        while len(" ".join(tail)) < a.length * a.tail:
            tail.append(sents[j % len(sents)]); j += 1
        k = r % len(keys)
        print(json.dumps({"id": r, "input": shared + " ".join(tail) + QUESTION.format(k=keys[k]),
                          "outputs": [vals[k]]}))


def synthetic(a):
    rnd = random.Random(a.seed)
    shared = [rnd.randrange(3, a.vocab) for _ in range(int(a.length * a.shared) - 1)]
    for r in range(a.n):
        rest = [rnd.randrange(3, a.vocab) for _ in range(a.length - 1 - len(shared))]
        print(json.dumps({"id": r, "tokens": [1] + shared + rest}, separators=(",", ":")))


p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
sub = p.add_subparsers(dest="kind", required=True)
q = sub.add_parser("niah")
q.add_argument("--tasks", required=True)
q.add_argument("--length", type=int, default=1024, help="prompt length in bytes/tokens (byte-level vocabularies)")
q.add_argument("--needles", type=int, default=4)
q.add_argument("--tail", type=float, default=0.1)
q.add_argument("-n", type=int, default=8)
q.add_argument("--seed", type=int, default=1)
s = sub.add_parser("synthetic")
s.add_argument("--vocab", type=int, default=128256)
s.add_argument("--length", type=int, default=32768)
s.add_argument("--shared", type=float, default=0.9)
s.add_argument("-n", type=int, default=4)
s.add_argument("--seed", type=int, default=1)
a = p.parse_args()
niah(a) if a.kind == "niah" else synthetic(a)
