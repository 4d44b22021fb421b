/*
 * kv_crc: CRC-32C (Castagnoli) of a buffer.
 */
#ifndef KV_CRC_H
#define KV_CRC_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C of buf, continuing from crc (start with 0). */
uint32_t kv_crc32c(uint32_t crc, const void *buf, size_t n);
/* The portable table-driven path kv_crc32c falls back to without SSE4.2
 * (exposed so tests can check both paths). */
uint32_t kv_crc32c_sw(uint32_t crc, const void *buf, size_t n);

#endif
