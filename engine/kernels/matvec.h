/* The matrix-vector products of matvec.c (which says how they work), for every kernel that multiplies:
 * matvec_f32 and matvec_bf16, y (M, N) = x (M, K) . w (N, K)^T (+ b), and the vector helpers they use. */
#ifndef KVDOCTOR_MATVEC_H
#define KVDOCTOR_MATVEC_H
#include "pool.h"
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

/* float -> bf16, round to nearest even; NaN stays a (quiet) NaN: c10::BFloat16's conversion, without a
 * branch, so loops over it vectorize. */
static inline __attribute__((always_inline)) uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
  return (uint16_t)(f != f ? quiet : rounded);
}

/* A float rounded to bf16, as a float. */
static inline float bf16_value(float f) { const uint16_t h = to_bf16(f); return bf16(&h); }

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

/* The block kernel of one weight type W and one type X of x's elements as PREPARE left them (KEEP: PIN or
 * NO_PIN, whichever measured faster): rows n0 .. n0+R of w (R <= ROWS) against x's rows m .. m+nx (nx <=
 * XROWS, a constant where it is inlined); V vectors of STEP elements of k per iteration (LOAD reads one of
 * x), FMA(r, k) adding their products for weight row r to a[j][r] for x's row m+j; FOLD adds a V's halves
 * into a v8. The tail past the last whole STEP is summed one element at a time (SCALAR and XSCALAR widen
 * one weight and one of x). */
#define BLOCK(NAME, W, X, V, LOAD, FOLD, STEP, SCALAR, XSCALAR, KEEP, FMA)                                     \
  static inline __attribute__((always_inline)) void NAME(const void *xv, const W *w, const float *b, float *y, \
                                                         int64_t N, int64_t K, int64_t n0, int64_t R,         \
                                                         int64_t m, const int nx) {                           \
    const int64_t KS = K - K % STEP;                                                                          \
    const X *x = xv, *xr[XROWS];                                                                              \
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
        for (int64_t k = KS; k < K; k++) s += SCALAR(wr + k) * XSCALAR(xr[j] + k);                            \
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
BLOCK(block_f32, float, float, vw, load_w, fold_w, (int64_t)(sizeof(vw) / sizeof(float)), f32, f32, PIN, FMA_F32)
#if defined(__AVX512BF16__)
/* bf16 where the CPU has AVX-512 BF16: vdpbf16ps multiplies 32 weights by 32 of x (x as bf16 too) and adds
 * each pair's two exact products into a float lane, one instruction where widening and FMAs took six; at
 * 8 rows the products were compute-bound (SmolLM2's at 8 rows: 17 ms against 9.3 at one). */
#include <immintrin.h>
#define FMA_DPBF16(r, k)                                                                                 \
  do {                                                                                                   \
    __m512bh wv;                                                                                         \
    memcpy(&wv, w + (n0 + r) * K + k, sizeof wv);                                                        \
    for (int j = 0; j < nx; j++) a[j][r] = (vw)_mm512_dpbf16_ps((__m512)a[j][r], (__m512bh)u[j], wv);    \
  } while (0)
static inline vw load_bh(const uint16_t *p) { vw v; memcpy(&v, p, sizeof v); return v; } /* 32 bf16 */
BLOCK(block_bf16, uint16_t, uint16_t, vw, load_bh, fold_w, 32, bf16, bf16, NO_PIN, FMA_DPBF16)
#else
BLOCK(block_bf16, uint16_t, float, v8, load_f32, same, 16, bf16, f32, NO_PIN, FMA_BF16)
#endif

/* Outputs n0 .. n0+R of every row rounded to bf16 values, while the thread that wrote them has them in cache
 * (a bf16 model's product rounds its float sums; rounding here spares the caller a bf16 tensor and its
 * conversion back, 0.38 ms for SmolLM2's logits at batch 8). */
static inline void round_outputs(float *y, int64_t M, int64_t N, int64_t n0, int64_t R) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t r = 0; r < R; r++) y[m * N + n0 + r] = bf16_value(y[m * N + n0 + r]);
}

/* One call's product, as the pool's threads share it (a share: groups of ROWS rows of w). */
typedef struct {
  const void *x, *w;
  const float *b;
  float *y;
  int64_t M, N, K;
  int round;
} matvec_job;

/* The driver: w's rows split over the threads in groups of ROWS, x's rows XROWS at a time within each group
 * (then 2, then 1: each count a constant, so the compiler keeps the sums in registers); with round, the
 * outputs rounded to bf16 values. */
#define MATVEC(NAME, W, BLOCKFN, PREPARE)                                                                \
  static void NAME##_groups(void *ctx, int64_t first, int64_t end, int64_t step) {                      \
    const matvec_job *j = (const matvec_job *)ctx;                                                       \
    const void *xs = j->x;                                                                               \
    const W *w = (const W *)j->w;                                                                        \
    const float *b = j->b;                                                                               \
    float *y = j->y;                                                                                     \
    const int64_t M = j->M, N = j->N, K = j->K;                                                          \
    for (int64_t g = first; g < end; g += step) {                                                        \
      const int64_t n0 = g * ROWS;                                                                       \
      int64_t m = 0;                                                                                     \
      if (N - n0 >= ROWS) {                                                                              \
        for (; m + XROWS <= M; m += XROWS) BLOCKFN(xs, w, b, y, N, K, n0, ROWS, m, XROWS);               \
        if (XROWS > 2 && m + 2 <= M) { BLOCKFN(xs, w, b, y, N, K, n0, ROWS, m, 2); m += 2; }             \
        if (m < M) BLOCKFN(xs, w, b, y, N, K, n0, ROWS, m, 1);                                           \
      } else { /* the last few rows of w */                                                              \
        for (; m < M; m++) BLOCKFN(xs, w, b, y, N, K, n0, N - n0, m, 1);                                 \
      }                                                                                                  \
      if (j->round) round_outputs(y, M, N, n0, N - n0 < ROWS ? N - n0 : ROWS);                           \
    }                                                                                                    \
  }                                                                                                      \
  static void NAME(const float *x, const W *w, const float *b, float *y, float *scratch, int64_t M, int64_t N,  \
            int64_t K, int threads, int round) {                                                         \
    matvec_job job = {PREPARE(x, scratch, M, K), w, b, y, M, N, K, round};                              \
    kvdoctor_parallel((N + ROWS - 1) / ROWS, threads, 0, NAME##_groups, &job);                           \
  }

static inline const void *as_is(const float *x, float *scratch, int64_t M, int64_t K) {
  (void)scratch; (void)M; (void)K;
  return x;
}

#if defined(__AVX512BF16__)
/* x's rows as bf16, as block_bf16 reads them. */
static const void *as_bf16(const float *x, float *scratch, int64_t M, int64_t K) {
  uint16_t *dst = (uint16_t *)scratch;
  for (int64_t i = 0; i < M * K; i++) dst[i] = to_bf16(x[i]);
  return scratch;
}
#define BF16_INPUT as_bf16
#else
/* x's rows rounded to bf16 (as_bf16's values) as block_bf16 reads them: per 16 elements the even ones,
 * then the odd; the tail in order. */
static const void *even_odd(const float *x, float *scratch, int64_t M, int64_t K) {
  const int64_t KS = K - K % 16;
  for (int64_t m = 0; m < M; m++) {
    const float *src = x + m * K;
    float *dst = scratch + m * K;
    for (int64_t k = 0; k < KS; k += 16)
      for (int i = 0; i < 8; i++) {
        dst[k + i] = bf16_value(src[k + 2 * i]);
        dst[k + 8 + i] = bf16_value(src[k + 2 * i + 1]);
      }
    for (int64_t k = KS; k < K; k++) dst[k] = bf16_value(src[k]);
  }
  return scratch;
}
#define BF16_INPUT even_odd
#endif

MATVEC(matvec_f32, float, block_f32, as_is)

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* bf16 on AMX: one TDPBF16PS multiplies 16 weight rows' 32 values (the A tile, read straight from w with
 * a row stride of K) by 32 of each of x's rows (the B tile: x^T in pairs of k, made once per call into
 * ``scratch``) into 16 x M float sums. The vector products were compute-bound at 8 rows (vdpbf16ps as
 * much as float FMAs: 150-180 GFLOP/s on both cores); with tiles 8 rows stream at one row's speed. */
#include <sys/syscall.h>
#include <unistd.h>

MATVEC(matvec_bf16_vectors, uint16_t, block_bf16, BF16_INPUT)

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

/* Linux lets a process use the tiles' registers only once it asks (else the first tile instruction traps). */
static int amx_allowed(void) {
  static int allowed = -1;
  if (allowed < 0) allowed = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return allowed;
}

/* Groups of 32 rows of w (a share of the pool's), each thread with its own tile configuration. */
typedef struct {
  matvec_job mv; /* x: x^T as the B tile reads it */
  tile_config cfg;
} tiles_job;

static void tile_groups(void *ctx, int64_t first, int64_t end, int64_t step) {
  const tiles_job *j = (const tiles_job *)ctx;
  const uint16_t *xt = (const uint16_t *)j->mv.x, *w = (const uint16_t *)j->mv.w;
  const float *b = j->mv.b;
  float *y = j->mv.y;
  const int64_t M = j->mv.M, N = j->mv.N, K = j->mv.K;
  _tile_loadconfig(&j->cfg);
  float sums[2][16 * 16];
  for (int64_t pair = first; pair < end; pair += step) { /* two groups of 16 rows share each load of x^T */
    const int64_t n0 = pair * 32;
    const int two = n0 + 16 < N;
    const uint16_t *w0 = w + n0 * K, *w1 = w0 + 16 * K, *next = w + (n0 + 32 < N ? n0 + 32 : n0) * K;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < K; k += 32) {
      for (int r = 0; r < 32; r++) __builtin_prefetch(next + r * K + k, 0, 2); /* as BLOCK's prefetch */
      _tile_loadd(4, xt + k * M, M * 4);
      _tile_loadd(2, w0 + k, K * 2);
      _tile_dpbf16ps(0, 2, 4);
      if (two) {
        _tile_loadd(3, w1 + k, K * 2);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    _tile_stored(0, sums[0], M * 4);
    if (two) _tile_stored(1, sums[1], M * 4);
    for (int g = 0; g <= two; g++)
      for (int64_t i = 0; i < 16; i++)
        for (int64_t m = 0; m < M; m++)
          y[m * N + n0 + g * 16 + i] = sums[g][i * M + m] + (b ? b[n0 + g * 16 + i] : 0.f);
    if (j->mv.round) round_outputs(y, M, N, n0, two ? 32 : 16);
  }
  _tile_release();
}

static void matvec_bf16_tiles(const float *x, const uint16_t *w, const float *b, float *y, float *scratch,
                              int64_t M, int64_t N, int64_t K, int threads, int round) {
  uint16_t *xt = (uint16_t *)scratch; /* (K / 2, M, 2) */
  for (int64_t i = 0; i < K / 2; i++)
    for (int64_t m = 0; m < M; m++)
      for (int e = 0; e < 2; e++) xt[(i * M + m) * 2 + e] = to_bf16(x[m * K + 2 * i + e]);
  tiles_job job = {{xt, w, b, y, M, N, K, round}, {.palette = 1}};
  for (int t = 0; t < 5; t++) { /* 0, 1: sums (16 rows x M floats); 2, 3: 16 rows of w; 4: x^T */
    job.cfg.rows[t] = 16;
    job.cfg.colsb[t] = t == 2 || t == 3 ? 64 : (uint16_t)(M * 4);
  }
  kvdoctor_parallel((N + 31) / 32, threads, 0, tile_groups, &job);
}

static void matvec_bf16(const float *x, const uint16_t *w, const float *b, float *y, float *scratch, int64_t M,
                        int64_t N, int64_t K, int threads, int round) {
  /* below 4 rows the vectors stream faster (one row: 10.4 against 11.6 ms over SmolLM2's weights); from 4 on
   * the tiles win (8 rows: 11.5 against 15.4 ms; 16: 15.9 against 28.5) */
  if (M >= 4 && M <= 16 && N % 16 == 0 && K % 32 == 0 && amx_allowed())
    matvec_bf16_tiles(x, w, b, y, scratch, M, N, K, threads, round);
  else
    matvec_bf16_vectors(x, w, b, y, scratch, M, N, K, threads, round);
}
#else
MATVEC(matvec_bf16, uint16_t, block_bf16, BF16_INPUT)
#endif
#endif
