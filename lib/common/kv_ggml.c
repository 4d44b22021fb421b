/*
 * kv_ggml: the table of ggml tensor types (names and block sizes, see
 * kv_ggml.h).  Types this project does not compute with are still named
 * and sized, so that a GGUF holding them parses and the refusal names the
 * type ("IQ2_XS") instead of a number.
 */
#include "common/kv_ggml.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

static const kv_ggml_type_info types[KV_GGML_TYPE_LIMIT] = {
    [KV_GGML_F32] = {"F32", 1, 4},
    [KV_GGML_F16] = {"F16", 1, 2},
    [KV_GGML_Q4_0] = {"Q4_0", 32, 18},
    [KV_GGML_Q4_1] = {"Q4_1", 32, 20},
    [4] = {"Q4_2", 0, 0}, /* retired */
    [5] = {"Q4_3", 0, 0}, /* retired */
    [KV_GGML_Q5_0] = {"Q5_0", 32, 22},
    [KV_GGML_Q5_1] = {"Q5_1", 32, 24},
    [KV_GGML_Q8_0] = {"Q8_0", 32, 34},
    [KV_GGML_Q8_1] = {"Q8_1", 32, 36},
    [KV_GGML_Q2_K] = {"Q2_K", 256, 84},
    [KV_GGML_Q3_K] = {"Q3_K", 256, 110},
    [KV_GGML_Q4_K] = {"Q4_K", 256, 144},
    [KV_GGML_Q5_K] = {"Q5_K", 256, 176},
    [KV_GGML_Q6_K] = {"Q6_K", 256, 210},
    [KV_GGML_Q8_K] = {"Q8_K", 256, 292},
    [KV_GGML_IQ2_XXS] = {"IQ2_XXS", 256, 66},
    [KV_GGML_IQ2_XS] = {"IQ2_XS", 256, 74},
    [KV_GGML_IQ3_XXS] = {"IQ3_XXS", 256, 98},
    [KV_GGML_IQ1_S] = {"IQ1_S", 256, 50},
    [KV_GGML_IQ4_NL] = {"IQ4_NL", 32, 18},
    [KV_GGML_IQ3_S] = {"IQ3_S", 256, 110},
    [KV_GGML_IQ2_S] = {"IQ2_S", 256, 82},
    [KV_GGML_IQ4_XS] = {"IQ4_XS", 256, 136},
    [KV_GGML_I8] = {"I8", 1, 1},
    [KV_GGML_I16] = {"I16", 1, 2},
    [KV_GGML_I32] = {"I32", 1, 4},
    [KV_GGML_I64] = {"I64", 1, 8},
    [KV_GGML_F64] = {"F64", 1, 8},
    [KV_GGML_IQ1_M] = {"IQ1_M", 256, 56},
    [KV_GGML_BF16] = {"BF16", 1, 2},
    [31] = {"Q4_0_4_4", 0, 0}, /* retired repacked layouts */
    [32] = {"Q4_0_4_8", 0, 0},
    [33] = {"Q4_0_8_8", 0, 0},
    [KV_GGML_TQ1_0] = {"TQ1_0", 256, 54},
    [KV_GGML_TQ2_0] = {"TQ2_0", 256, 66},
    [36] = {"IQ4_NL_4_4", 0, 0},
    [37] = {"IQ4_NL_4_8", 0, 0},
    [38] = {"IQ4_NL_8_8", 0, 0},
    [KV_GGML_MXFP4] = {"MXFP4", 32, 17},
};

const kv_ggml_type_info *kv_ggml_type_info_of(uint32_t type)
{
    return type < KV_GGML_TYPE_LIMIT && types[type].name ? &types[type] : NULL;
}

const char *kv_ggml_type_name(uint32_t type, char *buf)
{
    const kv_ggml_type_info *t = kv_ggml_type_info_of(type);
    if (t) return t->name;
    snprintf(buf, 16, "type %u", type);
    return buf;
}

int kv_ggml_type_parse(const char *name)
{
    for (int i = 0; i < KV_GGML_TYPE_LIMIT; i++) {
        if (!types[i].name || !types[i].bytes) continue;
        const char *a = types[i].name, *b = name;
        while (*a && *b && toupper((unsigned char)*a) == toupper((unsigned char)*b)) a++, b++;
        if (!*a && !*b) return i;
    }
    return -1;
}
