/* Unit sums of content digests (digest.py): weighted wrapping sums of stored elements as integers.
 *
 * out[l * so + c] += sum over h < H, w < W of x_l[h * sh + c * sc + w] * wt[h * W + w]   (mod 2^64)
 *
 * x_l starts ls bytes after x_(l-1), at base for l = 0; elements of itemsize 1 (unsigned: codes), 2 or 4
 * bytes (signed: a float's bit pattern), strides in elements. The same sums numpy's einsum takes over
 * integer views, in one call without numpy's per-call cost (after a decode step has streamed the weights
 * through the caches, each numpy call costs ~15 us); unsigned arithmetic wraps as numpy's int64 does. */
#include "digest.h"

#define SUMS(NAME, T, DOTFN)                                                                                \
  static void NAME(const char *base, int64_t ls, int64_t L, int64_t H, int64_t C, int64_t W, int64_t sh,  \
                   int64_t sc, const int64_t *wt, uint64_t *out, int64_t so, int threads) {              \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (L * H * C * W > (1 << 16))")      \
    for (int64_t l = 0; l < L; l++) {                                                                    \
      const T *x = (const T *)(base + l * ls);                                                           \
      for (int64_t c = 0; c < C; c++) {                                                                  \
        uint64_t acc = 0;                                                                                \
        for (int64_t h = 0; h < H; h++) acc += DOTFN(x + h * sh + c * sc, wt + h * W, W);               \
        out[l * so + c] += acc;                                                                          \
      }                                                                                                  \
    }                                                                                                    \
  }

SUMS(sums_u8, uint8_t, dot_u8)
SUMS(sums_i16, int16_t, dot_i16)
SUMS(sums_i32, int32_t, dot_i32)

void kvdoctor_unit_sums(const char *base, int64_t ls, int64_t L, int64_t H, int64_t C, int64_t W, int64_t sh,
                        int64_t sc, int64_t itemsize, const int64_t *wt, uint64_t *out, int64_t so, int threads) {
  if (itemsize == 1) sums_u8(base, ls, L, H, C, W, sh, sc, wt, out, so, threads);
  else if (itemsize == 2) sums_i16(base, ls, L, H, C, W, sh, sc, wt, out, so, threads);
  else sums_i32(base, ls, L, H, C, W, sh, sc, wt, out, so, threads);
}

