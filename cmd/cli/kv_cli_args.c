/*
 * The shared front end, continued: option values (integers, numbers, byte
 * counts, devices, clocks), operands, terminal checks and the progress line
 * (kv_cli.c has the option parser, --help and messages).
 */
#include "kv_cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

long kv_cli_long(const char *opt, const char *s, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        kv_cli_usage_error("%s expects an integer in [%ld, %ld], got '%s'", opt, lo, hi, s);
    return v;
}

double kv_cli_double(const char *opt, const char *s, double lo, double hi)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < lo || v > hi)
        kv_cli_usage_error("%s expects a number in [%g, %g], got '%s'", opt, lo, hi, s);
    return v;
}

uint64_t kv_cli_bytes(const char *opt, const char *s)
{
    char *end;
    errno = 0;
    /* it starts with a digit: strtoull skips blanks and takes "-1" as 2^64-1 */
    if (!isdigit((unsigned char)*s)) kv_cli_usage_error("%s expects a byte count, got '%s'", opt, s);
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) kv_cli_usage_error("%s expects a byte count, got '%s'", opt, s);
    unsigned sh = 0;
    switch (toupper((unsigned char)*end)) {
    case 0: break;
    case 'K': sh = 10; break;
    case 'M': sh = 20; break;
    case 'G': sh = 30; break;
    case 'T': sh = 40; break;
    default: kv_cli_usage_error("%s expects a byte count (suffix K, M, G, T), got '%s'", opt, s);
    }
    if (*end && end[1] && strcmp(end + 1, "iB") && strcmp(end + 1, "B"))
        kv_cli_usage_error("%s expects a byte count (suffix K, M, G, T), got '%s'", opt, s);
    if (sh && v > (~0ull >> sh)) kv_cli_usage_error("%s: '%s' is too large", opt, s);
    return (uint64_t)v << sh;
}

kv_device kv_cli_device(const char *s, int *ordinal)
{
    kv_device d;
    if (kv_device_parse(s, &d, ordinal))
        kv_cli_usage_error("--device must be cpu, cuda or auto (or cuda:N, N for a CUDA device), got '%s'", s);
    return d;
}

bool kv_is_tty(FILE *f) { return isatty(fileno(f)) == 1; }

bool kv_color_ok(FILE *f)
{
    const char *nc = getenv("NO_COLOR");
    return kv_is_tty(f) && !(nc && nc[0]);
}

bool kv_want_json(FILE *f, bool json_flag) { return json_flag || !kv_is_tty(f); }

void kv_refuse_binary_tty(FILE *f, const char *what)
{
    if (kv_is_tty(f))
        kv_die(KV_EXIT_USAGE, "refusing to write %s to a terminal (redirect or use -o FILE)", what);
}

static bool progress_shown;
static struct timespec progress_last;

void kv_progress(const char *fmt, ...)
{
    bool on = kv_progress_mode == 1 || (kv_progress_mode == -1 && kv_is_tty(stderr));
    if (!on || kv_verbosity < 0) return;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double dt = (double)(now.tv_sec - progress_last.tv_sec) +
                (double)(now.tv_nsec - progress_last.tv_nsec) * 1e-9;
    if (progress_shown && dt < 0.25) return;
    progress_last = now;
    /* escaped like every message: the line names input files and samples */
    char raw[1024], out[4 * sizeof raw];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    kv_escape_controls(out, sizeof out, raw);
    fprintf(stderr, "\r%s: %s\033[K", kv_progname(), out);
    progress_shown = true;
}

void kv_progress_done(void)
{
    if (!progress_shown) return;
    fputs("\r\033[K", stderr);
    progress_shown = false;
}

int64_t kv_cli_clock(const char *env)
{
    const char *e = getenv(env);
    if (e && *e) return (int64_t)kv_cli_long(env, e, 0, 1L << 40);
    return (int64_t)time(NULL);
}

const char *kv_cli_operand(int argc, char **argv, int *i, const char *what)
{
    if (*i >= argc) kv_cli_usage_error("missing %s", what);
    return argv[(*i)++];
}

void kv_cli_no_more(int argc, char **argv, int i)
{
    if (i < argc) kv_cli_usage_error("unexpected argument '%s'", argv[i]);
}
