/*
 * Unit tests of lib/common/kv_file.c, the one whole-file reader behind prompts,
 * token lists, tokenizers, deploy configs and store indexes: fresh random
 * contents of sizes around its buffer doublings come back byte for byte
 * with a NUL after them, and each bad input gets its own status (a missing
 * file or a directory is "no input", a file over the limit is bad data).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kt.h"
#include "common/kv_file.h"

static unsigned long long seed;
static char dir[64];

static void path_of(char *p, size_t n, const char *name) { snprintf(p, n, "%s/%s", dir, name); }

static void test_random_contents_round_trip(void)
{
    /* Sizes at and around the 4096-byte first buffer and its doublings,
       where an off-by-one in the NUL slot would show. */
    const size_t sizes[] = {0, 1, 4094, 4095, 4096, 4097, 8191, 8192, 70000};
    char p[128];
    path_of(p, sizeof p, "r.bin");
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        unsigned char *want = malloc(n + 1);
        KT_REQUIRE(want, "malloc");
        for (size_t j = 0; j < n; j++) want[j] = (unsigned char)(kt_rand(&seed) * 256);
        FILE *f = fopen(p, "wb");
        KT_REQUIRE(f && fwrite(want, 1, n, f) == n && fclose(f) == 0, "write %s", p);
        char *got = NULL;
        size_t len = 99;
        kv_status st = kv_file_slurp(p, 0, "test", &got, &len);
        KT_CHECK(st == KV_OK, "size %zu: %s", n, kv_errdetail());
        KT_CHECK(len == n, "size %zu: read %zu", n, len);
        KT_CHECK(got && memcmp(got, want, n) == 0, "size %zu: contents differ", n);
        KT_CHECK(got && got[n] == 0, "size %zu: no NUL after the data", n);
        free(got);
        free(want);
    }
    unlink(p);
}

static void test_bad_inputs_get_their_own_status(void)
{
    char p[128], *buf = (char *)1;
    size_t len;
    path_of(p, sizeof p, "missing");
    KT_CHECK(kv_file_slurp(p, 0, "prompt", &buf, &len) == KV_E_NOINPUT, "missing file");
    KT_CHECK(buf == NULL, "buffer not cleared on failure");
    KT_CHECK(strstr(kv_errdetail(), "prompt") != NULL, "message lacks 'what': %s", kv_errdetail());

    KT_CHECK(kv_file_slurp(dir, 0, "tokenizer", &buf, &len) == KV_E_NOINPUT, "directory");
    KT_CHECK(strstr(kv_errdetail(), "is a directory") != NULL, "%s", kv_errdetail());

    path_of(p, sizeof p, "big");
    FILE *f = fopen(p, "wb");
    KT_REQUIRE(f, "create %s", p);
    for (int i = 0; i < 5000; i++) fputc('x', f);
    fclose(f);
    KT_CHECK(kv_file_slurp(p, 4999, NULL, &buf, &len) == KV_E_DATA, "over the limit");
    KT_CHECK(buf == NULL, "buffer kept after a limit failure");
    KT_CHECK(kv_file_slurp(p, 5000, NULL, &buf, &len) == KV_OK && len == 5000, "at the limit");
    free(buf);
    unlink(p);
}

int main(void)
{
    seed = (unsigned long long)time(NULL) | 1;
    printf("# seed %llu\n", seed);
    snprintf(dir, sizeof dir, "/tmp/kv-test-file-XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    KT_RUN(test_random_contents_round_trip);
    KT_RUN(test_bad_inputs_get_their_own_status);
    rmdir(dir);
    return kt_done();
}
