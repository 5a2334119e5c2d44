/* The swap checksum (checksum.py) taken in the copy's one pass: n blocks of W 64-bit words, rows ds and ss
 * words apart, copied from src to dst; sums[i] is block i's words added modulo 2^64.
 *
 * With stream, the stores bypass the caches (non-temporal). A regular store first reads the line it writes
 * (read for ownership): a third trip over the bytes, which memcpy's string moves skip. On the Intel Xeon
 * (docs/benchmarks.md) numba's loop of regular stores ran at 0.91x a memcpy over 90 MiB of blocks, these
 * at 1.2x. A batch this large leaves the caches anyway; a small one (stream 0) stays in them for its reader. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512i vec;
#define LOAD(p) _mm512_loadu_si512((const void *)(p))
#define ADD(a, b) _mm512_add_epi64(a, b)
#define STREAM(p, v) _mm512_stream_si512((void *)(p), v)
#elif defined(__AVX2__)
#include <immintrin.h>
typedef __m256i vec;
#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define ADD(a, b) _mm256_add_epi64(a, b)
#define STREAM(p, v) _mm256_stream_si256((__m256i *)(p), v)
#endif

/* Words from j on, the vector part with non-temporal stores from the first aligned word; returns the new j. */
static int64_t stream_part(int64_t *d, const int64_t *s, int64_t j, int64_t W, uint64_t *t) {
#ifdef STREAM
  enum { LANES = sizeof(vec) / 8 };
  for (; j < W && ((uintptr_t)(d + j) % sizeof(vec)); j++) { d[j] = s[j]; *t += (uint64_t)s[j]; }
  vec acc;
  memset(&acc, 0, sizeof acc);
  for (; j + LANES <= W; j += LANES) {
    const vec v = LOAD(s + j);
    acc = ADD(acc, v);
    STREAM(d + j, v);
  }
  int64_t lanes[LANES];
  memcpy(lanes, &acc, sizeof acc);
  for (int k = 0; k < LANES; k++) *t += (uint64_t)lanes[k];
#else
  (void)d, (void)s, (void)W, (void)t;
#endif
  return j;
}

void kvdoctor_copy_sum(int64_t *dst, const int64_t *src, int64_t n, int64_t W, int64_t ds, int64_t ss, int stream,
                       uint64_t *sums) {
  for (int64_t i = 0; i < n; i++) {
    int64_t *d = dst + i * ds;
    const int64_t *s = src + i * ss;
    uint64_t t = 0;
    int64_t j = stream ? stream_part(d, s, 0, W, &t) : 0;
    for (; j < W; j++) { /* the rest (all of it without stream): regular stores, vectorised by the compiler */
      d[j] = s[j];
      t += (uint64_t)s[j];
    }
    sums[i] = t;
  }
#ifdef STREAM
  if (stream) _mm_sfence(); /* the streamed stores are visible before the caller reads the sums and moves on */
#endif
}
