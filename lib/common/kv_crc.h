/*
 * kv_crc: CRC-32C (Castagnoli) of a buffer.
 */
#ifndef KV_CRC_H
#define KV_CRC_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C of buf, continuing from crc (start with 0). */
uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n);
/* The CRC-32C of A then B from crc_a = kv_crc32c(c, A, .), crc_b =
 * kv_crc32c(0, B, len_b) and B's length: what lets pieces of one buffer be
 * checksummed on several threads (multiplication by x^(8 len_b) modulo the
 * polynomial, O(log len_b)). */
uint32_t kv_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
/* The portable table-driven path kv_crc32c falls back to without SSE4.2
 * (exposed so tests can check both paths). */
uint32_t kv_crc32c_sw(uint32_t crc, const void *buf, size_t n);

#endif
