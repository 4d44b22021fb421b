/*
 * The GPU engine's graph-captured decode step (lib/gpu/kv_gpu_graph.c)
 * against the same steps launched kernel by kernel: for every placement
 * (full, offload, quant packed on the GPU and on the host, dsq, sparse with
 * select=resident and by channels, streaming), one engine with
 * opts.graph on and one with it off get the same prompt, then steps with
 * logits (kv_gpu_engine_step, the host picking the greedy token) and a
 * greedy run on the device (kv_gpu_engine_generate), long enough to cross
 * group and window boundaries (quant packs, dsq windows, streaming's ring).
 * The same kernels run in the same order either way, so ids and logits
 * must be identical; the graph side must have captured steps, and the
 * placements that cannot capture a step (a packed group, a host-packed
 * window) must have run those steps plainly and said why.
 * The kernel that replaces one of those copies (eng_copy_2d) is checked
 * against cudaMemcpy2D byte for byte.
 * Without a usable GPU every test is reported as skipped.
 * KV_GPU_TEST_SHORT=1 (compute-sanitizer): fewer steps, the small models.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt_kv.h"
#include "gpu/kv_gpu.h"
#include "gpu/kv_gpu_engine.h"
#include "model/kv_model.h"
#include "policy/kv_policy.h"

#ifdef KV_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "eng_ops.cuh"
#endif

#define S260 "tests/data/stories260K/"
#define NIAH "tests/data/niah4k/"


static int short_run(void) { return getenv("KV_GPU_TEST_SHORT") != NULL; }

/* What one engine produced: logits of the host-driven steps, then ids of
 * the device-driven ones, and how its steps reached the GPU. */
typedef struct {
    float *logits;  /* (n_step, vocab) */
    int *ids;       /* (n_step + n_gen): the host's greedy picks, then generate's */
    kv_gpu_graph_info gi;
} run_out;

static kv_status run_engine(const kv_model *m, const kv_policy_params *pp, int graph, const int *prompt,
                            int n, int n_step, int n_gen, run_out *r)
{
    const int V = m->cfg.vocab_size;
    kv_gpu_engine_opts o;
    kv_gpu_engine_opts_default(&o);
    o.graph = graph;
    kv_gpu_engine *g = NULL;
    kv_status st = kv_gpu_engine_new(m, pp, n + n_step + n_gen + 8, &o, &g);
    float *lg = malloc((size_t)V * sizeof *lg);
    if (!st && !lg) st = kv_fail(KV_E_NOMEM, "out of memory");
    if (!st) st = kv_gpu_engine_prefill(g, prompt, n, lg);
    int tok = st ? 0 : kt_argmax(lg, V);
    for (int i = 0; i < n_step && !st; i++) {
        r->ids[i] = tok;
        st = kv_gpu_engine_step(g, tok, r->logits + (size_t)i * V);
        if (!st) tok = kt_argmax(r->logits + (size_t)i * V, V);
    }
    if (!st && n_gen) st = kv_gpu_engine_generate(g, tok, n_gen, r->ids + n_step, NULL);
    if (g) kv_gpu_engine_graph_info(g, &r->gi);
    kv_gpu_engine_free(g);
    free(lg);
    return st;
}

/*
 * spec on m: graphs on and off give the same ids and logits.  want_plain:
 * the placement must run some steps plainly, with a reason containing it
 * (NULL: every step must be captured).
 */
static void check_graph(const kv_model *m, const char *spec, int n, int n_step, int n_gen,
                        const char *want_plain)
{
    const int V = m->cfg.vocab_size, L = m->cfg.n_layers;
    kv_policy_params *pp = calloc((size_t)L, sizeof *pp);
    int *prompt = malloc((size_t)n * sizeof *prompt);
    KT_REQUIRE(pp && prompt, "alloc");
    OK(kv_policy_parse(spec, L, pp));
    for (int l = 0; l < L; l++) pp[l].dtype = KV_DT_F16;
    uint64_t z = 0x9e3779b97f4a7c15ull;
    prompt[0] = 1;
    for (int i = 1; i < n; i++) {
        z ^= z >> 12, z ^= z << 25, z ^= z >> 27;
        prompt[i] = 3 + (int)((z >> 33) % (uint64_t)(V - 3 < 200 ? V - 3 : 200));
    }
    run_out r[2];
    for (int k = 0; k < 2; k++) {
        r[k].logits = calloc((size_t)n_step * V, sizeof(float));
        r[k].ids = calloc((size_t)(n_step + n_gen), sizeof(int));
        KT_REQUIRE(r[k].logits && r[k].ids, "alloc");
    }
    OK(run_engine(m, pp, KV_GPU_GRAPH_OFF, prompt, n, n_step, n_gen, &r[0]));
    OK(run_engine(m, pp, KV_GPU_GRAPH_ON, prompt, n, n_step, n_gen, &r[1]));
    double dmax = 0;
    for (size_t i = 0; i < (size_t)n_step * V; i++) {
        double d = (double)r[0].logits[i] - r[1].logits[i];
        if (d < 0) d = -d;
        if (d > dmax || r[0].logits[i] != r[0].logits[i]) dmax = d > dmax ? d : 1e30;
    }
    int ids_differ = 0;
    for (int i = 0; i < n_step + n_gen; i++) ids_differ += r[0].ids[i] != r[1].ids[i];
    const kv_gpu_graph_info *gi = &r[1].gi;
    printf("# %-58s %s; %llu of %llu steps captured (%llu updated in place, %llu instantiated, "
           "%llu updates refused, last result %d), host %.0f us/step; max |logit diff| %g\n", spec, gi->state,
           (unsigned long long)gi->captured, (unsigned long long)gi->steps, (unsigned long long)gi->updated,
           (unsigned long long)gi->instantiated, (unsigned long long)gi->refused, gi->refused_result,
           gi->host_us, dmax);
    KT_CHECK(!strcmp(r[0].gi.state, "off") && r[0].gi.captured == 0, "%s: graph off ran '%s'", spec,
             r[0].gi.state);
    KT_CHECK(gi->steps == (uint64_t)(n_step + n_gen), "%s: %llu steps counted, %d run", spec,
             (unsigned long long)gi->steps, n_step + n_gen);
    KT_CHECK(dmax == 0, "%s: logits with graphs differ by up to %g", spec, dmax);
    KT_CHECK(ids_differ == 0, "%s: %d of %d ids differ with graphs", spec, ids_differ, n_step + n_gen);
    /* every placement's steps are shaped so that the executable is updated in place */
    KT_CHECK(gi->captured > 0 && gi->updated > 0 && gi->refused == 0,
             "%s: %llu steps captured, %llu updated in place, %llu updates refused (result %d)", spec,
             (unsigned long long)gi->captured, (unsigned long long)gi->updated,
             (unsigned long long)gi->refused, gi->refused_result);
    if (want_plain)
        KT_CHECK(gi->captured < gi->steps && strstr(gi->plain_why, want_plain),
                 "%s: expected plain steps (%s), got '%s'", spec, want_plain, gi->state);
    else
        KT_CHECK(gi->captured + 1 == gi->steps && !strcmp(gi->state, "captured"),
                 "%s: '%s' (%llu of %llu captured; the first step after a reset runs plainly)", spec,
                 gi->state, (unsigned long long)gi->captured, (unsigned long long)gi->steps);
    for (int k = 0; k < 2; k++) {
        free(r[k].logits);
        free(r[k].ids);
    }
    free(prompt);
    free(pp);
}

/* stories260K (head_dim 8): full, offload, streaming, the host-packed
 * quant form and dsq, each over group/window/ring boundaries. */
static void test_stories260k_graphs_equal_plain_launches(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(S260 "stories260K.bin", &m));
    const int n = 40, ns = short_run() ? 8 : 24, ng = short_run() ? 24 : 72;
    check_graph(m, "full", n, ns, ng, NULL);
    check_graph(m, "full:offload=on", n, ns, ng, NULL);
    check_graph(m, "*=streaming:sink=4,window=16", n, ns, ng, NULL);
    check_graph(m, "*=quant:bits=2,group=16,residual=16", n, ns, ng, "quant (host-packed)");
    check_graph(m, "0=full;*=dsq:window=16,salient=0,bits=2", n, ns, ng, "dsq");
    kv_model_close(m);
}

/* niah4k (head_dim 64): the sparse layers, selection one layer ahead on
 * the side streams (select=resident and by channels from host memory). */
static void test_niah4k_sparse_graphs_equal_plain_launches(void)
{
    kv_model *m = NULL;
    OK(kv_model_open(NIAH "niah4k.bin", &m));
    const int n = short_run() ? 160 : 400, ns = short_run() ? 6 : 16, ng = short_run() ? 16 : 48;
    check_graph(m, "0=full;*=sparse:k=64,sink=8,window=32,channels=16,select=resident", n, ns, ng, NULL);
    check_graph(m, "0=full;*=sparse:k=64,sink=8,window=32,channels=8", n, ns, ng, NULL);
    check_graph(m, "0-1=quant:bits=2,group=16,residual=16;*=sparse:k=64,sink=8,window=32,channels=16,"
                "select=resident", n, ns, ng, "quant (host-packed)");
    kv_model_close(m);
}

/* The synthetic Llama-2-7B geometry (head_dim 128) cut to 3 layers: the
 * KIVI kernels' path (packed on the GPU), whose group packing allocates. */
static void test_head_dim_128_quant_graphs_equal_plain_launches(void)
{
    kv_model *m = NULL;
    OK(kv_model_synthetic("llama-2-7b", 7, KV_DT_F16, &m));
    m->cfg.n_layers = 3; /* the layers share one set of weights; fewer of them is the same model shape */
    const int ns = short_run() ? 4 : 16, ng = short_run() ? 40 : 80;
    check_graph(m, "*=quant:bits=2,group=32,residual=32", 70, ns, ng, "quant: the step packs a group");
    check_graph(m, "0=full;*=quant:bits=1,group=32,residual=32", 70, ns, ng, "quant: the step packs");
    kv_model_close(m);
}

#ifdef KV_HAVE_CUDA
/* eng_copy_2d against cudaMemcpy2D on random bytes: aligned (the 16-byte
 * path) and odd (the byte path) shapes, the rows outside left alone. */
static void test_copy_kernel_equals_memcpy_2d(void)
{
    static const size_t shape[][4] = {/* width, height, dpitch, spitch */
                                      {4096, 8, 8192, 16384}, {256, 32, 256, 512}, {48, 3, 64, 80},
                                      {77, 5, 100, 91},       {1, 1, 1, 1}};
    uint64_t z = 0x2545f4914f6cdd1dull;
    for (size_t k = 0; k < sizeof shape / sizeof shape[0]; k++) {
        const size_t w = shape[k][0], h = shape[k][1], dp = shape[k][2], sp = shape[k][3];
        const size_t sn = sp * h, dn = dp * h;
        unsigned char *hs = malloc(sn), *ha = malloc(dn), *hb = malloc(dn);
        KT_REQUIRE(hs && ha && hb, "alloc");
        for (size_t i = 0; i < sn; i++) {
            z ^= z >> 12, z ^= z << 25, z ^= z >> 27;
            hs[i] = (unsigned char)(z >> 56);
        }
        void *ds = NULL, *da = NULL, *db = NULL;
        KT_REQUIRE(cudaMalloc(&ds, sn) == cudaSuccess && cudaMalloc(&da, dn) == cudaSuccess &&
                       cudaMalloc(&db, dn) == cudaSuccess, "cudaMalloc");
        cudaMemcpy(ds, hs, sn, cudaMemcpyHostToDevice);
        cudaMemset(da, 0x5a, dn);
        cudaMemset(db, 0x5a, dn);
        KT_CHECK(cudaMemcpy2D(da, dp, ds, sp, w, h, cudaMemcpyDeviceToDevice) == cudaSuccess, "memcpy2D");
        KT_CHECK(eng_copy_2d(db, dp, ds, sp, w, h, 0) == cudaSuccess, "eng_copy_2d %zux%zu", w, h);
        KT_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
        cudaMemcpy(ha, da, dn, cudaMemcpyDeviceToHost);
        cudaMemcpy(hb, db, dn, cudaMemcpyDeviceToHost);
        size_t bad = 0;
        for (size_t i = 0; i < dn; i++) bad += ha[i] != hb[i];
        KT_CHECK(bad == 0, "width %zu, height %zu, pitches %zu/%zu: %zu of %zu bytes differ", w, h, dp, sp,
                 bad, dn);
        cudaFree(ds);
        cudaFree(da);
        cudaFree(db);
        free(hs);
        free(ha);
        free(hb);
    }
    KT_CHECK(eng_copy_2d(NULL, 16, NULL, 16, 16, 1, 0) != cudaSuccess, "a NULL copy was accepted");
    (void)cudaGetLastError();
}
#endif


int main(void)
{
    char name[256];
    int ndev = kv_gpu_probe(name, sizeof name);
    if (ndev <= 0) {
        printf("# no usable GPU (%s): GPU tests skipped\n", name);
        const char *why = "no usable GPU";
        KT_SKIP(test_copy_kernel_equals_memcpy_2d, why);
        KT_SKIP(test_stories260k_graphs_equal_plain_launches, why);
        KT_SKIP(test_niah4k_sparse_graphs_equal_plain_launches, why);
        KT_SKIP(test_head_dim_128_quant_graphs_equal_plain_launches, why);
        return kt_done();
    }
    printf("# GPU: %s\n", name);
    /* KV_TEST_FILTER=a,b runs only the tests whose names contain a or b */
    const char *filter = getenv("KV_TEST_FILTER");
#define RUN_ONE(t) KT_RUN_SELECTED(t, filter)
#ifdef KV_HAVE_CUDA
    RUN_ONE(test_copy_kernel_equals_memcpy_2d);
#endif
    RUN_ONE(test_stories260k_graphs_equal_plain_launches);
    RUN_ONE(test_niah4k_sparse_graphs_equal_plain_launches);
    RUN_ONE(test_head_dim_128_quant_graphs_equal_plain_launches);
    return kt_done();
}
