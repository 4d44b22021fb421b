/*
 * kv-convert: write GGUF files (man/kv-convert.1): a model (llama2.c
 * checkpoint with its tokenizer, any GGUF kv-run reads, or a synthetic
 * geometry) with its matrices in one weight type, F32 ... Q6_K; or a
 * vocabulary-only GGUF from a Hugging Face tokenizer.json.  The work is
 * lib/model/kv_convert.c's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include "kv_cli.h"
#include "common/kv_file.h"
#include "common/kv_ggml.h"
#include "format/kv_gguf.h"
#include "model/kv_convert.h"
#include "model/kv_model.h"
#include "model/kv_quants.h"
#include "model/kv_tokenizer.h"

enum {
    O_MODEL = 'm', O_OUT = 'o', O_SEED = 's', O_TYPE = 256, O_SYNTH, O_TOKENIZER, O_VOCAB, O_HF, O_PRE,
    O_BOS, O_EOS, O_EMBD, O_ARCH, O_NAME, O_BIAS, O_THETA, O_ROPE, O_CHAT
};

static const kv_option opts[] = {
    {O_MODEL, 'm', "model", "FILE", "model to convert: llama2.c .bin or GGUF"},
    {O_SYNTH, 0, "synthetic", "NAME", "seeded random model instead (see kv-run --synthetic)"},
    {O_SEED, 's', "seed", "N", "seed for --synthetic and --qkv-bias (default 42)"},
    {O_TOKENIZER, 0, "tokenizer", "FILE", "llama2.c tokenizer of a llama2.c model"},
    {O_VOCAB, 0, "vocab", "FILE", "copy the vocabulary of this GGUF (e.g. a vocabulary-only file)"},
    {O_TYPE, 0, "type", "TYPE", "matrix type: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K..Q6_K (default F16)"},
    {O_EMBD, 0, "embd-type", "TYPE", "type of token_embd and output (default: --type)"},
    {O_ARCH, 0, "arch", "ARCH", "architecture to write: llama (default) or qwen2"},
    {O_NAME, 0, "name", "NAME", "general.name (default: the model's)"},
    {O_BIAS, 0, "qkv-bias", "SEED", "add seeded random q/k/v biases (test fixtures)"},
    {O_THETA, 0, "rope-theta", "X", "write this RoPE base instead of the model's"},
    {O_ROPE, 0, "rope-freqs", "SPEC", "write rope_freqs: llama3[:FACTOR,LOW,HIGH,CTX] (default 8,1,4,8192)"},
    {O_CHAT, 0, "chat-template", "FILE", "store FILE as tokenizer.chat_template"},
    {O_HF, 0, "hf-tokenizer", "FILE", "write a vocabulary-only GGUF from a BPE tokenizer.json"},
    {O_PRE, 0, "pre", "NAME", "with --hf-tokenizer: tokenizer.ggml.pre (default: default)"},
    {O_BOS, 0, "bos", "TOKEN", "with --hf-tokenizer: the BOS token's text"},
    {O_EOS, 0, "eos", "TOKEN", "with --hf-tokenizer: the EOS token's text"},
    {O_OUT, 'o', "output", "FILE", "GGUF file to write, or - (required)"},
    {0, 0, NULL, NULL, NULL},
};

static const kv_cli_spec spec = {
    "kv-convert", "[OPTIONS] (--model FILE | --synthetic NAME | --hf-tokenizer FILE) -o FILE",
    "Write GGUF files: a model in one weight type, or a vocabulary from tokenizer.json.", opts,
    "Examples:\n"
    "  kv-convert -m stories260K.bin --tokenizer tok512.bin --type Q8_0 -o stories260K-q8_0.gguf\n"
    "  kv-convert --hf-tokenizer tokenizer.json --pre llama-bpe --bos '<|begin_of_text|>' \\\n"
    "             --eos '<|end_of_text|>' -o llama3-vocab.gguf"};

typedef struct {
    const char *model, *synth, *tokenizer, *vocab, *type, *embd, *arch, *name, *rope, *chat, *hf, *pre;
    const char *bos, *eos, *out;
    unsigned long seed, bias;
    bool seed_set;
    double theta;
} conv_opts;

static uint32_t parse_type(const char *opt, const char *s)
{
    int t = kv_ggml_type_parse(s);
    if (t < 0 || !kv_quant_supported((uint32_t)t))
        kv_cli_usage_error("%s %s: not a type kv-convert writes (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 "
                           "Q2_K Q3_K Q4_K Q5_K Q6_K)", opt, s);
    return (uint32_t)t;
}

/* The parsed GGUF of --vocab, kept mapped while the converter copies it. */
typedef struct {
    void *map;
    size_t len;
    kv_gguf *g;
} mapped_gguf;

static kv_status map_gguf(const char *path, mapped_gguf *m)
{
    memset(m, 0, sizeof *m);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return kv_fail(KV_E_NOINPUT, "cannot open %s", path);
    struct stat sb;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode) || sb.st_size < 4) {
        close(fd);
        return kv_fail(KV_E_DATA, "%s is not a GGUF file", path);
    }
    m->len = (size_t)sb.st_size;
    m->map = mmap(NULL, m->len, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m->map == MAP_FAILED) {
        m->map = NULL;
        return kv_fail(KV_E_IO, "cannot map %s", path);
    }
    kv_status st = memcmp(m->map, "GGUF", 4) ? kv_fail(KV_E_DATA, "not a GGUF file (bad magic)")
                                             : kv_gguf_parse(m->map, m->len, &m->g);
    if (st) kv_errcontext("%s", path);
    return st;
}

static void unmap_gguf(mapped_gguf *m)
{
    kv_gguf_free(m->g);
    if (m->map) munmap(m->map, m->len);
}

int main(int argc, char **argv)
{
    kv_cli_init(&spec, argc, argv);
    conv_opts o = {.seed = 42};
    const char *arg;
    int id, optind_;
    while ((id = kv_cli_next(argc, argv, &arg, &optind_)) != -1) {
        switch (id) {
        case O_MODEL: o.model = arg; break;
        case O_SYNTH: o.synth = arg; break;
        case O_SEED:
            o.seed = (unsigned long)kv_cli_long("--seed", arg, 0, 0x7fffffffffffffffL);
            o.seed_set = true;
            break;
        case O_TOKENIZER: o.tokenizer = arg; break;
        case O_VOCAB: o.vocab = arg; break;
        case O_TYPE: o.type = arg; break;
        case O_EMBD: o.embd = arg; break;
        case O_ARCH: o.arch = arg; break;
        case O_NAME: o.name = arg; break;
        case O_BIAS: o.bias = (unsigned long)kv_cli_long("--qkv-bias", arg, 1, 0x7fffffffffffffffL); break;
        case O_THETA: o.theta = kv_cli_double("--rope-theta", arg, 1, 1e12); break;
        case O_ROPE: o.rope = arg; break;
        case O_CHAT: o.chat = arg; break;
        case O_HF: o.hf = arg; break;
        case O_PRE: o.pre = arg; break;
        case O_BOS: o.bos = arg; break;
        case O_EOS: o.eos = arg; break;
        case O_OUT: o.out = arg; break;
        }
    }
    if (optind_ < argc) kv_cli_usage_error("unexpected argument '%s'", argv[optind_]);
    if (!o.out) kv_cli_usage_error("give the output file with -o FILE");
    if (!!o.model + !!o.synth + !!o.hf != 1)
        kv_cli_usage_error("give exactly one of --model, --synthetic and --hf-tokenizer");
    if (o.hf && (o.type || o.embd || o.arch || o.tokenizer || o.vocab || o.bias || o.rope || o.theta || o.name))
        kv_cli_usage_error("--hf-tokenizer writes a vocabulary only: no weight, architecture, name or RoPE options");
    if (o.seed_set && !o.synth && !o.bias) kv_cli_usage_error("--seed goes with --synthetic or --qkv-bias");
    if (!o.hf && (o.pre || o.bos || o.eos)) kv_cli_usage_error("--pre, --bos and --eos go with --hf-tokenizer");
    if (o.tokenizer && o.vocab) kv_cli_usage_error("--tokenizer and --vocab are exclusive");
    if (o.arch && strcmp(o.arch, "llama") && strcmp(o.arch, "qwen2"))
        kv_cli_usage_error("--arch must be llama or qwen2");
    kv_convert_opts co;
    kv_convert_opts_default(&co);
    if (o.type) co.wtype = parse_type("--type", o.type);
    if (o.embd) co.embd_type = (int32_t)parse_type("--embd-type", o.embd);
    if (o.arch) co.arch = o.arch;
    co.name = o.name;
    co.bias_seed = o.bias;
    co.rope_theta = o.theta;
    if (o.rope) {
        if (strncmp(o.rope, "llama3", 6) || (o.rope[6] && o.rope[6] != ':'))
            kv_cli_usage_error("--rope-freqs must be llama3 or llama3:FACTOR,LOW,HIGH,CTX");
        co.rope_llama3 = true;
        if (o.rope[6] == ':') {
            char tail;
            if (sscanf(o.rope + 7, "%lf,%lf,%lf,%d%c", &co.rope_factor, &co.rope_low, &co.rope_high,
                       &co.rope_orig_ctx, &tail) != 4 ||
                !(co.rope_factor >= 1 && co.rope_low > 0 && co.rope_high > co.rope_low && co.rope_orig_ctx > 0))
                kv_cli_usage_error("--rope-freqs llama3:FACTOR,LOW,HIGH,CTX needs FACTOR >= 1, 0 < LOW < HIGH, CTX > 0");
        }
    }
    if (!strcmp(o.out, "-")) kv_refuse_binary_tty(stdout, "a GGUF file");
    int rc = 0;
    kv_status st;
    char *chat = NULL;
    kv_model *m = NULL;
    kv_tokenizer *tok = NULL;
    mapped_gguf vg = {0};
    if (o.chat) {
        size_t n;
        if ((st = kv_file_slurp(o.chat, 1 << 20, "chat template", &chat, &n))) {
            rc = kv_report(st, "cannot read --chat-template");
            goto out;
        }
        co.chat_template = chat;
    }
    if (o.hf) {
        kv_vocab_opts vo = {o.pre, o.bos, o.eos, chat};
        int n = 0;
        if ((st = kv_convert_hf_vocab(o.hf, &vo, o.out, &n))) rc = kv_report(st, "cannot convert %s", o.hf);
        else kv_note(0, "wrote %s: vocabulary of %d tokens (pre-tokenizer %s)", o.out, n, o.pre ? o.pre : "default");
        goto out;
    }
    st = o.synth ? kv_model_synthetic(o.synth, o.seed, KV_DT_F32, &m) : kv_model_open(o.model, &m);
    if (st) {
        rc = kv_report(st, "cannot load model");
        goto out;
    }
    if (o.tokenizer && (st = kv_tokenizer_load_llama2c(o.tokenizer, m->cfg.vocab_size, &tok))) {
        rc = kv_report(st, "cannot load the tokenizer");
        goto out;
    }
    if (o.vocab && (st = map_gguf(o.vocab, &vg))) {
        rc = kv_report(st, "cannot read --vocab");
        goto out;
    }
    kv_convert_report rep;
    if ((st = kv_convert_model(m, tok, vg.g, &co, o.out, &rep))) {
        rc = kv_report(st, "cannot write %s", o.out);
        goto out;
    }
    char tb[16];
    kv_note(0, "wrote %s: %s %s, %d tensors, %.2f MB of data", o.out, co.arch, kv_ggml_type_name(co.wtype, tb),
            rep.n_tensors, (double)rep.bytes / 1e6);
    if (rep.n_fallback)
        kv_note(0, "%d matrices have rows their type cannot hold and were written in another type (first: %s)",
                rep.n_fallback, rep.fallback);
out:
    unmap_gguf(&vg);
    kv_tokenizer_free(tok);
    kv_model_close(m);
    free(chat);
    return rc;
}
