/* y (M, N) = x (M, K) . w (N, K)^T (+ b (N,)) for the few rows of a decode step; x, b, y float32,
 * w float32 or bfloat16 (a bf16 weight is the top half of a float: widened in registers).
 *
 * Bandwidth-bound at one row: every weight is read once per call whatever M is. Rows of w are split
 * across the OpenMP team (the caller's torch thread pool: this library links the same libgomp), four
 * at a time; each group of four is multiplied by XROWS of x's rows at a time (4 where AVX-512 gives 32
 * vector registers: 16 sums, 4 inputs, a weight; 2 with AVX2's 16), so one load of a weight vector
 * feeds XROWS FMAs and a group is read from memory once and from the core's cache M / XROWS - 1 times.
 * At 8 rows the products are as much compute as streaming: two passes of four rows, not four of two,
 * took a SmolLM2 step's products from 24.1 to 21.0 ms on a 2-core Xeon (AVX-512), and float32 runs in
 * 16-lane vectors there. Each output keeps one vector of partial sums added at the end, which rounds
 * closer to the exact product than one running sum. GCC's vector extensions compile to AVX2 or AVX-512
 * under -march=native and to SSE elsewhere.
 *
 * bf16: one 32-byte load holds 16 weights, two to each 32-bit lane. The lane shifted left by 16 is the
 * float of the even weight, the lane with its low half cleared the float of the odd one: two integer
 * operations widen 16 weights (a per-element conversion took six instructions for 8, and made the
 * one-row product compute-bound at 8.5 GB/s). x's rows are reordered to match once per call, into
 * ``scratch``: per 16 elements, the 8 even ones then the 8 odd ones. */
#include "openmp.h"
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
enum { ROWS = 4 };
#if defined(__AVX512F__)
enum { XROWS = 4 };
typedef float vw __attribute__((vector_size(64))); /* float32 weights' vectors: 16 lanes */
#else
enum { XROWS = 2 };
typedef v8 vw;
#endif

/* Keeps a vector in a register: without it GCC folds the input rows' loads into each FMA, reloading them
 * for every weight row (12 loads per 8 FMAs where 6 do; 8 input rows through SmolLM2: 39 ms, not 42-45). */
#if defined(__x86_64__) && defined(__GNUC__)
#define PIN(v) __asm__("" : "+x"(v))
#else
#define PIN(v) ((void)0)
#endif
#define NO_PIN(v) ((void)0)

static inline v8 load_f32(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline float f32(const float *p) { return *p; }

/* The floats of the 16 bf16 at p: the even-indexed ones (each lane's low half, moved up) and the odd. */
static inline void split_bf16(const uint16_t *p, v8 *even, v8 *odd) {
  v8u u;
  memcpy(&u, p, sizeof u);
  const v8u e = u << 16, o = u & 0xffff0000u;
  memcpy(even, &e, sizeof e);
  memcpy(odd, &o, sizeof o);
}
static inline float bf16(const uint16_t *p) { uint32_t u = (uint32_t)*p << 16; float f; memcpy(&f, &u, 4); return f; }

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Pairwise sums of two vectors' lanes, as AVX's hadd: a0+a1, a2+a3, b0+b1, b2+b3, then the same of lanes 4-7. */
static inline v8 hadd(v8 a, v8 b) {
  return SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* Each of four accumulators' eight partial sums, added in registers: lane r + lane r+4 is row r's total
 * (summed one lane at a time through the stack, the end of each row cost ~80 ns, a third of a row of 576). */
static inline v8 lanes_sum4(const v8 a[ROWS]) { return hadd(hadd(a[0], a[1]), hadd(a[2], a[3])); }

/* The block kernel of one weight type (KEEP: PIN or NO_PIN, whichever measured faster): rows n0 .. n0+R
 * of w (R <= ROWS) against x's rows m .. m+nx (nx <= XROWS, a constant where it is inlined); V vectors of
 * STEP elements of k per iteration (LOAD reads one of x), FMA(r, k) adding their products for weight row r
 * to a[j][r] for x's row m+j; FOLD adds a V's halves into a v8. The tail past the last whole STEP is summed
 * one element at a time (SCALAR widens one weight). */
#define BLOCK(NAME, W, V, LOAD, FOLD, STEP, SCALAR, KEEP, FMA)                                                \
  static inline __attribute__((always_inline)) void NAME(const float *x, const W *w, const float *b, float *y, \
                                                         int64_t N, int64_t K, int64_t n0, int64_t R,         \
                                                         int64_t m, const int nx) {                           \
    const int64_t KS = K - K % STEP;                                                                          \
    const float *xr[XROWS];                                                                                   \
    for (int j = 0; j < nx; j++) xr[j] = x + (m + j) * K;                                                     \
    V a[XROWS][ROWS] = {{0}};                                                                                 \
    /* the next group's rows, fetched into L2 while this one is summed (in every pass, so the memory keeps  \
     * busy while a later pass reads the group from cache): rows of a few KB are too short for the         \
     * hardware prefetcher to learn four interleaved streams (half the bandwidth at SmolLM2's K = 576);    \
     * into L1 they pushed the group out of it at K = 1536 (a third slower at 8 rows) */                     \
    const W *next = w + (n0 + ROWS < N ? n0 + ROWS : n0) * K;                                                 \
    for (int64_t k = 0; k < KS; k += STEP) {                                                                  \
      V u[XROWS];                                                                                             \
      for (int j = 0; j < nx; j++) { u[j] = LOAD(xr[j] + k); KEEP(u[j]); }                                    \
      for (int64_t r = 0; r < ROWS; r++) {                                                                    \
        __builtin_prefetch(next + r * K + k, 0, 2);                                                           \
        if (r < R) FMA(r, k);                                                                                 \
      }                                                                                                       \
    }                                                                                                         \
    for (int j = 0; j < nx; j++) {                                                                            \
      const v8 t = lanes_sum4((v8[ROWS]){FOLD(a[j][0]), FOLD(a[j][1]), FOLD(a[j][2]), FOLD(a[j][3])});        \
      for (int64_t r = 0; r < R; r++) {                                                                       \
        const W *wr = w + (n0 + r) * K;                                                                       \
        float s = t[r] + t[r + 4];                                                                            \
        for (int64_t k = KS; k < K; k++) s += SCALAR(wr + k) * xr[j][k];                                      \
        y[(m + j) * N + n0 + r] = s + (b ? b[n0 + r] : 0.f);                                                  \
      }                                                                                                       \
    }                                                                                                         \
  }

#define FMA_F32(r, k)                                                                                    \
  do {                                                                                                   \
    const vw wv = load_w(w + (n0 + r) * K + k);                                                          \
    for (int j = 0; j < nx; j++) a[j][r] += wv * u[j];                                                   \
  } while (0)

#define FMA_BF16(r, k)                                                                                   \
  do {                                                                                                   \
    v8 we, wo;                                                                                           \
    split_bf16(w + (n0 + r) * K + k, &we, &wo);                                                          \
    for (int j = 0; j < nx; j++) a[j][r] += we * u[j] + wo * load_f32(xr[j] + k + 8);                    \
  } while (0)

static inline vw load_w(const float *p) { vw v; memcpy(&v, p, sizeof v); return v; }
static inline v8 fold_w(vw a) { /* a vw's lanes added pairwise into 8 (itself where vw is v8) */
  v8 t = {0};
  for (size_t i = 0; i < sizeof a / sizeof t; i++) { v8 h; memcpy(&h, (char *)&a + i * sizeof h, sizeof h); t += h; }
  return t;
}
static inline v8 same(v8 a) { return a; }
BLOCK(block_f32, float, vw, load_w, fold_w, (int64_t)(sizeof(vw) / sizeof(float)), f32, PIN, FMA_F32)
BLOCK(block_bf16, uint16_t, v8, load_f32, same, 16, bf16, NO_PIN, FMA_BF16)

/* The driver: w's rows split over the threads, x's rows XROWS at a time within each group of ROWS (then
 * 2, then 1: each count a constant, so the compiler keeps the sums in registers). */
#define MATVEC(NAME, W, BLOCKFN, PREPARE)                                                                \
  void NAME(const float *x, const W *w, const float *b, float *y, float *scratch, int64_t M, int64_t N,  \
            int64_t K, int threads) {                                                                    \
    const float *xs = PREPARE(x, scratch, M, K);                                                         \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                    \
    for (int64_t n0 = 0; n0 < N; n0 += ROWS) {                                                           \
      int64_t m = 0;                                                                                     \
      if (N - n0 >= ROWS) {                                                                              \
        for (; m + XROWS <= M; m += XROWS) BLOCKFN(xs, w, b, y, N, K, n0, ROWS, m, XROWS);               \
        if (XROWS > 2 && m + 2 <= M) { BLOCKFN(xs, w, b, y, N, K, n0, ROWS, m, 2); m += 2; }             \
        if (m < M) BLOCKFN(xs, w, b, y, N, K, n0, ROWS, m, 1);                                           \
      } else { /* the last few rows of w */                                                              \
        for (; m < M; m++) BLOCKFN(xs, w, b, y, N, K, n0, N - n0, m, 1);                                 \
      }                                                                                                  \
    }                                                                                                    \
  }

static inline const float *as_is(const float *x, float *scratch, int64_t M, int64_t K) {
  (void)scratch; (void)M; (void)K;
  return x;
}

/* x's rows as block_bf16 reads them: per 16 elements the even ones, then the odd; the tail as it is. */
static const float *even_odd(const float *x, float *scratch, int64_t M, int64_t K) {
  const int64_t KS = K - K % 16;
  for (int64_t m = 0; m < M; m++) {
    const float *src = x + m * K;
    float *dst = scratch + m * K;
    for (int64_t k = 0; k < KS; k += 16)
      for (int i = 0; i < 8; i++) { dst[k + i] = src[k + 2 * i]; dst[k + 8 + i] = src[k + 2 * i + 1]; }
    for (int64_t k = KS; k < K; k++) dst[k] = src[k];
  }
  return scratch;
}

MATVEC(kvdoctor_matvec_f32, float, block_f32, as_is)
MATVEC(kvdoctor_matvec_bf16, uint16_t, block_bf16, even_odd)

