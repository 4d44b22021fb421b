#!/usr/bin/env node
// Cross-check kv-run against llama.cpp itself (through the npm package
// node-llama-cpp, a prebuilt llama.cpp): the same GGUF files through both,
// comparing
//   1. tokenization ids: llama.cpp's test vectors, multilingual text, digits,
//      whitespace runs, contractions, emoji, special tokens (--special);
//   2. greedy continuations (token ids) and the next-token probabilities at
//      every prompt position (kv-run --probs against controlledEvaluate with
//      probabilities), for GGUF versions of the bundled models in every
//      weight type kv-convert writes, a qwen2-architecture file with q/k/v
//      biases and a Llama-3.1 rope_freqs file; llama.cpp evaluates the prompt
//      twice, in one batch (its default, the reference) and one token per
//      batch (batchSize 1: its plain per-row kernels instead of the batched
//      GEMMs), and the distance between its own two answers is printed
//      beside kv-run's, as the floor below which a comparison with it
//      cannot go (--no-self skips the second evaluation); greedy
//      continuations come from both llama.cpp paths and kv-run, each pair
//      compared, with every path's top 3 where a pair parts;
//   3. with --bench, CPU decode speed on the same GGUF at the same thread
//      count (both measured in this run, alternating), and kv-run's peak
//      resident memory against the file size.
// Not part of `make check` (it needs node and the package).
//
//   mkdir -p /work/peer/nlc && (cd /work/peer/nlc && npm i -E node-llama-cpp@3.21.1)
//   make && node tools/crosscheck-llamacpp.mjs --nlc /work/peer/nlc [--threads 2] [--bench] [--big]
//
// --bench-only skips the checks; --reps N sets the big model's repetitions;
// --only SUBSTRING runs only the models whose label contains it;
// --long-story gives the stories260K models a 253-token prompt instead of
// the 20-token one (differences that start past position 20 show there).
// --steps N generates N greedy tokens per model (default 40 for the
// stories260K-sized models, 12 for niah4k).
// --summary FILE writes every model's figures as JSON (positions within the
// tolerance against each llama.cpp path, the step where each pair of greedy
// continuations parts, -1 for identical).
// --big also converts a synthetic Llama-3.2-1B geometry (random weights,
// the Llama-3 vocabulary) to Q4_K and benchmarks decode on it.  The exit
// status is 0 when every comparison meets its target, 1 otherwise.
import { spawnSync, spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const args = process.argv.slice(2);
const opt = (name, def) => {
    const i = args.indexOf(name);
    return i >= 0 && i + 1 < args.length ? args[i + 1] : def;
};
const flag = (name) => args.includes(name);
const ROOT = path.resolve(path.dirname(new URL(import.meta.url).pathname), '..');
const BIN = path.resolve(opt('--bin', path.join(ROOT, 'bin')));
const NLC = path.resolve(opt('--nlc', process.cwd()));
const THREADS = parseInt(opt('--threads', '2'), 10);
const WORK = opt('--work', fs.mkdtempSync(path.join(os.tmpdir(), 'kv-crosscheck-')));
const PROB_TOL = 1e-3;
const DATA = path.join(ROOT, 'tests', 'data');
fs.mkdirSync(WORK, { recursive: true });

const { getLlama } = await import(pathToFileURL(path.join(NLC, 'node_modules', 'node-llama-cpp', 'dist', 'index.js')).href);
const llama = await getLlama({ gpu: false, build: 'never', logLevel: 'error' });

let failures = 0;
const log = (...a) => console.log(...a);
const fail = (...a) => { failures++; console.log('FAIL', ...a); };

function run(bin, argv, input) {
    const r = spawnSync(path.join(BIN, bin), argv, { input, maxBuffer: 1 << 28, encoding: 'utf8' });
    if (r.status !== 0) throw new Error(`${bin} ${argv.join(' ')}: exit ${r.status}: ${r.stderr}`);
    return r.stdout;
}

// --- 1. tokenization -------------------------------------------------------------

function vectors(inp) {
    return fs.readFileSync(inp, 'utf8').split('\n__ggml_vocab_test__\n').slice(0, -1);
}

const EXTRA = [
    'Hello, y\'all! How are you? I\'m fine; we\'ve been told they\'d ARE\'NT. DON\'T \'S \'ll',
    'Ünïcödé façade naïve café — “quotes” ‘single’ … ½ ¾ ² ³',
    'Привет, как дела? Съешь же ещё этих мягких французских булок.',
    'Γειά σου Κόσμε· ελληνικά κείμενα με τόνους.',
    '日本語のテキスト、漢字とひらがなとカタカナ。中文文本：你好，世界！한국어 텍스트입니다.',
    'العربية: مرحبا بالعالم. עברית: שלום עולם. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก',
    '0 1 12 123 1234 12345 123456 1234567 3.14159 1,000,000 2024-11-29 0x1F ٣٤٥ ૧૨૩ Ⅻ ①②',
    'tabs\tand\t\ttabs   spaces    and\nnewlines\n\n\r\n\r\rmixed \n \t \u00a0nbsp\u2003em\u3000ideographic',
    '      leading spaces',
    'trailing spaces      ',
    '😀😃😄😁 👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇺🇳 ❤️ 🦙🦙🦙',
    'code: for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; } // done\n    return x;',
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    'MiXeD CaSe WoRdS aNd ALLCAPS lowercase',
    '!!!???...,,,;;;:::---___===+++***&&&%%%$$$###@@@',
    'a\u0301 e\u0308 combining marks, ﬁ ligature, ｆｕｌｌｗｉｄｔｈ',
];
const SPECIAL = [
    '<|begin_of_text|>Hello<|eot_id|>',
    '<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
    'text <|reserved_special_token_5|> more<|end_of_text|>',
    '<s> sentencepiece </s> control',
];

async function checkTokenizer(label, gguf, texts, specialTexts) {
    const model = await llama.loadModel({ modelPath: gguf, vocabOnly: true });
    const bos = model.tokens.bos, addsBos = model.tokens.shouldPrependBosToken;
    let n = 0, bad = 0;
    const one = (text, special) => {
        const ref = Array.from(model.tokenize(text, special));
        const argv = ['-m', gguf, '--tokenize', '--prompt-file', '-'];
        if (special) argv.push('--special');
        let ids = JSON.parse(run('kv-run', argv, text));
        if (addsBos && ids[0] === bos) ids = ids.slice(1); // kv-run adds BOS as the file says; tokenize() does not
        n++;
        if (JSON.stringify(ids) !== JSON.stringify(ref)) {
            bad++;
            fail(`${label}: ${JSON.stringify(text).slice(0, 60)}${special ? ' (special)' : ''}: kv-run ${JSON.stringify(ids).slice(0, 80)} llama.cpp ${JSON.stringify(ref).slice(0, 80)}`);
        }
    };
    for (const t of texts) one(t, false);
    for (const t of specialTexts) one(t, true);
    log(`tokenize ${label}: ${n - bad}/${n} identical`);
    await model.dispose();
}

// --- 2. models -----------------------------------------------------------------------

function convert(name, argv) {
    const out = path.join(WORK, name + '.gguf');
    if (!fs.existsSync(out)) spawnSync(path.join(BIN, 'kv-convert'), [...argv, '-q', '-o', out], { stdio: 'inherit' });
    if (!fs.existsSync(out)) throw new Error(`kv-convert did not write ${out}`);
    return out;
}

// Per position, the largest |p - q| over the union of both top-8 lists
// (a and b: arrays of Map id -> probability, best first).
function topDistance(a, b) {
    const per = [];
    for (let i = 0; i < a.length; i++) {
        let w = 0;
        for (const [id, p] of [...a[i].entries()].slice(0, 8)) w = Math.max(w, Math.abs(p - (b[i].get(id) ?? 0)));
        for (const [id, p] of [...b[i].entries()].slice(0, 8)) w = Math.max(w, Math.abs(p - (a[i].get(id) ?? 0)));
        per.push(w);
    }
    return per;
}

const spread = (per) => `max ${Math.max(...per).toExponential(1)}, ${per.filter((x) => x <= PROB_TOL).length}/${per.length} within ${PROB_TOL}`;

const ONLY = opt('--only', '');
const LONG_STORY = 'Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. ' +
    'One day, she saw a big, red ball in the park. She ran to the ball and kicked it very hard. The ball went up ' +
    'high into the sky and landed in a tree. Lily was sad because she could not reach the ball. Then her friend ' +
    'Tom came by. Tom was tall and strong. He climbed the tree and got the ball for Lily. Lily was so happy that ' +
    'she gave Tom a big hug. They played with the ball together all day long. When the sun went down, they went ' +
    'home and had dinner with their families. Lily told her mom about her fun day, and her mom smiled.\n';

// The first step where two greedy continuations part (-1: identical, a
// shorter one included that stopped where the longer one has a token that
// ends generation: llama.cpp's end-of-generation tokens, or BOS, at which
// kv-run stops as llama2.c's run.c does and llama.cpp does not).
function parting(a, b, isEog) {
    for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) return i;
    if (a.length === b.length) return -1;
    const [short, long] = a.length < b.length ? [a, b] : [b, a];
    return isEog(long[short.length]) ? -1 : short.length;
}

async function greedy(seq, prompt, steps) {
    await seq.clearHistory();
    const ids = [];
    for await (const t of seq.evaluate(prompt, { temperature: 0 })) {
        ids.push(t);
        if (ids.length >= steps) break;
    }
    return ids;
}

// The top 3 of the next token after prefix, teacher-forced, from a llama.cpp
// sequence (its context's batch size picks the path) or from kv-run.
async function top3Llama(seq, prefix) {
    await seq.clearHistory();
    const r = await seq.controlledEvaluate(prefix.map((t, i) => (i + 1 < prefix.length ? t : [t, { generateNext: { probabilities: true } }])));
    return [...(r[prefix.length - 1]?.next?.probabilities ?? new Map()).entries()].slice(0, 3);
}
const top3Kv = (gguf, prefix) => JSON.parse(run('kv-run', ['-m', gguf, '--tokens', '-', '--probs', '3', '-T', String(THREADS)],
                                                JSON.stringify(prefix)))[prefix.length - 1].top;
const fmt3 = (a) => a.map(([id, p]) => `${id}:${p.toFixed(4)}`).join(' ');

const summary = [];

async function checkModel(label, gguf, promptText, defaultSteps) {
    if (ONLY && !label.includes(ONLY)) return;
    const steps = parseInt(opt('--steps', String(defaultSteps)), 10);
    const model = await llama.loadModel({ modelPath: gguf });
    const ctxOpts = {
        contextSize: 1024, threads: THREADS, flashAttention: false,
        experimentalKvCacheKeyType: 'F32', experimentalKvCacheValueType: 'F32',
    };
    const ctx = await model.createContext({ ...ctxOpts, batchSize: 1024 });
    // llama.cpp's per-token path: every batch one token (its plain one-row kernels)
    const ctx1 = flag('--no-self') ? null : await model.createContext({ ...ctxOpts, batchSize: 1 });
    const prompt = Array.from(model.tokenize(promptText, false));
    if (model.tokens.bos != null && model.tokens.shouldPrependBosToken) prompt.unshift(model.tokens.bos);
    // probabilities at every prompt position
    const seq = ctx.getSequence();
    const seq1 = ctx1?.getSequence();
    const evalAll = (s) => s.controlledEvaluate(prompt.map((t) => [t, { generateNext: { probabilities: true } }]));
    const res = await evalAll(seq);
    const kv = JSON.parse(run('kv-run', ['-m', gguf, '--tokens', '-', '--probs', '8', '-T', String(THREADS)],
                              JSON.stringify(prompt)));
    const rec = { label, positions: prompt.length, steps };
    // llama.cpp against itself: the same prompt one token per batch
    let self = '';
    if (seq1) {
        const one = (await evalAll(seq1)).map((r) => r?.next?.probabilities ?? new Map());
        const batched = res.map((r) => r?.next?.probabilities ?? new Map());
        const selfPer = topDistance(batched, one), kvOnePer = topDistance(kv.map((o) => new Map(o.top)), one);
        const within = (per) => per.filter((x) => x <= PROB_TOL).length;
        Object.assign(rec, { self_max: Math.max(...selfPer), self_within: within(selfPer),
                             kv_pertoken_max: Math.max(...kvOnePer), kv_pertoken_within: within(kvOnePer) });
        self = `; llama.cpp batched vs per-token ${spread(selfPer)}, kv-run vs llama.cpp per-token ${spread(kvOnePer)}`;
    }
    let worst = 0, worstAt = '', within = 0, firstOver = -1;
    const perPos = [];
    for (let i = 0; i < prompt.length; i++) {
        let w = 0;
        const ref = res[i]?.next?.probabilities;
        if (!ref) { fail(`${label}: llama.cpp gave no probabilities at ${i}`); break; }
        const refTop = [...ref.entries()].slice(0, 8);
        const kvTop = new Map(kv[i].top);
        for (const [id, p] of kv[i].top) {
            const d = Math.abs(p - (ref.get(id) ?? 0));
            w = Math.max(w, d);
            if (d > worst) { worst = d; worstAt = `pos ${i} token ${id}`; }
        }
        for (const [id, p] of refTop) {
            const d = Math.abs(p - (kvTop.get(id) ?? 0));
            w = Math.max(w, d);
            if (d > worst) { worst = d; worstAt = `pos ${i} token ${id}`; }
        }
        perPos.push(w);
        if (w <= PROB_TOL) within++;
        else if (firstOver < 0) firstOver = i;
    }
    const sorted = [...perPos].sort((a, b) => a - b);
    const median = sorted[Math.floor(sorted.length / 2)];
    Object.assign(rec, { max: worst, median, within, first_over: firstOver });
    // greedy continuations: llama.cpp batched (the reference), llama.cpp
    // per-token (the prompt one token per batch; generated tokens are one per
    // batch on both paths), kv-run
    const isEog = (t) => !!model.isEogToken?.(t) || t === model.tokens.bos;
    const ref = await greedy(seq, prompt, steps);
    const ref1 = seq1 ? await greedy(seq1, prompt, steps) : null;
    const out = run('kv-run', ['-m', gguf, '--tokens', '-', '-n', String(steps), '--temp', '0', '--print-ids',
                               '-T', String(THREADS)], JSON.stringify(prompt));
    const ids = out.trim() ? out.trim().split(/\s+/).map(Number) : [];
    const pairs = [['kv-run vs llama.cpp batched', ids, ref], ['kv-run vs llama.cpp per-token', ids, ref1],
                   ['llama.cpp batched vs per-token', ref, ref1]].filter(([, a, b]) => a && b);
    let greedyText = '';
    rec.greedy = {};
    for (const [name, a, b] of pairs) {
        const at = parting(a, b, isEog);
        rec.greedy[name] = at;
        greedyText += `; greedy ${name}: ${a.length}/${b.length} tokens ${at < 0 ? 'identical' : 'differ from step ' + at}`;
        // where they part: each path's top 3 teacher-forced on the shared prefix
        if (at >= 0 && at < Math.max(a.length, b.length)) {
            const prefix = [...prompt, ...a.slice(0, at)];
            const tops = [['llama.cpp batched', fmt3(await top3Llama(seq, prefix))]];
            if (seq1) tops.push(['per-token', fmt3(await top3Llama(seq1, prefix))]);
            tops.push(['kv-run', fmt3(top3Kv(gguf, prefix))]);
            greedyText += ` (at that step ${tops.map(([n, t]) => n + ' ' + t).join(', ')})`;
        }
    }
    const ok = worst <= PROB_TOL && rec.greedy['kv-run vs llama.cpp batched'] < 0;
    log(`model ${label}: ${prompt.length} positions, top-8 max |dp| ${worst.toExponential(2)} (${worstAt}), ` +
        `median ${median.toExponential(1)}, first 3 positions ${perPos.slice(0, 3).map((x) => x.toExponential(1)).join(' ')}, ` +
        `${within}/${prompt.length} positions within ${PROB_TOL}` +
        `${firstOver >= 0 ? ' (first beyond: ' + firstOver + ')' : ''}${self}${greedyText} ${ok ? 'ok' : ''}`);
    if (!ok) fail(`${label}: probabilities ${worst} > ${PROB_TOL} or greedy differs`);
    summary.push(rec);
    if (ctx1) await ctx1.dispose();
    await ctx.dispose();
    await model.dispose();
}

// --- 3. speed and memory --------------------------------------------------------------

function peakRss(bin, argv) {
    return new Promise((resolve) => {
        const p = spawn(path.join(BIN, bin), argv, { stdio: ['ignore', 'pipe', 'pipe'] });
        let out = '', peak = 0;
        p.stdout.on('data', (d) => { out += d; });
        const timer = setInterval(() => {
            try {
                const s = fs.readFileSync(`/proc/${p.pid}/status`, 'utf8');
                const m = /VmHWM:\s+(\d+) kB/.exec(s);
                if (m) peak = Math.max(peak, parseInt(m[1], 10) * 1024);
            } catch { /* exited */ }
        }, 20);
        p.on('close', () => { clearInterval(timer); resolve({ out, peak }); });
    });
}

async function bench(label, gguf, steps, reps) {
    const model = await llama.loadModel({ modelPath: gguf });
    const ctx = await model.createContext({ contextSize: 512, batchSize: 512, threads: THREADS, flashAttention: false });
    const prompt = [model.tokens.bos ?? 1];
    const lc = [], kr = [];
    let rss = 0;
    const seq = ctx.getSequence();
    for (let r = 0; r < reps; r++) {
        await seq.clearHistory();
        let n = 0, t0 = 0;
        for await (const t of seq.evaluate(prompt, { temperature: 0, yieldEogToken: true })) {
            void t;
            if (n === 0) t0 = performance.now(); // after the first token: decode steps only
            if (++n > steps) break;
        }
        lc.push(steps / ((performance.now() - t0) / 1000));
        const { out, peak } = await peakRss('kv-run', ['-m', gguf, '--random-prompt', '1', '-n', String(steps + 1),
            '--temp', '0', '--ctx', '512', '-T', String(THREADS), '--report', '-']);
        kr.push(JSON.parse(out).tokens_per_s);
        rss = Math.max(rss, peak);
    }
    const med = (a) => [...a].sort((x, y) => x - y)[Math.floor(a.length / 2)];
    const size = fs.statSync(gguf).size;
    const ratio = med(kr) / med(lc);
    log(`bench ${label} (${(size / 1e6).toFixed(1)} MB, ${THREADS} threads, ${steps} decode steps, median of ${reps}): ` +
        `kv-run ${med(kr).toFixed(1)} tok/s, llama.cpp ${med(lc).toFixed(1)} tok/s, ratio ${ratio.toFixed(2)}; ` +
        `kv-run peak RSS ${(rss / 1e6).toFixed(1)} MB = ${(100 * rss / size).toFixed(0)}% of the file`);
    log(`  kv-run runs: ${kr.map((x) => x.toFixed(1)).join(' ')}; llama.cpp runs: ${lc.map((x) => x.toFixed(1)).join(' ')}`);
    await ctx.dispose();
    await model.dispose();
    return { ratio, rss, size };
}

// --- main --------------------------------------------------------------------------------

log(`crosscheck: kv-run ${BIN}, llama.cpp via node-llama-cpp ${NLC}, ${THREADS} threads, work ${WORK}`);
log(`date ${new Date().toISOString()}, ${os.cpus()[0].model}, ${os.cpus().length} cpus`);

const l3 = path.join(DATA, 'gguf', 'llama3-vocab.gguf');
const spm = path.join(DATA, 'gguf', 'ggml-vocab-llama-spm.gguf');
const st = ['-m', path.join(DATA, 'stories260K', 'stories260K.bin'), '--tokenizer', path.join(DATA, 'stories260K', 'tok512.bin')];
const ni = ['-m', path.join(DATA, 'niah4k', 'niah4k.bin'), '--tokenizer', path.join(DATA, 'niah4k', 'tok259.bin')];
if (!flag('--bench-only')) {
await checkTokenizer('llama-bpe (Llama-3)', l3,
                     [...vectors(path.join(DATA, 'gguf', 'ggml-vocab-llama-bpe.gguf.inp')), ...EXTRA], SPECIAL);
await checkTokenizer('llama-spm (Llama-2)', spm,
                     [...vectors(path.join(DATA, 'gguf', 'ggml-vocab-llama-spm.gguf.inp')), ...EXTRA], SPECIAL);

const storyPrompt = flag('--long-story') ? LONG_STORY : 'Once upon a time, there was a little girl named Lily. She loved to';
const niahTask = JSON.parse(fs.readFileSync(path.join(DATA, 'niah4k', 'tasks-dev.jsonl'), 'utf8').split('\n')[0]);
const niahPrompt = niahTask.input.slice(-700);
await checkTokenizer('stories260K vocabulary', convert('stories260K-F32', [...st, '--type', 'F32']), EXTRA, SPECIAL);
for (const t of ['F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1'])
    await checkModel(`stories260K ${t}`, convert(`stories260K-${t}`, [...st, '--type', t]), storyPrompt, 40);
for (const t of ['F16', 'Q8_0', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q2_K', 'Q3_K', 'Q4_K', 'Q5_K', 'Q6_K'])
    await checkModel(`niah4k ${t}`, convert(`niah4k-${t}`, [...ni, '--type', t]), niahPrompt, 12);
await checkModel('stories260K qwen2 + q/k/v biases F32', convert('stories260K-qwen2-F32', [...st, '--type', 'F32', '--arch', 'qwen2', '--qkv-bias', '7']), storyPrompt, 40);
await checkModel('stories260K qwen2 + biases Q8_0', convert('stories260K-qwen2-Q8_0', [...st, '--type', 'Q8_0', '--arch', 'qwen2', '--qkv-bias', '7']), storyPrompt, 40);
await checkModel('niah4k qwen2 + biases Q4_K', convert('niah4k-qwen2-Q4_K', [...ni, '--type', 'Q4_K', '--arch', 'qwen2', '--qkv-bias', '7']), niahPrompt, 12);
await checkModel('synthetic tiny-wide-heads (head_dim 64 x 4 heads on dim 128) F32',
                 convert('tiny-wide-heads-F32', ['--synthetic', 'tiny-wide-heads', '--tokenizer', path.join(DATA, 'stories260K', 'tok512.bin'), '--type', 'F32']), storyPrompt, 40);
await checkModel('synthetic tiny-wide-heads Q8_0',
                 convert('tiny-wide-heads-Q8_0', ['--synthetic', 'tiny-wide-heads', '--tokenizer', path.join(DATA, 'stories260K', 'tok512.bin'), '--type', 'Q8_0']), storyPrompt, 40);
await checkModel('stories260K Llama-3.1 rope_freqs F32', convert('stories260K-rope31-F32', [...st, '--type', 'F32', '--rope-freqs', 'llama3:8,1,4,512']), storyPrompt, 40);
await checkModel('niah4k Llama-3.1 rope_freqs theta 5e5 Q6_K', convert('niah4k-rope31-Q6_K', [...ni, '--type', 'Q6_K', '--rope-theta', '500000', '--rope-freqs', 'llama3:8,1,4,1024']), niahPrompt, 12);

}

if (flag('--bench') || flag('--bench-only')) {
    await bench('niah4k Q4_K', convert('niah4k-Q4_K', [...ni, '--type', 'Q4_K']), 64, 5);
    if (flag('--big')) {
        const big = convert('synthetic-llama-3.2-1b-Q4_K', ['--synthetic', 'llama-3.2-1b', '--vocab', l3, '--type', 'Q4_K', '--embd-type', 'Q6_K']);
        const r = await bench('synthetic Llama-3.2-1B geometry Q4_K (Q6_K embeddings)', big, 32, parseInt(opt('--reps', '3'), 10));
        if (r.rss > 1.1 * r.size) fail(`resident memory ${r.rss} is more than 110% of the file (${r.size})`);
    }
}
if (opt('--summary', '')) fs.writeFileSync(opt('--summary', ''), JSON.stringify(summary, null, 1) + '\n');
log(failures ? `${failures} FAILED` : 'all checks passed');
process.exit(failures ? 1 : 0);
