/*
 * libFuzzer target for chat prompts (lib/model/kv_chat.c): the input is
 * "template\0architecture\0flags-byte user text"; the template selection
 * runs on it, and the user text is wrapped in the Llama-3 format on the
 * real Llama-3 vocabulary (loaded once), with and without special tokens,
 * in ChatML, and in the architecture text taken as a template of one's
 * own when it holds {prompt}; the dense split of each is taken too.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/kv_chat.h"
#include "model/kv_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size + 3);
    if (!buf) return 0;
    memcpy(buf, data, size);
    buf[size] = buf[size + 1] = buf[size + 2] = 0;
    const char *tpl = buf;
    const char *arch = tpl + strlen(tpl) + 1;
    const char *rest = arch + strlen(arch) + 1;
    size_t off = (size_t)(rest - buf);
    unsigned flags = off < size ? (unsigned char)rest[0] : 0;
    const char *user = off < size ? rest + 1 : "";
    size_t ulen = off + 1 < size ? size - off - 1 : 0;
    kv_chat_kind k;
    kv_chat_pick_from(flags & 4 ? NULL : tpl, flags & 8 ? NULL : arch, flags & 1, flags & 2, &k);
    static kv_tokenizer *l3;
    static int tried;
    if (!tried) {
        tried = 1;
        if (kv_tokenizer_load_gguf("tests/data/gguf/llama3-vocab.gguf", &l3)) l3 = NULL;
    }
    if (l3) {
        int *ids = NULL, n = 0;
        const kv_chat l3c = {flags & 16 ? KV_CHAT_AUTO : KV_CHAT_LLAMA3, NULL};
        if (kv_chat_encode(l3, &l3c, flags & 32 ? tpl : NULL, user, ulen, flags & 64, &ids, &n) == KV_OK) {
            int split;
            kv_chat_split(l3, &l3c, flags & 32 ? tpl : NULL, user, ulen / 2, flags & 64, ids, n, &split);
            free(ids);
        }
        if (kv_chat_encode(l3, &(kv_chat){KV_CHAT_CHATML, NULL}, NULL, user, ulen, false, &ids, &n) == KV_OK) free(ids);
        /* a template of one's own: the architecture text, when it holds {prompt} */
        kv_chat own;
        if (kv_chat_parse(arch, &own) == KV_OK && own.kind == KV_CHAT_TEMPLATE &&
            kv_chat_encode(l3, &own, NULL, user, ulen, flags & 64, &ids, &n) == KV_OK) {
            int split;
            kv_chat_split(l3, &own, NULL, user, ulen / 3, flags & 64, ids, n, &split);
            free(ids);
        }
    }
    free(buf);
    return 0;
}
