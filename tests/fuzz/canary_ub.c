/*
 * The canary of the sanitizer builds, not a fuzz target of the library:
 * an input starting with 'U' converts an out-of-range float to an integer
 * (undefined behaviour, UBSan's float-cast-overflow), one starting with 'A'
 * reads past a heap block.  make check builds it with the fuzzers' flags
 * and with the ASan unit tests' and tools' flags, runs it on such inputs
 * and counts a failure unless the program dies of the report: without
 * -fno-sanitize-recover=all a UBSan finding was printed and the run went
 * on, so no sanitizer finding could ever fail make check.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

volatile int canary_sink; /* keeps the reads */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= 5 && data[0] == 'U') {
        float f;
        memcpy(&f, data + 1, 4);
        canary_sink = (int)f; /* 1e30f: outside int */
    } else if (size >= 1 && data[0] == 'A') {
        char *p = malloc(size);
        if (p) {
            memcpy(p, data, size);
            canary_sink = p[size]; /* one past the block */
            free(p);
        }
    }
    return 0;
}

#ifdef CANARY_MAIN
int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        uint8_t b[64];
        size_t n = f ? fread(b, 1, sizeof b, f) : 0;
        if (f) fclose(f);
        LLVMFuzzerTestOneInput(b, n);
    }
    return 0;
}
#endif
