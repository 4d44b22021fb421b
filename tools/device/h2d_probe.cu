/*
 * h2d_probe: why does the host tier's upload sometimes run at a third of
 * PCIe speed?  (issue 11, session 14: kv-bench prefix's host mode was
 * bimodal, 14-15 ms or 24 ms of compute for the same 455 MB of pinned rows.)
 *
 * Copies pinned host buffers shaped like the host tier's entries (one per
 * layer and K/V: nkv rows of n * hd fp16, copied with cudaMemcpy2DAsync
 * into a dense cache of pitch ld) and prints the rate of each round:
 *   A  the same 64 buffers, 12 rounds, 20 ms apart;
 *   B  fresh buffers allocated and filled by a thread pinned to each CPU in
 *      turn (the NUMA node of the first touch), copied from CPU 0's thread;
 *   C  one 455 MB allocation instead of 64;
 *   D  A's buffers while another thread writes and fsyncs a 512 MB file.
 * Also prints the NUMA nodes and the GPU's node from sysfs.
 * Build: nvcc -O2 -arch=sm_90 -o h2d_probe tools/device/h2d_probe.cu -lpthread
 * Run:   ./h2d_probe [scratch-dir]      (a measurement tool, not a test)
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cuda_runtime.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "h2d_probe: %s: %s\n", #x, cudaGetErrorString(e_));                    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

enum { L = 32, NKV = 8, HD = 128, N = 3470, LD = 3930, NB = 2 * L };
static const size_t BUF = (size_t)NKV * N * HD * 2;

static void cat(const char *path)
{
    char b[256] = {0};
    FILE *f = fopen(path, "r");
    if (!f) {
        printf("  %s: (none)\n", path);
        return;
    }
    if (!fgets(b, sizeof b, f)) b[0] = 0;
    fclose(f);
    b[strcspn(b, "\n")] = 0;
    printf("  %s: %s\n", path, b);
}

static void topology(void)
{
    DIR *d = opendir("/sys/devices/system/node");
    int nodes = 0;
    struct dirent *x;
    while (d && (x = readdir(d)))
        if (!strncmp(x->d_name, "node", 4) && x->d_name[4] >= '0' && x->d_name[4] <= '9') {
            char p[300];
            snprintf(p, sizeof p, "/sys/devices/system/node/%s/cpulist", x->d_name);
            cat(p);
            nodes++;
        }
    if (d) closedir(d);
    printf("numa nodes: %d, cpus online: %ld, this thread on cpu %d\n", nodes, sysconf(_SC_NPROCESSORS_ONLN),
           sched_getcpu());
    char bus[64], p[300];
    CK(cudaDeviceGetPCIBusId(bus, sizeof bus, 0));
    for (char *c = bus; *c; c++)
        if (*c >= 'A' && *c <= 'F') *c += 32;
    printf("gpu 0 at %s\n", bus);
    snprintf(p, sizeof p, "/sys/bus/pci/devices/%s/numa_node", bus);
    cat(p);
    snprintf(p, sizeof p, "/sys/bus/pci/devices/%s/local_cpulist", bus);
    cat(p);
    snprintf(p, sizeof p, "/sys/bus/pci/devices/%s/current_link_speed", bus);
    cat(p);
    snprintf(p, sizeof p, "/sys/bus/pci/devices/%s/current_link_width", bus);
    cat(p);
    cat("/sys/kernel/mm/transparent_hugepage/enabled");
}

static uint16_t *dk;
static cudaStream_t s;
static cudaEvent_t a, b;

/* all NB buffers into the dense cache (two alternating layer pairs, as the engine) */
static double round_gbs(uint16_t *const *h)
{
    float ms;
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < NB; i++)
        CK(cudaMemcpy2DAsync(dk + (size_t)(i & 3) * NKV * LD * HD, (size_t)LD * HD * 2, h[i], (size_t)N * HD * 2,
                             (size_t)N * HD * 2, NKV, cudaMemcpyHostToDevice, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    CK(cudaEventElapsedTime(&ms, a, b));
    return (double)NB * BUF / (ms * 1e6);
}

static void pin_to(int cpu)
{
    cpu_set_t m;
    CPU_ZERO(&m);
    CPU_SET(cpu, &m);
    sched_setaffinity(0, sizeof m, &m);
}

typedef struct {
    int cpu;
    uint16_t **h;
} alloc_job;

static void *alloc_on(void *p)
{
    alloc_job *j = (alloc_job *)p;
    pin_to(j->cpu);
    CK(cudaSetDevice(0));
    for (int i = 0; i < NB; i++) {
        CK(cudaHostAlloc((void **)&j->h[i], BUF, cudaHostAllocPortable));
        memset(j->h[i], 0x3c, BUF);
    }
    return NULL;
}

static const char *scratch = "/tmp";
static volatile int writing;

static void *writer(void *p)
{
    (void)p;
    char path[512];
    snprintf(path, sizeof path, "%s/h2d_probe.tmp", scratch);
    size_t n = (size_t)512 << 20, chunk = (size_t)8 << 20;
    char *buf = (char *)malloc(chunk);
    memset(buf, 7, chunk);
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    for (size_t w = 0; fd >= 0 && w < n; w += chunk)
        if (write(fd, buf, chunk) != (ssize_t)chunk) break;
    if (fd >= 0) fsync(fd), close(fd);
    unlink(path);
    free(buf);
    writing = 0;
    return NULL;
}

static void sleep_ms(int ms)
{
    struct timespec t = {0, ms * 1000000L};
    nanosleep(&t, NULL);
}

int main(int argc, char **argv)
{
    if (argc > 1) scratch = argv[1];
    pin_to(0);
    topology();
    CK(cudaSetDevice(0));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaMalloc((void **)&dk, (size_t)4 * NKV * LD * HD * 2));
    uint16_t *h[NB];
    alloc_job j0 = {0, h};
    alloc_on(&j0);
    pin_to(0);
    round_gbs(h);
    printf("A same buffers (GB/s):");
    for (int r = 0; r < 12; r++, sleep_ms(20)) printf(" %.1f", round_gbs(h));
    printf("\n");
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    for (int c = 0; c < ncpu; c += (ncpu > 8 ? ncpu / 8 : 1)) {
        uint16_t *g[NB];
        alloc_job j = {c, g};
        pthread_t t;
        pthread_create(&t, NULL, alloc_on, &j);
        pthread_join(t, NULL);
        double r1 = round_gbs(g), r2 = round_gbs(g);
        printf("B first touch on cpu %2d: %.1f %.1f GB/s\n", c, r1, r2);
        for (int i = 0; i < NB; i++) CK(cudaFreeHost(g[i]));
    }
    {
        uint16_t *big, *g[NB];
        CK(cudaHostAlloc((void **)&big, BUF * NB, cudaHostAllocPortable));
        memset(big, 0x3c, BUF * NB);
        for (int i = 0; i < NB; i++) g[i] = big + (size_t)i * BUF / 2;
        printf("C one allocation (GB/s):");
        for (int r = 0; r < 6; r++) printf(" %.1f", round_gbs(g));
        printf("\n");
        CK(cudaFreeHost(big));
    }
    {
        pthread_t t;
        writing = 1;
        pthread_create(&t, NULL, writer, NULL);
        printf("D during a 512 MB write+fsync (GB/s):");
        for (int r = 0; r < 40 && writing; r++) printf(" %.1f", round_gbs(h));
        pthread_join(t, NULL);
        printf("\n");
    }
    printf("A again (GB/s):");
    for (int r = 0; r < 6; r++) printf(" %.1f", round_gbs(h));
    printf("\n");
    return 0;
}
