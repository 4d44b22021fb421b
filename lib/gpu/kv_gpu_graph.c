/*
 * kv_gpu_graph: the GPU engine's decode step as a CUDA graph (issue 10).
 * A step is ~10 kernels per layer plus the sparse layers' selection on two
 * more streams and the offload copies on a third; launched one by one,
 * each kernel pays its launch gap on the GPU.  Here the step is captured
 * from the same code (gl_decode_forward, kv_gpu_engine.c's layer loop) into
 * a graph, the graph is applied to an executable graph in place
 * (cudaGraphExecUpdate: same nodes and edges, new lengths, pointers and
 * grid sizes) and the executable is launched once.
 *
 * Why re-capture per step rather than one graph replayed with the
 * position in device memory: every launcher sizes its grid and split-K
 * plan from the token count on the host, the quant layers' residual
 * length and packed arrays change between steps, and the sparse layers'
 * candidate ranges and the offload copies' sizes are host arithmetic.  A
 * fixed graph would need every kernel of kernels/ to read its lengths from
 * device memory and to be launched for the largest context; the capture
 * keeps the kernels as they are and costs host time only, which overlaps
 * the previous step's GPU work (docs/DESIGN.md, "Graph-captured decode").
 *
 * Streams: at the capture's start the side streams (selection, gather,
 * copy) fork from the main stream into the capture, and at its end they
 * join it, so one graph holds the whole step.  Outside the capture, the
 * main stream waits for the side streams before a graph launch and they
 * wait for the main stream after it, so plain and captured steps mix.
 * Events a step waits on that an earlier step recorded (the offload
 * staging buffers' ev_done) are recorded again at the capture's start:
 * the graph begins after all earlier work anyway.
 *
 * A step runs plainly (counted, its reason kept) when opts.graph is off,
 * when it is auto and the step is kv_gpu_engine_step's (the host waits for
 * its logits, so the capture's host time is not hidden: measured slower),
 * for the first step after a reset (the launchers' one-time setup, such as
 * occupancy queries, stays out of captures; no reason kept), with opts.profile (timing events are not recorded inside a graph), or
 * when a layer's placement says the step cannot be captured
 * (gl_placement.graph_block: quant packs a group with stream-ordered
 * allocations, host-packed quant and dsq wait for the host).
 */
#include "gpu/kv_gpu_int.h"

#ifdef KV_HAVE_CUDA

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

kv_status gl_graph_init(kv_gpu_engine *e)
{
    gl_graph *g = &e->gr;
    CK(cudaEventCreateWithFlags(&g->ev_fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&g->ev_fan, cudaEventDisableTiming));
    for (int i = 0; i < 3; i++) CK(cudaEventCreateWithFlags(&g->ev_join[i], cudaEventDisableTiming));
    return KV_OK;
}

void gl_graph_idle(kv_gpu_engine *e)
{
    gl_graph *g = &e->gr;
    for (int i = 0; i < g->n_retired; i++) cudaFree(g->retired[i]);
    g->n_retired = 0;
}

void gl_graph_reset(kv_gpu_engine *e)
{
    gl_graph *g = &e->gr;
    for (int i = 0; i < 2; i++) {
        if (g->exec[i]) cudaGraphExecDestroy(g->exec[i]);
        g->exec[i] = NULL;
    }
    gl_graph_idle(e);
    g->cur = 0;
    g->sig[0] = g->sig[1] = g->no_update_sig = 0;
    g->steps = g->captured = g->updated = g->instantiated = g->refused = 0;
    g->refused_result = 0;
    g->host_us = 0;
    g->plain_why[0] = 0;
}

void gl_graph_free(kv_gpu_engine *e)
{
    gl_graph *g = &e->gr;
    gl_graph_reset(e);
    cudaEvent_t *ev[] = {&g->ev_fork, &g->ev_fan, &g->ev_join[0], &g->ev_join[1], &g->ev_join[2]};
    for (size_t i = 0; i < sizeof ev / sizeof ev[0]; i++) {
        if (*ev[i]) cudaEventDestroy(*ev[i]);
        *ev[i] = NULL;
    }
}

kv_status gl_graph_grow_ws(kv_gpu_engine *e, size_t bytes)
{
    gl_graph *g = &e->gr;
    if (g->n_retired == (int)(sizeof g->retired / sizeof g->retired[0]))
        return kv_fail(KV_E_INTERNAL, "graph capture: the attention workspace grew too often");
    /* cudaMalloc is refused inside a capture unless the thread relaxes it;
     * it does not synchronise, and the old workspace may still be read by
     * an earlier step in flight, so it is freed only when the device idles */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    CK(cudaThreadExchangeStreamCaptureMode(&mode));
    void *p = NULL;
    cudaError_t ce = cudaMalloc(&p, bytes);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        return kv_fail(KV_E_NOMEM, "GPU out of memory: attention workspace needs %.1f MiB (%s)",
                       (double)bytes / 1048576.0, cudaGetErrorString(ce));
    }
    if (e->ws) g->retired[g->n_retired++] = e->ws;
    e->ws = p;
    e->ws_bytes = bytes;
    return KV_OK;
}

#define AUTO_STEP "auto: a step that returns its logits to the host runs kernel by kernel"

/* Why this step runs plainly, or NULL when it can be captured; generate:
 * the step is kv_gpu_engine_generate's (its argmax stays on the device). */
static const char *step_block(const kv_gpu_engine *e, bool generate)
{
    if (e->o.graph == KV_GPU_GRAPH_OFF) return "off";
    /* measured (docs/BENCHMARKS.md): when the host waits for every step, the
     * capture's host time comes before the GPU starts instead of under the
     * previous step, and the step is slower captured */
    if (e->o.graph == KV_GPU_GRAPH_AUTO && !generate) return AUTO_STEP;
    if (e->o.profile) return "profile: timing events are not recorded inside a graph";
    if (e->gr.steps == 1) return ""; /* the first step after a reset: launchers' one-time setup */
    for (int l = 0; l < e->L; l++) {
        const gl_layer *y = &e->lay[l];
        const char *why = y->pl->graph_block ? y->pl->graph_block(e, y, e->pos) : NULL;
        if (why) return why;
    }
    return NULL;
}

static kv_status plain_step(kv_gpu_engine *e, const int *dtok, bool want_logits, int *next)
{
    TRY(gl_decode_forward(e, dtok, want_logits));
    if (next) CK(eng_argmax(e->logits, e->vocab, next, e->s_main));
    return KV_OK;
}

/* The step inside the capture: side streams forked in first, joined at the end. */
static kv_status capture_body(kv_gpu_engine *e, const int *dtok, bool want_logits, int *next)
{
    gl_graph *g = &e->gr;
    cudaStream_t side[3] = {e->s_side, e->s_gath, e->s_copy};
    CK(cudaEventRecord(g->ev_fork, e->s_main));
    for (int i = 0; i < 3; i++) CK(cudaStreamWaitEvent(side[i], g->ev_fork, 0));
    /* offload: the staging buffers' last readers were earlier steps, all
     * done before this graph starts */
    for (int i = 0; e->off.n && i < 2; i++) CK(cudaEventRecord(e->off.ev_done[i], e->s_main));
    TRY(plain_step(e, dtok, want_logits, next));
    for (int i = 0; i < 3; i++) {
        CK(cudaEventRecord(g->ev_join[i], side[i]));
        CK(cudaStreamWaitEvent(e->s_main, g->ev_join[i], 0));
    }
    return KV_OK;
}

kv_status gl_memcpy_2d(kv_gpu_engine *e, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t height, enum cudaMemcpyKind kind, cudaStream_t s)
{
    if (!e->gr.capturing) {
        CK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, s));
        return KV_OK;
    }
    for (size_t r = 0; r < height; r++)
        CK(cudaMemcpyAsync((char *)dst + r * dpitch, (const char *)src + r * spitch, width, kind, s));
    return KV_OK;
}

/* A graph's shape: its node count and node types (FNV-1a), so that a
 * capture of another shape goes straight to a new executable instead of a
 * cudaGraphExecUpdate that must fail. */
static uint64_t graph_sig(cudaGraph_t graph)
{
    size_t n = 0;
    if (cudaGraphGetNodes(graph, NULL, &n) != cudaSuccess) return (void)cudaGetLastError(), 0;
    uint64_t h = (1469598103934665603ull ^ (uint64_t)n) * 1099511628211ull;
    cudaGraphNode_t *nodes = n ? malloc(n * sizeof *nodes) : NULL;
    if (nodes && cudaGraphGetNodes(graph, nodes, &n) == cudaSuccess) {
        for (size_t i = 0; i < n; i++) { /* creation order: the order of the capture */
            enum cudaGraphNodeType t = cudaGraphNodeTypeEmpty;
            if (cudaGraphNodeGetType(nodes[i], &t) != cudaSuccess) (void)cudaGetLastError();
            h = (h ^ (uint64_t)t) * 1099511628211ull;
        }
    } else {
        (void)cudaGetLastError(); /* the count alone */
    }
    free(nodes);
    return h;
}

/* The captured graph into exec[cur]: updated in place when it has the shape
 * that exec holds, else instantiated anew. */
static kv_status install(gl_graph *g, cudaGraph_t graph)
{
    cudaGraphExec_t *x = &g->exec[g->cur];
    const uint64_t sig = graph_sig(graph);
    if (*x && sig == g->sig[g->cur] && sig != g->no_update_sig) {
        cudaGraphExecUpdateResultInfo info;
        memset(&info, 0, sizeof info);
        if (cudaGraphExecUpdate(*x, graph, &info) == cudaSuccess) {
            g->updated++;
            return KV_OK;
        }
        (void)cudaGetLastError();
        g->refused++;
        g->refused_result = (int)info.result;
        g->no_update_sig = sig; /* a change the update does not take: do not try this shape again */
    }
    if (*x) {
        cudaGraphExecDestroy(*x); /* one in flight is freed when it completes */
        *x = NULL;
    }
    g->sig[g->cur] = sig;
    /* node priorities as captured: the selection streams' kernels outrank the main stream's */
    CK(cudaGraphInstantiate(x, graph, cudaGraphInstantiateFlagUseNodePriority));
    g->instantiated++;
    return KV_OK;
}

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

kv_status gl_graph_step(kv_gpu_engine *e, const int *dtok, bool want_logits, int *next)
{
    gl_graph *g = &e->gr;
    g->steps++;
    const char *why = step_block(e, next != NULL);
    if (why) {
        if (*why) snprintf(g->plain_why, sizeof g->plain_why, "%s", why);
        return plain_step(e, dtok, want_logits, next);
    }
    const double t0 = now_us();
    cudaStream_t side[3] = {e->s_side, e->s_gath, e->s_copy};
    /* the side streams' earlier (plain) work before the graph */
    for (int i = 0; i < 3; i++) {
        CK(cudaEventRecord(g->ev_join[i], side[i]));
        CK(cudaStreamWaitEvent(e->s_main, g->ev_join[i], 0));
    }
    CK(cudaStreamBeginCapture(e->s_main, cudaStreamCaptureModeThreadLocal));
    g->capturing = true;
    kv_status st = capture_body(e, dtok, want_logits, next);
    cudaGraph_t graph = NULL;
    cudaError_t ce = cudaStreamEndCapture(e->s_main, &graph);
    g->capturing = false;
    if (st || ce != cudaSuccess) {
        if (graph) cudaGraphDestroy(graph);
        if (st) return st;
        return kv_cuda_fail(ce, "cudaStreamEndCapture(e->s_main, &graph)", __FILE__, __LINE__);
    }
    st = install(g, graph);
    cudaGraphDestroy(graph);
    TRY(st);
    CK(cudaGraphLaunch(g->exec[g->cur], e->s_main));
    g->cur ^= 1;
    /* the offload staging events were last recorded inside the capture; a
     * later plain step (or the batch driver) waits on them outside one, so
     * record them again after the graph's work */
    for (int i = 0; e->off.n && i < 2; i++) CK(cudaEventRecord(e->off.ev_done[i], e->s_main));
    /* later plain work on the side streams after the graph */
    CK(cudaEventRecord(g->ev_fan, e->s_main));
    for (int i = 0; i < 3; i++) CK(cudaStreamWaitEvent(side[i], g->ev_fan, 0));
    g->captured++;
    g->host_us += now_us() - t0;
    return KV_OK;
}

void kv_gpu_engine_graph_info(const kv_gpu_engine *e, kv_gpu_graph_info *gi)
{
    const gl_graph *g = &e->gr;
    memset(gi, 0, sizeof *gi);
    gi->on = e->o.graph != KV_GPU_GRAPH_OFF;
    gi->steps = g->steps;
    gi->captured = g->captured;
    gi->updated = g->updated;
    gi->instantiated = g->instantiated;
    gi->refused = g->refused;
    gi->refused_result = g->refused_result;
    gi->host_us = g->captured ? g->host_us / (double)g->captured : 0;
    snprintf(gi->plain_why, sizeof gi->plain_why, "%s", g->plain_why);
    /* the first step after a reset runs plainly without a reason: not a fallback */
    if (!gi->on) snprintf(gi->state, sizeof gi->state, "off");
    else if (!g->captured && !strcmp(g->plain_why, AUTO_STEP))
        snprintf(gi->state, sizeof gi->state, "off (auto): steps that return logits to the host run kernel "
                 "by kernel (measured faster)");
    else if (!g->captured && !g->plain_why[0])
        snprintf(gi->state, sizeof gi->state, "on (no step captured yet)");
    else if (!g->plain_why[0]) snprintf(gi->state, sizeof gi->state, "captured");
    else if (!g->captured) snprintf(gi->state, sizeof gi->state, "fallback: %.200s", g->plain_why);
    else
        snprintf(gi->state, sizeof gi->state, "captured, %llu of %llu steps plain: %.160s",
                 (unsigned long long)(g->steps - g->captured), (unsigned long long)g->steps,
                 g->plain_why);
}

#endif /* KV_HAVE_CUDA */
