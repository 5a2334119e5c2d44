/* y (M, N) = x (M, K) . w (N, K)^T (+ b (N,)) in float32, for the few rows of a decode step.
 *
 * Bandwidth-bound: every weight is read once per call whatever M is. Rows of w are split across
 * the OpenMP team (the caller's torch thread pool: this library links the same libgomp), four at a
 * time; each group of four is multiplied by x's rows two at a time, so one load of a weight vector
 * feeds two FMAs. Each output keeps eight partial sums (one vector) added at the end, which rounds
 * closer to the exact product than one running sum. GCC's vector extensions compile to AVX2 or
 * AVX-512 under -march=native and to SSE elsewhere. */
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
enum { ROWS = 4 };

static inline v8 load(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

static inline float finish(v8 acc, const float *w, const float *x, int64_t from, int64_t K) {
  float s = 0.f;
  for (int i = 0; i < 8; i++) s += acc[i];
  for (int64_t k = from; k < K; k++) s += w[k] * x[k];
  return s;
}

/* rows n0 .. n0+R of w (R <= ROWS) against x's rows m and m+1 (pair) or m alone */
static inline void block(const float *x, const float *w, const float *b, float *y, int64_t N, int64_t K,
                         int64_t n0, int64_t R, int64_t m, int pair) {
  const int64_t K8 = K & ~(int64_t)7;
  const float *x0 = x + m * K, *x1 = x0 + (pair ? K : 0);
  v8 a0[ROWS] = {0}, a1[ROWS] = {0};
  for (int64_t k = 0; k < K8; k += 8) {
    const v8 u = load(x0 + k), v = load(x1 + k);
    for (int64_t r = 0; r < ROWS; r++) {
      if (r < R) {
        const v8 wv = load(w + (n0 + r) * K + k);
        a0[r] += wv * u;
        if (pair) a1[r] += wv * v;
      }
    }
  }
  for (int64_t r = 0; r < R; r++) {
    const float *wr = w + (n0 + r) * K, bias = b ? b[n0 + r] : 0.f;
    y[m * N + n0 + r] = finish(a0[r], wr, x0, K8, K) + bias;
    if (pair) y[(m + 1) * N + n0 + r] = finish(a1[r], wr, x1, K8, K) + bias;
  }
}

void kvdoctor_matvec(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                     int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
    const int64_t R = N - n0 < ROWS ? N - n0 : ROWS;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) block(x, w, b, y, N, K, n0, R, m, 1);
    if (m < M) block(x, w, b, y, N, K, n0, R, m, 0);
  }
}
