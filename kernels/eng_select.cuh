/*
 * eng_select.cuh: what the sparse layers' selection kernels share between
 * eng_select.cu (channels, scores, softmax, top-K, gather, selection cache)
 * and eng_select_index.cu (the resident channel index and the page index).
 */
#ifndef ENG_SELECT_CUH
#define ENG_SELECT_CUH

#include "eng_common.cuh"

#define SEL_MAXG 8 /* query heads per KV head the selection kernels take */

#endif
