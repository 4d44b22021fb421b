/*
 * lib/common/kv_status.c: details recorded by kv_fail and kv_errcontext
 * carry no control character (C0, DEL, C1, invalid UTF-8 are written as
 * \xNN) while printable UTF-8 passes unchanged; escaping is idempotent and
 * never overruns the buffer or cuts a character in two.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt.h"
#include "common/kv_status.h"
#include "common/kv_text.h"

static int has_control(const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if (*p < 0x20 || *p == 0x7f || *p == 0x9b) return 1;
    return 0;
}

static void test_details_escape_control_characters(void)
{
    /* an OSC title change and a CSI colour, as a metadata key might hold */
    kv_fail(KV_E_DATA, "metadata key '%s': bad", "\x1b]0;pwned\x07\x1b[31mred\r\n\t\x7f");
    KT_CHECK(!has_control(kv_errdetail()), "control bytes in '%s'", kv_errdetail());
    KT_CHECK(!strcmp(kv_errdetail(), "metadata key '\\x1b]0;pwned\\x07\\x1b[31mred\\x0d\\x0a\\x09\\x7f': bad"),
             "'%s'", kv_errdetail());
    /* C1 CSI as UTF-8 (U+009B), a lone 0x9b, an overlong '/', a surrogate */
    kv_fail(KV_E_DATA, "%s|%s|%s|%s", "\xc2\x9b", "\x9b", "\xc0\xaf", "\xed\xa0\x80");
    KT_CHECK(!strcmp(kv_errdetail(), "\\xc2\\x9b|\\x9b|\\xc0\\xaf|\\xed\\xa0\\x80"), "'%s'", kv_errdetail());
    /* printable UTF-8 and backslashes are kept as they are */
    const char *ok = "caf\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x99\x82 a\\x1b \xc2\xa0";
    kv_fail(KV_E_DATA, "%s", ok);
    KT_CHECK(!strcmp(kv_errdetail(), ok), "'%s'", kv_errdetail());
    /* context prefixes are escaped too, and the old detail is not escaped twice */
    kv_fail(KV_E_DATA, "inner \x1b");
    kv_errcontext("file %s", "a\x1b" "b");
    KT_CHECK(!strcmp(kv_errdetail(), "file a\\x1bb: inner \\x1b"), "'%s'", kv_errdetail());
}

static void test_escaping_stays_inside_the_buffer(void)
{
    char big[2000], out[64];
    memset(big, 0x1b, sizeof big - 1);
    big[sizeof big - 1] = 0;
    size_t n = kv_escape_controls(out, sizeof out, big);
    KT_CHECK(n < sizeof out && n % 4 == 0 && strlen(out) == n, "length %zu", n);
    /* a 4-byte character at the end is dropped whole, not cut */
    char s[64];
    memset(s, 'a', 60);
    memcpy(s + 60, "\xf0\x9f\x99\x82", 4);
    s[63] = 0; /* the emoji cut in the source: invalid bytes, whose escapes do not fit */
    n = kv_escape_controls(out, sizeof out, s);
    KT_CHECK(n == 60 && !has_control(out), "cut source: %zu", n);
    kv_fail(KV_E_DATA, "%s", big); /* far longer than the detail buffer */
    KT_CHECK(strlen(kv_errdetail()) < 512 && !has_control(kv_errdetail()), "long detail");
}

/* kv_text grows across its doubling steps, keeps NUL bytes and a
 * terminating NUL, and refuses a size that would wrap with t unchanged. */
static void test_text_grows_and_refuses_a_wrapping_size(void)
{
    kv_text t = {0};
    char piece[100];
    for (int i = 0; i < 100; i++) piece[i] = (char)(i % 7 ? 'a' + i % 26 : 0);
    kv_status st = KV_OK;
    for (int r = 0; r < 50 && !st; r++) st = kv_text_add(&t, piece, sizeof piece, "text");
    KT_CHECK(st == KV_OK, "add: %s", kv_errdetail());
    KT_CHECK(t.n == 5000 && t.cap >= 5001 && t.s[5000] == 0, "n %zu cap %zu", t.n, t.cap);
    int same = 1;
    for (size_t i = 0; i < t.n; i++) same &= t.s[i] == piece[i % 100];
    KT_CHECK(same, "bytes kept, NULs included");
    kv_text before = t;
    KT_CHECK(kv_text_add(&t, piece, SIZE_MAX - 8, "huge") == KV_E_NOMEM && strstr(kv_errdetail(), "huge"),
             "a wrapping size: %s", kv_errdetail());
    KT_CHECK(t.s == before.s && t.n == before.n && t.cap == before.cap, "t unchanged after a refusal");
    free(t.s);
}

int main(void)
{
    KT_RUN(test_details_escape_control_characters);
    KT_RUN(test_escaping_stays_inside_the_buffer);
    KT_RUN(test_text_grows_and_refuses_a_wrapping_size);
    return kt_done();
}
