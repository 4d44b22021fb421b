/*
 * libFuzzer target for the kv-tree chunk reader, versions 2 and 3
 * (lib/tree/kv_tree_chunk.c, man/kvc.5 "KV-TREE CHUNKS"): the head, the
 * token, importance and row order tables, the frame index, every frame (a
 * .kvc image, plain or KIVI/DSQ-packed, maybe zstd) decoded, the query
 * samples and (version 3) the key sketch, and every accepted chunk read
 * again layer by layer (per-tensor reads after the frame headers alone),
 * which must agree with the whole frames.  Whatever the bytes, the reader
 * returns a status: any crash, sanitizer report, leak or hang is a bug.
 */
#include <stdint.h>
#include <stdlib.h>

#include "tree/kv_tree.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int rows = -1;
    kv_status st = kv_tree_chunk_verify_mem(data, size, &rows);
    if (st == KV_OK && rows < 1) abort(); /* an accepted chunk holds rows */
    kv_errclear();
    /* read by layer too (header alone, then each layer's tensors): never
     * different bytes from the frames read whole */
    int rows2 = -1;
    if (st == KV_OK && kv_tree_chunk_verify_layered_mem(data, size, &rows2) == KV_E_INTERNAL) abort();
    kv_errclear();
    return 0;
}
