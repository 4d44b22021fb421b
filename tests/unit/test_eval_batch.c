/*
 * Unit tests of lib/eval/kv_batch (results logs, resume, shards, merge
 * reading) and of lib/eval/kv_longbench's model-free parts (data files,
 * prompt templates, str.format, the config tables, pred.py's middle
 * truncation with a real tokenizer).
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kt_kv.h"
#include "eval/kv_batch.h"
#include "eval/kv_longbench.h"

static char dir[256];

static void path_of(char *buf, size_t cap, const char *name) { snprintf(buf, cap, "%s/%s", dir, name); }

static cJSON *header(const char *model, const char *shard)
{
    cJSON *h = cJSON_CreateObject(), *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(h, "kv_bench_log", KV_BATCH_LOG_VERSION);
    cJSON_AddStringToObject(h, "bench", "ruler");
    cJSON_AddStringToObject(c, "model", model);
    cJSON_AddItemToObject(h, "config", c);
    cJSON *p = cJSON_CreateArray();
    cJSON_AddItemToArray(p, cJSON_CreateString("full"));
    cJSON_AddItemToArray(p, cJSON_CreateString("sparse"));
    cJSON_AddItemToObject(h, "policies", p);
    if (shard) cJSON_AddStringToObject(h, "shard", shard);
    else cJSON_AddNullToObject(h, "shard");
    return h;
}

static void test_shards_partition_the_ids(void)
{
    int i, n;
    KT_CHECK(!kv_batch_parse_shard("2/3", &i, &n) && i == 2 && n == 3, "2/3");
    const char *bad[] = {"0/3", "4/3", "1/0", "a/3", "1/3x", "1", "-1/2"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++)
        KT_CHECK(kv_batch_parse_shard(bad[k], &i, &n) == KV_E_USAGE, "'%s' accepted", bad[k]);
    /* every id lands in exactly one of n shards, the same on every call */
    int count[3] = {0};
    for (int id = 0; id < 300; id++) {
        char s[16];
        snprintf(s, sizeof s, "%d", id);
        int in = 0;
        for (int sh = 1; sh <= 3; sh++)
            if (kv_batch_in_shard("niah_single_1", s, sh, 3)) {
                in++;
                count[sh - 1]++;
            }
        KT_CHECK(in == 1, "id %d in %d shards", id, in);
    }
    KT_CHECK(count[0] > 70 && count[1] > 70 && count[2] > 70, "balanced: %d %d %d", count[0], count[1], count[2]);
    /* the split depends on the task too, and is fixed: FNV-1a 64 */
    KT_CHECK(kv_batch_hash("a", "1") == 0xe5eaf019043b8c68ULL, "FNV-1a of \"a\\x1f1\": %llx",
             (unsigned long long)kv_batch_hash("a", "1"));
    KT_CHECK(kv_batch_hash("a", "1") != kv_batch_hash("b", "1"), "task matters");
    KT_CHECK(kv_batch_in_shard("x", "y", 1, 1), "one shard holds everything");
}

static void test_done_set(void)
{
    kv_batch_done *d;
    KT_REQUIRE(!kv_batch_done_new(&d), "new");
    for (int i = 0; i < 5000; i++) {
        char id[16];
        snprintf(id, sizeof id, "%d", i);
        kv_batch_done_add(d, "t", id, "full", 1024);
    }
    kv_batch_done_add(d, "t", "line:9", NULL, -1);
    KT_CHECK(kv_batch_done_has(d, "t", "4999", "full", 1024), "added");
    KT_CHECK(!kv_batch_done_has(d, "t", "4999", "sparse", 1024), "other policy");
    KT_CHECK(!kv_batch_done_has(d, "t", "4999", "full", 2048), "other length");
    KT_CHECK(!kv_batch_done_has(d, "u", "4999", "full", 1024), "other task");
    KT_CHECK(kv_batch_done_has(d, "t", "line:9", "sparse", -1), "a skip covers every policy");
    kv_batch_done_free(d);
}

static cJSON *rec(const char *id, const char *pol, int line, double score)
{
    cJSON *r = kv_batch_record("ruler", "t", id, 0, line, 1024, pol);
    cJSON_AddNumberToObject(r, "score", score);
    return r;
}

static void test_log_append_resume_and_torn_lines(void)
{
    char p[512];
    path_of(p, sizeof p, "log.jsonl");
    unlink(p);
    cJSON *h = header("m.bin", NULL), *recs = NULL;
    kv_batch_log *l;
    KT_REQUIRE(!kv_batch_open(p, false, h, &l, &recs), "%s", kv_errdetail());
    KT_CHECK(recs == NULL, "a new log has no records");
    cJSON *r1 = rec("1", "full", 1, 1), *r2 = rec("2", "full", 2, 0);
    KT_CHECK(!kv_batch_append(l, r1) && !kv_batch_append(l, r2), "append");
    cJSON_Delete(r1);
    cJSON_Delete(r2);
    KT_CHECK(!kv_batch_close(l), "close");
    /* without --resume an existing log is refused */
    KT_CHECK(kv_batch_open(p, false, h, &l, &recs) == KV_E_CANTCREATE && strstr(kv_errdetail(), "--resume"),
             "%s", kv_errdetail());
    /* a writer killed mid-line leaves a torn line: resume cuts it */
    FILE *f = fopen(p, "a");
    fputs("{\"bench\": \"ruler\", \"task\": \"t\", \"id\": \"3\", \"pol", f);
    fclose(f);
    KT_REQUIRE(!kv_batch_open(p, true, h, &l, &recs), "resume: %s", kv_errdetail());
    KT_CHECK(cJSON_GetArraySize(recs) == 2, "records %d", cJSON_GetArraySize(recs));
    cJSON *r3 = rec("3", "full", 3, 1);
    kv_batch_append(l, r3);
    cJSON_Delete(r3);
    kv_batch_close(l);
    cJSON_Delete(recs);
    /* the file reads back whole: 2 headers, 3 records, no torn line */
    cJSON *hs, *rs;
    int torn, dups;
    const char *paths[] = {p};
    KT_REQUIRE(!kv_batch_read(paths, 1, &hs, &rs, &torn, &dups), "%s", kv_errdetail());
    KT_CHECK(cJSON_GetArraySize(hs) == 2 && cJSON_GetArraySize(rs) == 3 && torn == 0 && dups == 0, "%d %d %d",
             cJSON_GetArraySize(hs), cJSON_GetArraySize(rs), torn);
    cJSON_Delete(hs);
    cJSON_Delete(rs);
    /* another run's settings are refused, naming what differs */
    cJSON *other = header("other.bin", NULL);
    KT_CHECK(kv_batch_open(p, true, other, &l, &recs) == KV_E_USAGE && strstr(kv_errdetail(), "\"model\""),
             "%s", kv_errdetail());
    cJSON_Delete(other);
    cJSON *sh = header("m.bin", "1/2");
    KT_CHECK(kv_batch_open(p, true, sh, &l, &recs) == KV_E_USAGE && strstr(kv_errdetail(), "shard"),
             "a log of another shard: %s", kv_errdetail());
    cJSON_Delete(sh);
    /* a corrupt line in the middle is an error, not a silent skip */
    f = fopen(p, "a");
    fputs("garbage\n{\"task\": \"t\"}\n", f);
    fclose(f);
    KT_CHECK(kv_batch_open(p, true, h, &l, &recs) == KV_E_DATA, "corrupt log resumed");
    cJSON_Delete(h);
}

static void write_shard(const char *name, const char *shard, int first)
{
    char p[512];
    path_of(p, sizeof p, name);
    unlink(p);
    cJSON *h = header("m.bin", shard), *recs;
    kv_batch_log *l;
    if (kv_batch_open(p, false, h, &l, &recs)) return;
    for (int i = first; i < first + 2; i++) {
        char id[8];
        snprintf(id, sizeof id, "%d", i);
        cJSON *r = rec(id, i % 2 ? "sparse" : "full", i, i * 0.25);
        kv_batch_append(l, r);
        cJSON_Delete(r);
    }
    kv_batch_close(l);
    cJSON_Delete(h);
}

static void test_read_checks_shards_and_sorts(void)
{
    write_shard("s1.jsonl", "1/2", 5);
    write_shard("s2.jsonl", "2/2", 1);
    char a[512], b[512];
    path_of(a, sizeof a, "s1.jsonl");
    path_of(b, sizeof b, "s2.jsonl");
    const char *both[] = {a, b}, *one[] = {a}, *twice[] = {a, b, a};
    cJSON *hs, *rs;
    int torn, dups;
    KT_CHECK(kv_batch_read(one, 1, &hs, &rs, &torn, &dups) == KV_E_DATA && strstr(kv_errdetail(), "2/2"),
             "a missing shard: %s", kv_errdetail());
    KT_REQUIRE(!kv_batch_read(twice, 3, &hs, &rs, &torn, &dups), "%s", kv_errdetail());
    KT_CHECK(dups == 2 && cJSON_GetArraySize(rs) == 4, "dups %d n %d", dups, cJSON_GetArraySize(rs));
    cJSON_Delete(hs);
    cJSON_Delete(rs);
    KT_REQUIRE(!kv_batch_read(both, 2, &hs, &rs, &torn, &dups), "%s", kv_errdetail());
    cJSON *pols = kv_batch_policies(hs);
    KT_CHECK(cJSON_GetArraySize(pols) == 2, "policies");
    kv_batch_sort(rs, pols);
    /* full first, then sparse; by line within each */
    const char *want[] = {"2", "6", "1", "5"};
    int k = 0;
    for (const cJSON *r = rs->child; r; r = r->next, k++)
        KT_CHECK(k < 4 && !strcmp(kv_rec_str(r, "id", ""), want[k]), "position %d: %s", k, kv_rec_str(r, "id", ""));
    cJSON_Delete(pols);
    cJSON_Delete(hs);
    cJSON_Delete(rs);
}

static void test_slug(void)
{
    char b[64];
    kv_batch_slug("0=quant:bits=1;1-5=sparse:k=2;*=full", b, sizeof b);
    KT_CHECK(!strcmp(b, "0=quant:bits=1_1-5=sparse:k=2__=full"), "%s", b);
    kv_batch_slug("../../etc", b, sizeof b);
    KT_CHECK(strchr(b, '/') == NULL, "no path separators: %s", b);
    kv_batch_slug("..", b, sizeof b);
    KT_CHECK(strcmp(b, "..") && strcmp(b, "."), "no dot names: %s", b);
}

// --- LongBench --------------------------------------------------------------------------

static void test_format_is_strformat(void)
{
    cJSON *o = cJSON_Parse("{\"context\": \"C\", \"input\": \"Q\", \"length\": 42, \"x\": null, \"l\": [1]}");
    char *s;
    long end;
    KT_REQUIRE(!kv_lb_format("a {context} b {{lit}} {input} {length} {x}", o, &s, &end), "%s", kv_errdetail());
    KT_CHECK(!strcmp(s, "a C b {lit} Q 42 None"), "'%s'", s);
    KT_CHECK(end == 3, "context ends at %ld", end);
    free(s);
    KT_CHECK(!kv_lb_format("}}{{", o, &s, &end) && !strcmp(s, "}{") && end == -1, "braces");
    free(s);
    const char *bad[] = {"{missing}", "{l}", "{}", "{0}", "{context!r}", "{context:>5}", "{a.b}", "x}", "{x",
                         "{c[0]}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        KT_CHECK(kv_lb_format(bad[i], o, &s, &end) == KV_E_DATA, "'%s' accepted", bad[i]);
    KT_CHECK(kv_lb_template_check("{context}{input}") == KV_OK && kv_lb_template_check("{") == KV_E_DATA, "check");
    cJSON_Delete(o);
}

static void test_tables(void)
{
    kv_lb_table t;
    const char *p = "{\"hotpotqa\": \"Q: {input}\\n{context}\", \"trec\": \"{context}\"}";
    KT_REQUIRE(!kv_lb_prompts_parse(p, strlen(p), "p.json", &t), "%s", kv_errdetail());
    KT_CHECK(t.n == 2 && kv_lb_table_find(&t, "trec") == 1 && kv_lb_table_find(&t, "lcc") == -1, "find");
    kv_lb_table_free(&t);
    const char *ml = "{\"hotpotqa\": 32, \"trec\": 64}";
    KT_REQUIRE(!kv_lb_maxlen_parse(ml, strlen(ml), "m.json", &t), "%s", kv_errdetail());
    KT_CHECK(t.num[0] == 32 && t.num[1] == 64, "lengths");
    kv_lb_table_free(&t);
    const char *badp[] = {"[]", "{\"a\": 3}", "{\"a\": \"{\"}", "{}", "{\"a\": \"x\", \"a\": \"y\"}"};
    for (size_t i = 0; i < sizeof badp / sizeof badp[0]; i++)
        KT_CHECK(kv_lb_prompts_parse(badp[i], strlen(badp[i]), "p", &t) == KV_E_DATA, "prompts %zu", i);
    const char *badm[] = {"{\"a\": 0}", "{\"a\": 1.5}", "{\"a\": \"32\"}", "{\"a\": 1e300}", "{\"a\": 70000}"};
    for (size_t i = 0; i < sizeof badm / sizeof badm[0]; i++)
        KT_CHECK(kv_lb_maxlen_parse(badm[i], strlen(badm[i]), "m", &t) == KV_E_DATA && strstr(kv_errdetail(), "\"a\""),
                 "maxlen %zu: %s", i, kv_errdetail());
}

static void test_data_files(void)
{
    const char *txt =
        "{\"input\": \"q\", \"context\": \"c\", \"answers\": [\"a\"], \"length\": 10, \"all_classes\": null, \"_id\": \"x1\"}\n"
        "{\"input\": \"q\", \"context\": \"c\", \"answers\": \"a\", \"_id\": \"x2\"}\n"
        "{\"input\": \"q\", \"context\": \"c\", \"answers\": [], \"length\": -5}\n"
        "{\"input\": \"q\", \"context\": \"c\", \"answers\": [\"b\"], \"_id\": \"x1\"}\n"
        "{\"input\": \"q\", \"context\": \"c\", \"answers\": [\"b\"], \"all_classes\": [\"A\", \"B\"]}\n";
    kv_lb_file f;
    KT_REQUIRE(!kv_lb_file_parse(txt, strlen(txt), "d/trec_e.jsonl", &f), "%s", kv_errdetail());
    KT_CHECK(!strcmp(f.dataset, "trec") && f.e && !strcmp(f.stem, "trec_e") && f.ds && f.ds->metric == KV_LB_CLASSIFICATION,
             "named by the file");
    KT_CHECK(f.n == 2 && f.n_bad == 3, "n %d bad %d", f.n, f.n_bad);
    KT_CHECK(f.bad[0].line == 2 && f.bad[1].line == 3 && f.bad[2].line == 4 && strstr(f.bad[2].why, "repeats"),
             "bad lines");
    KT_CHECK(!strcmp(f.v[1].id, "line:5") && f.v[1].has_classes && f.v[1].n_classes == 2 && f.v[0].length == 10 &&
                 f.v[1].length == -1, "fields");
    kv_lb_file_free(&f);
    KT_CHECK(kv_lb_file_parse(txt, strlen(txt), "d/hotpot.jsonl", &f) == KV_E_DATA &&
                 strstr(kv_errdetail(), "21 datasets"), "unknown dataset: %s", kv_errdetail());
}

static void test_middle_truncation(void)
{
    kv_tokenizer *tok;
    KT_REQUIRE(!kv_tokenizer_load_llama2c("tests/data/stories260K/tok512.bin", 512, &tok), "%s", kv_errdetail());
    const char *line = "{\"input\": \"Who?\", \"context\": \"Lily had a ball. Tom had a cat. Sam had a dog. "
                       "Ann had a hat. Ben had a bag. Max had a box.\", \"answers\": [\"x\"], \"_id\": \"1\"}";
    kv_lb_file f;
    KT_REQUIRE(!kv_lb_file_parse(line, strlen(line), "hotpotqa.jsonl", &f), "%s", kv_errdetail());
    const char *tmpl = "Story: {context}\nQuestion: {input}\nAnswer:";
    kv_lb_prompt full, cut;
    KT_REQUIRE(!kv_lb_prepare(tok, tmpl, &f.v[0], f.ds, 1000, NULL, KV_NIAH_QUESTION, &full), "%s", kv_errdetail());
    KT_CHECK(!full.truncated && full.mode == KV_NIAH_QUESTION && full.split > 1 && full.split < full.n, "split %d of %d",
             full.split, full.n);
    KT_REQUIRE(!kv_lb_prepare(tok, tmpl, &f.v[0], f.ds, 20, NULL, KV_NIAH_QUESTION, &cut), "%s", kv_errdetail());
    KT_CHECK(cut.truncated && cut.n < full.n, "cut to %d tokens from %d", cut.n, full.n);
    /* the cut keeps the start and the end of the prompt */
    int m = 0;
    while (m < cut.n && cut.ids[m] == full.ids[m]) m++;
    KT_CHECK(m >= 5, "common start %d", m);
    KT_CHECK(cut.ids[cut.n - 1] == full.ids[full.n - 1], "same end");
    /* 10 + 10 tokens lose part of the question: no split, prefill mode */
    KT_CHECK(cut.mode == KV_NIAH_PREFILL && cut.split == cut.n, "mode %d split %d", cut.mode, cut.split);
    kv_lb_prompt cut40;
    KT_REQUIRE(!kv_lb_prepare(tok, tmpl, &f.v[0], f.ds, 40, NULL, KV_NIAH_QUESTION, &cut40), "%s", kv_errdetail());
    KT_CHECK(cut40.truncated && cut40.mode == KV_NIAH_QUESTION && cut40.split > 1 && cut40.split < cut40.n,
             "20 + 20 tokens keep the question: split %d of %d", cut40.split, cut40.n);
    free(cut40.ids);
    kv_lb_prompt chat;
    const kv_chat inst = {KV_CHAT_TEMPLATE, "[INST]{prompt}[/INST]"};
    KT_REQUIRE(!kv_lb_prepare(tok, tmpl, &f.v[0], f.ds, 1000, &inst, KV_NIAH_QUESTION, &chat), "chat");
    KT_CHECK(chat.n > full.n && chat.mode == KV_NIAH_QUESTION, "chat wraps hotpotqa");
    kv_lb_prompt pre;
    KT_REQUIRE(!kv_lb_prepare(tok, tmpl, &f.v[0], f.ds, 1000, NULL, KV_NIAH_PREFILL, &pre), "prefill");
    KT_CHECK(pre.split == pre.n && pre.mode == KV_NIAH_PREFILL, "prefill: all dense");
    free(full.ids);
    free(cut.ids);
    free(chat.ids);
    free(pre.ids);
    kv_lb_file_free(&f);
    kv_tokenizer_free(tok);
}

/* --chat llama3 wraps a sample in Llama-3's user turn (one chat
 * implementation, model/kv_chat), and question mode still splits where the
 * context ends: the dense part is BOS, the user header and the story. */
static void test_llama3_chat_prompt(void)
{
    kv_tokenizer *tok;
    KT_REQUIRE(!kv_tokenizer_load_gguf("tests/data/gguf/llama3-vocab.gguf", &tok), "%s", kv_errdetail());
    const char *line = "{\"input\": \"Who had a cat?\", \"context\": \"Lily had a ball. Tom had a cat\", "
                       "\"answers\": [\"Tom\"], \"_id\": \"1\"}";
    kv_lb_file f;
    KT_REQUIRE(!kv_lb_file_parse(line, strlen(line), "hotpotqa.jsonl", &f), "%s", kv_errdetail());
    const char *tmpl = "Story: {context}\nQuestion: {input}\nAnswer:";
    const kv_chat l3 = {KV_CHAT_LLAMA3, NULL};
    kv_lb_prompt p;
    KT_REQUIRE(!kv_lb_prepare(tok, tmpl, &f.v[0], f.ds, 1000, &l3, KV_NIAH_QUESTION, &p), "%s", kv_errdetail());
    int *ref, nr;
    const char *want = "<|start_header_id|>user<|end_header_id|>\n\nStory: Lily had a ball. Tom had a cat\n"
                       "Question: Who had a cat?\nAnswer:<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    kv_encode_opts eo = {true, false, true};
    KT_REQUIRE(!kv_tokenizer_encode_ex(tok, want, strlen(want), &eo, &ref, &nr), "%s", kv_errdetail());
    KT_CHECK(p.n == nr && !memcmp(p.ids, ref, (size_t)nr * sizeof *ref), "the Llama-3 turn: %d ids, expected %d", p.n, nr);
    free(ref);
    const char *dense = "<|start_header_id|>user<|end_header_id|>\n\nStory: Lily had a ball. Tom had a cat";
    KT_REQUIRE(!kv_tokenizer_encode_ex(tok, dense, strlen(dense), &eo, &ref, &nr), "%s", kv_errdetail());
    KT_CHECK(p.mode == KV_NIAH_QUESTION && p.split == nr, "split after the context: %d, expected %d", p.split, nr);
    free(ref);
    free(p.ids);
    kv_lb_file_free(&f);
    kv_tokenizer_free(tok);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kv-test-batch-%d", (int)getpid());
    mkdir(dir, 0700);
    KT_RUN(test_shards_partition_the_ids);
    KT_RUN(test_done_set);
    KT_RUN(test_log_append_resume_and_torn_lines);
    KT_RUN(test_read_checks_shards_and_sorts);
    KT_RUN(test_slug);
    KT_RUN(test_format_is_strformat);
    KT_RUN(test_tables);
    KT_RUN(test_data_files);
    KT_RUN(test_middle_truncation);
    KT_RUN(test_llama3_chat_prompt);
    (void)kt_rm_rf(dir);
    return kt_done();
}
