/* Unit sums of content digests (digest.py): weighted wrapping sums of stored elements as integers.
 *
 * out[l * so + c] += sum over h < H, w < W of x_l[h * sh + c * sc + w] * wt[h * W + w]   (mod 2^64)
 *
 * x_l starts ls bytes after x_(l-1), at base for l = 0; elements of itemsize 1 (unsigned: codes), 2 or 4
 * bytes (signed: a float's bit pattern), strides in elements. The same sums numpy's einsum takes over
 * integer views, in one call without numpy's per-call cost (after a decode step has streamed the weights
 * through the caches, each numpy call costs ~15 us); unsigned arithmetic wraps as numpy's int64 does. */
#include "digest.h"

/* One call's sums (a share of the pool's: layers). */
typedef struct {
  const char *base;
  int64_t ls, H, C, W, sh, sc, so;
  const int64_t *wt;
  uint64_t *out;
} sums_job;

#define SUMS(NAME, T, DOTFN)                                                                                \
  static void NAME(void *ctx, int64_t first, int64_t end, int64_t step) {                                  \
    const sums_job *j = (const sums_job *)ctx;                                                             \
    for (int64_t l = first; l < end; l += step) {                                                          \
      const T *x = (const T *)(j->base + l * j->ls);                                                       \
      for (int64_t c = 0; c < j->C; c++) {                                                                 \
        uint64_t acc = 0;                                                                                  \
        for (int64_t h = 0; h < j->H; h++) acc += DOTFN(x + h * j->sh + c * j->sc, j->wt + h * j->W, j->W); \
        j->out[l * j->so + c] += acc;                                                                      \
      }                                                                                                    \
    }                                                                                                      \
  }

SUMS(sums_u8, uint8_t, dot_u8)
SUMS(sums_i16, int16_t, dot_i16)
SUMS(sums_i32, int32_t, dot_i32)

void kvdoctor_unit_sums(const char *base, int64_t ls, int64_t L, int64_t H, int64_t C, int64_t W, int64_t sh,
                        int64_t sc, int64_t itemsize, const int64_t *wt, uint64_t *out, int64_t so, int threads) {
  sums_job job = {base, ls, H, C, W, sh, sc, so, wt, out};
  const pool_body body = itemsize == 1 ? sums_u8 : itemsize == 2 ? sums_i16 : sums_i32;
  kvdoctor_parallel(L, L * H * C * W > (1 << 16) ? threads : 1, 0, body, &job);
}


/* Non-finite K/V where a commit stored it (nonfinite.py): for each of n tokens at flat device slots flat[i] (slot *
 * bs + position), its K and V rows of every layer and kv head, D elements each starting at element
 * (slot * s_blk + position * s_pos + l * s_layer + c * s_kv + h * s_head) * D of base; first[i] is the first layer
 * where one holds NaN or Inf, or -1; first[n] how many tokens have one. kind: 0 float32, 1 bfloat16, 2 float16
 * (every exponent bit set: not finite). One call a step: numpy's or torch's small ops cost tens of
 * microseconds each after a decode step has flushed the caches. */
static int row_nonfinite(const char *x, int64_t D, int64_t kind) {
  int bad = 0;
  if (kind == 0) {
    const uint32_t *u = (const uint32_t *)x;
    for (int64_t j = 0; j < D; j++) bad |= (u[j] & 0x7F800000u) == 0x7F800000u;
  } else {
    const uint16_t *u = (const uint16_t *)x, e = kind == 1 ? 0x7F80u : 0x7C00u;
    for (int64_t j = 0; j < D; j++) bad |= (u[j] & e) == e;
  }
  return bad;
}

void kvdoctor_nonfinite_rows(const char *base, const int64_t *flat, int64_t n, int64_t bs, int64_t s_blk,
                             int64_t s_pos, int64_t s_layer, int64_t s_kv, int64_t s_head, int64_t L, int64_t H,
                             int64_t D, int64_t kind, int64_t *first) {
  const int64_t size = kind == 0 ? 4 : 2;
  int64_t found = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t row = (flat[i] / bs) * s_blk + (flat[i] % bs) * s_pos;
    first[i] = -1;
    for (int64_t l = 0; l < L && first[i] < 0; l++)
      for (int64_t c = 0; c < 2 * H; c++) /* K then V, each kv head */
        if (row_nonfinite(base + (row + l * s_layer + c / H * s_kv + c % H * s_head) * D * size, D, kind)) {
          first[i] = l;
          break;
        }
    found += first[i] >= 0;
  }
  first[n] = found;
}
