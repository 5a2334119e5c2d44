/* The statistics of one head's attention and of a row of heads (attn_stats.c says how they are taken), for
 * every kernel that takes them: head_stats, head_exact, row_summary, and the vector helpers they use. */
#ifndef KVDOCTOR_ATTN_STATS_H
#define KVDOCTOR_ATTN_STATS_H
#include <math.h>
#include "pool.h"
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

enum { SUMMARY = 4, LANES = 8 };
#define EXP_FLOOR (-80.f) /* exp() below this is taken as exp(-80): see attention.py */

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 pick(v8i mask, v8 a, v8 b) { return (v8)((mask & (v8i)a) | (~mask & (v8i)b)); }

/* exp(x) for x <= 0: 2^n * p(r) with Cephes' polynomial (about 1 ulp), on eight lanes at once. */
static inline v8 exp_neg(v8 x) {
  x = pick(x < splat(EXP_FLOOR), splat(EXP_FLOOR), x);
  const v8 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f; /* round to nearest */
  const v8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  v8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * (v8)((__builtin_convertvector(n, v8i) + 127) << 23);
}

/* The eight scores from t (t + 8 <= the range's end), and whether each is a visible key. */
static inline v8 load(const float *s, const int32_t *keep, int64_t t, v8i *visible) {
  v8 v;
  v8i k = {1, 1, 1, 1, 1, 1, 1, 1};
  memcpy(&v, s + t, sizeof v);
  if (keep) memcpy(&k, keep + t, sizeof k);
  *visible = k != 0;
  return v;
}

/* The scores from t to hi (< t + 8), padded to eight with keys that are not visible. */
static inline v8 load_tail(const float *s, const int32_t *keep, int64_t t, int64_t hi, v8i *visible) {
  float buf[LANES] = {0};
  int32_t kb[LANES] = {0};
  memcpy(buf, s + t, (size_t)(hi - t) * sizeof *buf);
  for (int64_t i = 0; i < hi - t; i++) kb[i] = keep ? keep[t + i] : 1;
  return load(buf, kb, 0, visible);
}

/* Eight probabilities from t, the ones at or past hi as 0. */
static inline v8 load_probs(const float *p, int64_t t, int64_t hi) {
  v8 v;
  if (t + LANES <= hi) {
    memcpy(&v, p + t, sizeof v);
    return v;
  }
  float buf[LANES] = {0};
  memcpy(buf, p + t, (size_t)(hi - t) * sizeof *buf);
  memcpy(&v, buf, sizeof v);
  return v;
}

/* Every group of eight keys in [lo, hi) through STEP(v, visible, t). */
#define FOR_GROUPS(s, keep, lo, hi, STEP)                                      \
  do {                                                                         \
    int64_t t_ = (lo);                                                         \
    v8i vis_;                                                                  \
    for (; t_ + LANES <= (hi); t_ += LANES) {                                  \
      const v8 v_ = load(s, keep, t_, &vis_);                                  \
      STEP(v_, vis_, t_);                                                      \
    }                                                                          \
    if (t_ < (hi)) {                                                           \
      const v8 v_ = load_tail(s, keep, t_, hi, &vis_);                         \
      STEP(v_, vis_, t_);                                                      \
    }                                                                          \
  } while (0)

static inline float lanes_sum(v8 a) {
  float x = 0.f;
  for (int i = 0; i < LANES; i++) x += a[i];
  return x;
}

/* The sums of pass two over keys [lo, hi): of e = exp(s - m), and of (s - m) e. */
static inline void exp_sums(const float *s, const int32_t *keep, int64_t lo, int64_t hi, float m, float *z,
                            float *sd) {
  v8 zz = splat(0.f), dd = splat(0.f);
#define EXP_STEP(v, vis, t)                                                                       \
  do {                                                                                            \
    const v8 d = pick(vis, v - m, splat(0.f)); /* a hidden key may hold anything, NaN included */ \
    const v8 e = pick(vis, exp_neg(d), splat(0.f));                                               \
    zz += e;                                                                                      \
    dd += pick(d < splat(EXP_FLOOR), splat(EXP_FLOOR), d) * e;                                    \
  } while (0)
  FOR_GROUPS(s, keep, lo, hi, EXP_STEP);
  *z += lanes_sum(zz);
  *sd += lanes_sum(dd);
}

typedef struct {
  float max, entropy, sink, nonfinite;
} Head;

/* The exact case: a head with a non-finite visible score, or no visible key. */
static Head head_exact(const float *s, const int32_t *keep, int64_t T, int64_t sink) {
  int64_t valid = 0, bad = 0;
  int breaks = 0;
  double m = -INFINITY;
  for (int64_t t = 0; t < T; t++) {
    if (keep && !keep[t]) continue;
    valid++;
    if (isfinite(s[t])) {
      if (s[t] > m) m = s[t];
    } else {
      bad++;
      breaks |= isnan(s[t]) || s[t] > 0;
    }
  }
  Head h = {0.f, 0.f, 0.f, (float)(bad + (breaks ? valid : 0))};
  if (m == -INFINITY) return h; /* no finite visible score: no distribution */
  double z = 0, sd = 0, zs = 0;
  for (int64_t t = 0; t < T; t++) {
    if ((keep && !keep[t]) || !isfinite(s[t])) continue;
    const double d = s[t] - m, e = exp(d);
    z += e;
    sd += d * e;
    if (t < sink) zs += e;
  }
  h.max = (float)m;
  h.entropy = (float)(log(z) - sd / z);
  h.sink = (float)(zs / z);
  return h;
}

/* The sums of pass two from the softmax's own probabilities p over keys [lo, hi): of p, and of p (m - s). */
static inline void prob_sums(const float *s, const float *p, const int32_t *keep, int64_t lo, int64_t hi, float m,
                             float *z, float *sd) {
  v8 zz = splat(0.f), dd = splat(0.f);
#define PROB_STEP(v, vis, t)                                   \
  do {                                                         \
    const v8 q = pick(vis, load_probs(p, t, hi), splat(0.f));  \
    zz += q;                                                   \
    dd += q * pick(vis, m - v, splat(0.f));                    \
  } while (0)
  FOR_GROUPS(s, keep, lo, hi, PROB_STEP);
  *z += lanes_sum(zz);
  *sd += lanes_sum(dd);
}

/* One head. With p (decode: the probabilities attention computed), no exponential: the largest score's
 * probability is 1/Z, so entropy = log Z + E[m - s] = -log p(m) + sum p (m - s) / sum p. */
static Head head_stats(const float *s, const float *p, const int32_t *keep, int64_t T, int64_t sink) {
  v8 mv = splat(-INFINITY), pm = splat(0.f);
  v8i bad = {0};
#define MAX_STEP(v, vis, t)                                              \
  do {                                                                   \
    const v8i up = vis & (v > mv);                                       \
    if (p) pm = pick(up, load_probs(p, t, T), pm);                       \
    mv = pick(up, v, mv);                                                \
    bad |= vis & (v * 0.f != v * 0.f); /* NaN or infinite */             \
  } while (0)
  FOR_GROUPS(s, keep, 0, T, MAX_STEP);
  float m = -INFINITY, top = 0.f;
  for (int i = 0; i < LANES; i++)
    if (mv[i] > m) m = mv[i], top = pm[i];
  int broken = 0;
  for (int i = 0; i < LANES; i++) broken |= bad[i];
  if (broken || m == -INFINITY) return head_exact(s, keep, T, sink);
  const int64_t edge = sink < T ? sink : T;
  float z = 0.f, sd = 0.f;
  if (p) {
    prob_sums(s, p, keep, 0, edge, m, &z, &sd);
    const float zs = z;
    prob_sums(s, p, keep, edge, T, m, &z, &sd);
    return (Head){m, -logf(top) + sd / z, zs / z, 0.f};
  }
  exp_sums(s, keep, 0, edge, m, &z, &sd);
  const float zs = z;
  exp_sums(s, keep, edge, T, m, &z, &sd);
  return (Head){m, logf(z) - sd / z, zs / z, 0.f};
}

/* A row's summary from its heads' statistics, in head order: the largest score of any head, the mean
 * entropy and sink mass, the count of non-finite scores; each head's entropy and largest score into hent
 * and hmax when they are not NULL. */
static void row_summary(const Head *heads, int64_t H, float *summary, float *hent, float *hmax) {
  float mx = -INFINITY, ent = 0.f, snk = 0.f, bad = 0.f;
  for (int64_t h = 0; h < H; h++) {
    const Head r = heads[h];
    mx = r.max > mx ? r.max : mx;
    ent += r.entropy;
    snk += r.sink;
    bad += r.nonfinite;
    if (hent) hent[h] = r.entropy;
    if (hmax) hmax[h] = r.max;
  }
  summary[0] = mx;
  summary[1] = ent / (float)H;
  summary[2] = snk / (float)H;
  summary[3] = bad;
}
#endif
