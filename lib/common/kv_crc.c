/*
 * kv_crc: CRC-32C (Castagnoli), the checksum of every .kvc tensor and tree
 * chunk: SSE4.2 when the CPU has it, else a portable slicing-by-8 table.
 */
#include "common/kv_crc.h"

#include <pthread.h>
#include <string.h>

/* Portable path: slicing-by-8 over the reflected Castagnoli polynomial,
 * eight table lookups per 8 bytes (about 1 GB/s). */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

uint32_t kv_crc32c_sw(uint32_t crc, const void *buf, size_t n)
{
    pthread_once(&crc_once, crc_init);
    const uint8_t *p = buf;
    uint32_t c = ~crc;
    while (n && ((uintptr_t)p & 7u)) {
        c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c; /* little-endian: the low 4 bytes meet the running CRC */
        c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^
            crc_table[5][(w >> 16) & 0xff] ^ crc_table[4][(w >> 24) & 0xff] ^
            crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
            crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* SSE4.2 has a CRC-32C instruction (8 bytes per ~3 cycles): several times
 * the table's speed, which matters for multi-GB caches.  Chosen at run time,
 * so the binary still runs on CPUs without it. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    uint64_t c = ~crc;
    while (n && ((uintptr_t)p & 7u)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

/* The instruction's latency is three times its issue interval, so one
 * running CRC uses a third of it: a large buffer is taken as three equal
 * parts in one interleaved loop and the parts' CRCs combined (two
 * combinations, ~1.5 us, against ~8 us per 64 KiB on one lane). */
#define CRC_LANES_MIN ((size_t)64 << 10)
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw3(uint32_t crc, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    const size_t part = n / 3 & ~(size_t)7;
    const uint8_t *p1 = p + part, *p2 = p + 2 * part;
    uint64_t a = ~crc, b = 0xffffffffu, c = 0xffffffffu;
    for (size_t i = 0; i < part; i += 8) {
        uint64_t wa, wb, wc;
        memcpy(&wa, p + i, 8);
        memcpy(&wb, p1 + i, 8);
        memcpy(&wc, p2 + i, 8);
        a = __builtin_ia32_crc32di(a, wa);
        b = __builtin_ia32_crc32di(b, wb);
        c = __builtin_ia32_crc32di(c, wc);
    }
    uint32_t ca = ~(uint32_t)a, cb = ~(uint32_t)b;
    uint32_t cc = crc32c_hw(~(uint32_t)c, p2 + part, n - 3 * part); /* the third part's tail */
    return kv_crc32c_combine(kv_crc32c_combine(ca, cb, part), cc, n - 2 * part);
}

uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n)
{
    /* __builtin_cpu_supports reads a table filled before main: cheap, no race. */
    if (!__builtin_cpu_supports("sse4.2")) return kv_crc32c_sw(crc, buf, n);
    return n >= CRC_LANES_MIN ? crc32c_hw3(crc, buf, n) : crc32c_hw(crc, buf, n);
}
#else
uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n) { return kv_crc32c_sw(crc, buf, n); }
#endif

/* Products in GF(2)[x] modulo the Castagnoli polynomial, in the reflected
 * order the CRC keeps its remainder in (bit 31 the coefficient of x^0):
 * a times b, b shifted up one power of x per coefficient of a. */
#define CRC32C_POLY 0x82f63b78u
static uint32_t gf2_mulmod(uint32_t a, uint32_t b)
{
    uint32_t p = 0;
    for (int i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) p ^= b;
        b = (b & 1u) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

static uint32_t crc_shift(uint64_t len);

uint32_t kv_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    /* appending len_b bytes multiplies A's remainder by x^(8 len_b); the
     * pre- and post-inversions of both CRCs cancel in the sum */
    /* the last length's shift kept per thread: a reader combining many
     * pieces of one size (a frame's tensors) computes it once */
    static _Thread_local uint64_t last_len = 0;
    static _Thread_local uint32_t last_x = 0x80000000u;
    if (len_b != last_len) last_x = crc_shift(len_b), last_len = len_b;
    return gf2_mulmod(last_x, crc_a) ^ crc_b;
}

/* x^(8 len) modulo the polynomial (what appending len bytes multiplies a
 * remainder by), for kv_crc32c_combine and kv_crc32c_iov. */
static uint32_t crc_shift(uint64_t len)
{
    uint32_t xn = 0x80000000u, sq = 0x00800000u; /* x^0, x^8 */
    for (uint64_t n = len; n; n >>= 1) {
        if (n & 1u) xn = gf2_mulmod(xn, sq);
        sq = gf2_mulmod(sq, sq);
    }
    return xn;
}

