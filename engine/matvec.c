/* y (M, N) = x (M, K) . w (N, K)^T (+ b (N,)) for the few rows of a decode step; x, b, y float32,
 * w float32 or bfloat16 (widened to float32 in registers: a bf16 weight is the top half of a float).
 *
 * Bandwidth-bound: every weight is read once per call whatever M is. Rows of w are split across
 * the OpenMP team (the caller's torch thread pool: this library links the same libgomp), four at a
 * time; each group of four is multiplied by x's rows two at a time, so one load of a weight vector
 * feeds two FMAs. Each output keeps eight partial sums (one vector) added at the end, which rounds
 * closer to the exact product than one running sum. GCC's vector extensions compile to AVX2 or
 * AVX-512 under -march=native and to SSE elsewhere. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
enum { ROWS = 4 };

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

static inline v8 load_bf16(const uint16_t *p) {
  v8h h;
  memcpy(&h, p, sizeof h);
  v8u u = __builtin_convertvector(h, v8u) << 16;
  v8 v;
  memcpy(&v, &u, sizeof v);
  return v;
}
static inline float bf16(const uint16_t *p) { uint32_t u = (uint32_t)*p << 16; float f; memcpy(&f, &u, 4); return f; }

/* One kernel per weight type W (KEEP: PIN or NO_PIN, whichever measured faster): rows n0 .. n0+R of w
 * (R <= ROWS) against x's rows m and m+1 (pair) or m alone, then the driver that splits w's rows over
 * the threads. */
#define MATVEC(NAME, W, LOAD, SCALAR, KEEP)                                                                    \
  static inline void NAME##_block(const float *x, const W *w, const float *b, float *y, int64_t N,       \
                                  int64_t K, int64_t n0, int64_t R, int64_t m, int pair) {               \
    const int64_t K8 = K & ~(int64_t)7;                                                                  \
    const float *x0 = x + m * K, *x1 = x0 + (pair ? K : 0);                                              \
    v8 a0[ROWS] = {0}, a1[ROWS] = {0};                                                                   \
    for (int64_t k = 0; k < K8; k += 8) {                                                                \
      v8 u = load_f32(x0 + k), v = load_f32(x1 + k);                                                     \
      KEEP(u); KEEP(v);                                                                                  \
      for (int64_t r = 0; r < ROWS; r++) {                                                               \
        if (r < R) {                                                                                     \
          const v8 wv = LOAD(w + (n0 + r) * K + k);                                                      \
          a0[r] += wv * u;                                                                               \
          if (pair) a1[r] += wv * v;                                                                     \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    for (int64_t r = 0; r < R; r++) {                                                                    \
      const W *wr = w + (n0 + r) * K;                                                                    \
      float s0 = 0.f, s1 = 0.f;                                                                          \
      for (int i = 0; i < 8; i++) { s0 += a0[r][i]; s1 += a1[r][i]; }                                    \
      for (int64_t k = K8; k < K; k++) { s0 += SCALAR(wr + k) * x0[k]; s1 += SCALAR(wr + k) * x1[k]; }   \
      const float bias = b ? b[n0 + r] : 0.f;                                                            \
      y[m * N + n0 + r] = s0 + bias;                                                                     \
      if (pair) y[(m + 1) * N + n0 + r] = s1 + bias;                                                     \
    }                                                                                                    \
  }                                                                                                      \
  void NAME(const float *x, const W *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,       \
            int threads) {                                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                    \
    for (int64_t n0 = 0; n0 < N; n0 += ROWS) {                                                           \
      const int64_t R = N - n0 < ROWS ? N - n0 : ROWS;                                                   \
      int64_t m = 0;                                                                                     \
      if (R == ROWS) { /* a constant R: the compiler keeps the sums in registers */                      \
        for (; m + 2 <= M; m += 2) NAME##_block(x, w, b, y, N, K, n0, ROWS, m, 1);                       \
        if (m < M) NAME##_block(x, w, b, y, N, K, n0, ROWS, m, 0);                                       \
      } else {                                                                                           \
        for (; m + 2 <= M; m += 2) NAME##_block(x, w, b, y, N, K, n0, R, m, 1);                          \
        if (m < M) NAME##_block(x, w, b, y, N, K, n0, R, m, 0);                                          \
      }                                                                                                  \
    }                                                                                                    \
  }

MATVEC(kvdoctor_matvec_f32, float, load_f32, f32, PIN)
MATVEC(kvdoctor_matvec_bf16, uint16_t, load_bf16, bf16, NO_PIN)  /* pinning slowed bf16 */

/* Where this library's OpenMP calls go: the loader tells which runtime this address lies in. */
void *kvdoctor_openmp_symbol(void) { return (void *)&omp_get_max_threads; }
