#!/usr/bin/env node
// Write a Hugging Face tokenizer.json (model.vocab, model.merges,
// added_tokens) for the Llama-3 vocabulary that the MIT npm package
// llama3-tokenizer-js ships in its own compressed form, so that
// `kv-convert --hf-tokenizer` can build a vocabulary-only GGUF from it.
//
//   npm pack llama3-tokenizer-js@1.2.0 && tar xzf llama3-tokenizer-js-1.2.0.tgz
//   node tools/llama3-tokenizer-json.mjs package/bundle/llama3-tokenizer-with-baked-data.js > tokenizer.json
//
// The package is used only through its exported class: the 128,000 regular
// tokens (ids in order), the 280,147 merges (ranked by their priority) and
// the 256 special tokens it appends (ids 128000..128255).  Not part of
// `make check` (it needs node and the package).
import { pathToFileURL } from 'node:url';
import path from 'node:path';

const file = process.argv[2];
if (!file) {
    console.error('usage: llama3-tokenizer-json.mjs PATH/TO/llama3-tokenizer-with-baked-data.js');
    process.exit(64);
}
const mod = await import(pathToFileURL(path.resolve(file)).href);
const tok = new mod.Llama3Tokenizer();
const ids = tok.vocabById;
const nRegular = 128000;
if (ids.length !== 128256) {
    console.error(`expected 128256 tokens, found ${ids.length}`);
    process.exit(65);
}
const vocab = {};
for (let i = 0; i < nRegular; i++) vocab[ids[i]] = i;
const merges = [...tok.merges.entries()].sort((a, b) => a[1] - b[1]).map(([k]) => k);
const added = [];
for (let i = nRegular; i < ids.length; i++)
    added.push({ id: i, content: ids[i], single_word: false, lstrip: false, rstrip: false,
                 normalized: false, special: true });
process.stdout.write(JSON.stringify({
    version: '1.0',
    added_tokens: added,
    model: { type: 'BPE', ignore_merges: true, vocab, merges },
}));
