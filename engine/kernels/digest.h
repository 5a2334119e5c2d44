/* One row's part of a content digest's unit sum (digest.c says what the sums are), for every kernel that
 * takes them: dot_u8, dot_i16, dot_i32. */
#ifndef KVDOCTOR_DIGEST_H
#define KVDOCTOR_DIGEST_H
#include "pool.h"
#include <stdint.h>

/* sum over i < n of x[i] * w[i], wrapping: one row's part of a unit sum (decode_layer.c takes them too) */
#define DOT(NAME, T)                                                                                        \
  static inline uint64_t NAME(const T *x, const int64_t *w, int64_t n) {                                  \
    uint64_t acc = 0;                                                                                      \
    for (int64_t i = 0; i < n; i++) acc += (uint64_t)(int64_t)x[i] * (uint64_t)w[i];                       \
    return acc;                                                                                            \
  }

DOT(dot_u8, uint8_t)
DOT(dot_i16, int16_t)
DOT(dot_i32, int32_t)
#endif
