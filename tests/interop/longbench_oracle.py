#!/usr/bin/python3
"""Check `kv-bench score --longbench` against LongBench's own eval.py.

Not part of `make check`: it needs the official code, which is not
vendored here.  Point it at checkouts of THUDM/LongBench, pltrdy/rouge
(the `rouge` package) and seatgeek/fuzzywuzzy (without python-Levenshtein,
as LongBench's requirements install it); jieba comes from python3-jieba.

  tests/interop/longbench_oracle.py --longbench L --rouge R --fuzzywuzzy F \\
      [--seeds 1-5] [--lines 300] [--kv-bench bin/kv-bench]

For each seed it writes random prediction files for all 21 datasets
(English, Chinese and code text from jieba's dictionary, punctuation,
newlines, empty predictions and answers, several answers, classes,
paragraph numbers), runs eval.py (and eval.py --e) on them, and compares
every dataset score and every per-sample score with kv-bench's.  Exit 0
when all agree; the last line counts the comparisons and the differences.
"""
import argparse, json, os, random, shutil, subprocess, sys, tempfile

DATASETS = {"narrativeqa": "en", "qasper": "en", "multifieldqa_en": "en", "multifieldqa_zh": "zh",
            "hotpotqa": "en", "2wikimqa": "en", "musique": "en", "dureader": "zh", "gov_report": "en",
            "qmsum": "en", "multi_news": "en", "vcsum": "zh", "trec": "en", "triviaqa": "en",
            "samsum": "en", "lsht": "zh", "passage_retrieval_en": "en", "passage_count": "en",
            "passage_retrieval_zh": "zh", "lcc": "code", "repobench-p": "code"}
EN = ("the a an The A An THE cat sat on mat dog Paris is in France answer yes no unanswerable "
      "Mr. Smith's 1999 two-thirds co-op ΣΟΦΟΣ ὈΔΥΣΣΕΥΣ İstanbul naïve café ＡＢＣ １２ ٣ x_y").split()
PUNCT = list(".,;:!?'\"()-") + ["...", " . ", "\n", "\n\n", "\t", "  ", "\u3000", "\xa0"]
ZHP = list("，。！？、；：“”‘’（）《》【】…—·")
CLS_EN = ["Abbreviation", "Entity", "Description", "Human", "Location", "Numeric value", "Human being"]
CLS_ZH = ["农业、农村", "军事", "文学、艺术", "体育", "体育竞技"]
CODE = ["x = 1", "# comment", "// c", "`code`", "def f(a, b):", "    return a + b", "}", ""]


def gen(rnd, out, n, zh):
    def en_text(k):
        return "".join(rnd.choice([rnd.choice(EN) + " ", rnd.choice(PUNCT), rnd.choice(EN)]) for _ in range(k))

    def zh_text(k):
        return "".join(rnd.choice([rnd.choice(zh), rnd.choice(ZHP), chr(rnd.randint(0x4e00, 0x9fd5)),
                                   rnd.choice(EN) + " ", " ", "\n"]) for _ in range(k))

    def text(lang):
        k = rnd.choice([0, 1, 2, 5, 20, 60])
        t = en_text(k) if lang == "en" else zh_text(k)
        return ("\n" + t) if rnd.random() < 0.1 else t

    for name, lang in DATASETS.items():
        with open(os.path.join(out, name + ".jsonl"), "w", encoding="utf-8") as f:
            for _ in range(n):
                ac = None
                if name in ("trec", "lsht"):
                    ac = CLS_EN if name == "trec" else CLS_ZH
                    ans = [rnd.choice(ac)]
                    pred = (" " if name == "trec" else "").join(rnd.sample(ac, rnd.randint(0, 3))) + rnd.choice(["", "\nmore"])
                elif name == "passage_retrieval_en":
                    ans = ["Paragraph %d" % rnd.randint(1, 30)]
                    pred = rnd.choice(["Paragraph %d" % rnd.randint(1, 30), "Paragraph 3 and 4", "none", en_text(5)])
                elif name == "passage_retrieval_zh":
                    ans = ["段落%d" % rnd.randint(1, 30)]
                    pred = rnd.choice(["段落%d" % rnd.randint(1, 30), "段落3和段落4", zh_text(5)])
                elif name == "passage_count":
                    ans = [str(rnd.randint(1, 20))]
                    pred = rnd.choice([str(rnd.randint(1, 20)), "5 or 6 passages", "", en_text(4)])
                elif lang == "code":
                    ans = [rnd.choice(CODE)]
                    pred = "\n".join(rnd.choice(CODE) for _ in range(rnd.randint(0, 4)))
                else:
                    ans = [text(lang) for _ in range(rnd.randint(0, 3))]
                    pred = ans[0] if ans and rnd.random() < 0.15 else text(lang)
                f.write(json.dumps({"pred": pred, "answers": ans, "all_classes": ac,
                                    "length": rnd.choice([100, 3999, 4000, 7999, 8000, 20000])},
                                   ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--longbench", required=True)
    ap.add_argument("--rouge", required=True)
    ap.add_argument("--fuzzywuzzy", required=True)
    ap.add_argument("--seeds", default="1-3")
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--kv-bench", default="bin/kv-bench")
    a = ap.parse_args()
    lb = os.path.join(a.longbench, "LongBench")
    sys.path[:0] = [a.rouge, a.fuzzywuzzy, lb]
    import warnings
    warnings.filterwarnings("ignore")
    import logging
    import jieba
    jieba.setLogLevel(logging.ERROR)
    src = open(os.path.join(lb, "eval.py"), encoding="utf-8").read().split("if __name__ == '__main__':")[0]
    ev = {}
    exec(compile(src, "eval.py", "exec"), ev)
    zh = [l.split(" ")[0] for l in open(os.path.join(os.path.dirname(jieba.__file__), "dict.txt"), encoding="utf-8")][:60000]
    lo, hi = (int(x) for x in a.seeds.split("-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([a.rouge, a.fuzzywuzzy, lb]))
    compared = diffs = 0
    for seed in range(lo, hi + 1):
        work = tempfile.mkdtemp()
        try:
            for sub in ("pred/m", "pred_e/m"):
                os.makedirs(os.path.join(work, sub))
            gen(random.Random(seed), os.path.join(work, "pred/m"), a.lines, zh)
            for f in os.listdir(os.path.join(work, "pred/m")):
                shutil.copy(os.path.join(work, "pred/m", f), os.path.join(work, "pred_e/m", f))
            for e in (False, True):
                subprocess.run([sys.executable, "-W", "ignore", os.path.join(lb, "eval.py"), "--model", "m"] +
                               (["--e"] if e else []), cwd=work, env=env, check=True, capture_output=True)
                ref = json.load(open(os.path.join(work, "pred_e/m" if e else "pred/m", "result.json")))
                out = subprocess.run([a.kv_bench, "score", "--longbench", "--json", "--per-sample"] + (["--e"] if e else []) +
                                     [os.path.join(work, "pred/m")], check=True, capture_output=True, text=True).stdout
                ours = json.loads(out)
                for k, v in ref.items():
                    o = ours["datasets"][k]
                    pairs = v.items() if e else [("", v)]
                    for b, x in pairs:
                        y = o[b] if e else o
                        compared += 1
                        if not ((x != x and y is None) or x == y):
                            diffs += 1
                            print("seed %d %s %s: eval.py %r, kv-bench %r" % (seed, k, b, x, y))
                if e:
                    continue
                for k, samples in ours["per_sample"].items():
                    lines = [json.loads(l) for l in open(os.path.join(work, "pred/m", k + ".jsonl"), encoding="utf-8")]
                    ac = lines[-1]["all_classes"]
                    for i, l in enumerate(lines):
                        p = l["pred"]
                        if k in ("trec", "triviaqa", "samsum", "lsht"):
                            p = p.lstrip("\n").split("\n")[0]
                        s = 0.
                        for g in l["answers"]:
                            s = max(s, ev["dataset2metric"][k](p, g, all_classes=ac))
                        compared += 1
                        if s != samples[i]:
                            diffs += 1
                            print("seed %d %s line %d: eval.py %r, kv-bench %r" % (seed, k, i + 1, s, samples[i]))
        finally:
            shutil.rmtree(work)
    print("%d comparisons, %d differences" % (compared, diffs))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
