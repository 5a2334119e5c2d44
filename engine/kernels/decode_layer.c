/* Every decoder layer of a decode step (one new token per row) in one call, for plain Llama layers
 * (RMSNorm, q/k/v/o without biases, rotate-half RoPE, SwiGLU) in float32 or bfloat16.
 *
 * The products are matvec.c's. What this adds is the glue between them, which as torch calls cost more
 * than the bf16 weights' streaming at batch 1 (~60 small ops a layer, 1.5-5 us each, a third of them
 * dtype conversions): here it is a few passes over rows of a few hundred floats.
 *
 * bf16 follows torch's bf16 arithmetic step by step: each elementwise op computes in float and rounds
 * its result to bf16 (round to nearest even), as torch's CPU kernels do and as the runner's torch path
 * did, so the same values are rounded at the same places (RMSNorm in float, scaled in bf16; each
 * product's float sums rounded once; RoPE's two products and their sum each rounded; SiLU, the SwiGLU
 * product and the residual additions each rounded). Attention runs in float32 over the K/V the cache
 * holds, as the runner's CPU attention does. Sums run in another order than torch's: float32 results
 * differ in the last bits, bf16 ones rarely.
 *
 * layer_pre:  x -> RMSNorm -> qkv product -> RoPE on q and k  => qkv (M, (H + 2 H_kv) D) in the model's dtype,
 *             and each token's new K and V heads into the layer's arena ``kv`` seen as rows of D elements at
 *             rows[(c * M + m) * H_kv + h] (the cache's store plan: ``PagedKVCache.store_rows``)
 * layer_post: attention of q over the layer's K/V (the new token's K/V stored),
 *             o product, residual, RMSNorm, gate/up product, SiLU(gate) * up, down product, residual => x
 *
 * ``kv`` is the layer's device arena; ``kv_rows[((c * M + b) * H_kv + h) * nb + j]`` the element offset in
 * it of row b's block j of kv head h, keys (c = 0) or values (c = 1); a block's ``bs`` positions of one
 * head lie contiguously, D elements each. Row b has ``lens[b]`` keys. Each row's newest-query scaled
 * scores and their probabilities go to ``scores`` and ``probs`` (M, H, T) (the hybrid eviction policy
 * weighs blocks by them); keys past a row's length get the lowest finite score and probability 0. Each
 * head's attention statistics (attn_stats.c's, what its kernel computes over the same buffers afterwards)
 * are taken right there, from the softmax's own sums (softmax_stats), and each row's new K/V digest unit
 * sums as they are stored (layer_pre). */
#include "attn_stats.h"
#include "decode_layer.h"
#include "digest.h"
#include "matvec.h"

#include <float.h>
#include <math.h>
#include <stddef.h>

#define HOT static inline __attribute__((always_inline))

/* Values of the model's dtype: bf (a compile-time constant in each instantiation) picks bf16 or float. */
HOT float ld(const void *p, int64_t i, const int bf) { return bf ? bf16((const uint16_t *)p + i) : ((const float *)p)[i]; }
HOT void st(void *p, int64_t i, float v, const int bf) {
  if (bf) ((uint16_t *)p)[i] = to_bf16(v); else ((float *)p)[i] = v;
}
HOT float rnd(float v, const int bf) { return bf ? bf16_value(v) : v; }

/* e^x of 8 floats to about 1 ulp (Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial
 * in r, times 2^n made in the exponent bits), in vector operations: glibc's expf is a call per value,
 * and SiLU alone takes 46k of them a SmolLM2 step (~0.7 ms of a 17 ms bf16 step). NaN stays NaN; x is
 * clamped to where e^x is a normal float. */
static inline v8 exp8(v8 x) {
  const v8i low = x < -87.3f, high = x > 88.3f;
  x = (v8)(((v8i)x & ~(low | high)) | ((v8i)((v8){0} - 87.3f) & low) | ((v8i)((v8){0} + 88.3f) & high));
  const float magic = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer held in the low bits */
  const v8 t = x * 1.44269504088896341f + magic, n = t - magic;
  const v8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f; /* ln 2 in two parts (Cody-Waite) */
  v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  int32_t magic_bits;
  memcpy(&magic_bits, &magic, 4);
  return p * (v8)(((v8i)t - magic_bits + 127) << 23); /* times 2^n */
}

/* Each lane rounded to bf16 and widened back (to_bf16 on 8 floats). */
static inline v8 round8_bf16(v8 f) {
  const v8u u = (v8u)f, nan = (v8u)(f != f);
  const v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u, quiet = (u | 0x400000u) & 0xffff0000u;
  return (v8)((rounded & ~nan) | (quiet & nan));
}

/* f over n floats of src into dst, 8 at a time; the tail through a zero-padded vector. */
#define EACH8(dst, src, n, f)                                                                            \
  do {                                                                                                   \
    int64_t i_ = 0;                                                                                      \
    for (; i_ + 8 <= (n); i_ += 8) { const v8 r_ = f(load_f32((src) + i_)); memcpy((dst) + i_, &r_, 32); } \
    if (i_ < (n)) {                                                                                      \
      v8 v_ = {0};                                                                                       \
      memcpy(&v_, (src) + i_, ((n) - i_) * 4);                                                           \
      v_ = f(v_);                                                                                        \
      memcpy((dst) + i_, &v_, ((n) - i_) * 4);                                                           \
    }                                                                                                    \
  } while (0)

/* SiLU(x) = x / (1 + e^-x), rounded as torch's bf16 SiLU rounds it (or not, in float32). */
static inline v8 silu8_f32(v8 x) { return x / (1.f + exp8(-x)); }
static inline v8 silu8_bf16(v8 x) { return round8_bf16(x / (1.f + exp8(-x))); }

static void matvec(const float *x, const void *w, float *y, float *scratch, int64_t M, int64_t N, int64_t K,
                   int threads, const int bf) {
  if (bf) matvec_bf16(x, w, NULL, y, scratch, M, N, K, threads, 0); /* rounded where it is used */
  else matvec_f32(x, w, NULL, y, scratch, M, N, K, threads, 0);
}

/* RMSNorm of x's M rows into float32 ``out`` (values of the model's dtype): transformers' LlamaRMSNorm in
 * bf16 (normalised in float, rounded, times the weight, rounded), F.rms_norm's x * rsqrt(mean + eps) * w
 * in float32. */
HOT void rms_norm(const void *x, const void *w, float eps, float *out, int64_t M, int64_t K, const int bf) {
  for (int64_t m = 0; m < M; m++) {
    float ss = 0.f;
    for (int64_t k = 0; k < K; k++) { const float h = ld(x, m * K + k, bf); ss += h * h; }
    const float rs = 1.f / sqrtf(ss / (float)K + eps);
    for (int64_t k = 0; k < K; k++) {
      const float h = ld(x, m * K + k, bf) * rs;
      out[m * K + k] = bf ? rnd(ld(w, k, bf) * rnd(h, bf), bf) : h * ld(w, k, bf);
    }
  }
}

/* x += y, rounded to the model's dtype (the residual addition). */
HOT void residual(void *x, const float *y, int64_t n, const int bf) {
  for (int64_t i = 0; i < n; i++) st(x, i, ld(x, i, bf) + rnd(y[i], bf), bf);
}

/* Rows from which the per-row glue (RoPE, the new K/V's digest sums, SiLU(gate) * up) is shared between the threads:
 * at batch 8 a bf16 SmolLM2 step spent ~0.9 ms in it on one core while the other waited. */
enum { ROWS_PARALLEL = 4 };

/* digest.c's weighted sum of n values of the model's dtype as integers (a float's bit pattern). */
HOT uint64_t unit_sum(const void *x, const int64_t *w, int64_t n, const int bf) {
  return bf ? dot_i16((const int16_t *)x, w, n) : dot_i32((const int32_t *)x, w, n);
}

/* Rows of layer_pre's per-row glue (a share of the pool's): q and k rotated, v copied, into qkv (its row
 * stride Q), from the product y; with units, each row's new K and V heads as a digest unit sum by the
 * weights wk and wv (H_kv, D), taken as they are stored (still in the core's cache: after the step they cost
 * a cold pass). */
typedef struct {
  int bf;
  int64_t H, Hkv, D, Q;
  const float *y;
  const void *cos, *sin;
  void *qkv;
  const int64_t *wk, *wv;
  uint64_t *units;
} rope_job;

HOT void rope_rows_of(const int bf, const rope_job *j, int64_t first, int64_t end, int64_t step) {
  const int64_t H = j->H, Hkv = j->Hkv, D = j->D, Q = j->Q, half = D / 2, size = bf ? 2 : 4;
  for (int64_t m = first; m < end; m += step) {
    const float *ym = j->y + m * Q;
    for (int64_t h = 0; h < H + Hkv; h++) /* q and k heads, rotated: x cos + rotate_half(x) sin */
      for (int64_t i = 0; i < D; i++) {
        const int64_t at = h * D + i, other = i < half ? at + half : at - half; /* a select: loops vectorize */
        const float sign = i < half ? -1.f : 1.f;
        const float a = rnd(ym[at], bf), r = sign * rnd(ym[other], bf);
        const float c = ld(j->cos, m * D + i, bf), s = ld(j->sin, m * D + i, bf);
        st(j->qkv, m * Q + at, rnd(a * c, bf) + rnd(r * s, bf), bf);
      }
    for (int64_t i = (H + Hkv) * D; i < Q; i++) st(j->qkv, m * Q + i, ym[i], bf); /* v */
    if (j->units) {
      const char *k = (const char *)j->qkv + (m * Q + H * D) * size;
      j->units[m] = unit_sum(k, j->wk, Hkv * D, bf) + unit_sum(k + Hkv * D * size, j->wv, Hkv * D, bf);
    }
  }
}
POOL_BODY_BF(rope_rows, rope_job, rope_rows_of)

/* With units (M of them, or NULL), each row's new K/V digest unit sum (rope_rows). */
HOT void layer_pre(const int bf, int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D, const void *x,
                   const void *norm_w, float eps, const void *wqkv, const void *cos, const void *sin, void *qkv,
                   void *kv, const int64_t *rows, const int64_t *wk, const int64_t *wv, uint64_t *units,
                   float *scratch, int threads) {
  const int64_t Q = (H + 2 * Hkv) * D, size = bf ? 2 : 4;
  float *xn = scratch, *y = xn + M * hidden, *mv = y + M * Q;
  rms_norm(x, norm_w, eps, xn, M, hidden, bf);
  matvec(xn, wqkv, y, mv, M, Q, hidden, threads, bf);
  rope_job rope = {bf, H, Hkv, D, Q, y, cos, sin, qkv, wk, wv, units};
  kvdoctor_parallel(M, M >= ROWS_PARALLEL ? threads : 1, 0, rope_rows, &rope);
  /* the stores in row order, on one thread: where two rows' plans share a slot (a fault's misaligned write),
   * the later row's K/V is what the slot holds, as the cache's own store and the digests' records take it */
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = 0; c < 2; c++) /* k, then v, of each kv head */
      for (int64_t h = 0; h < Hkv; h++)
        memcpy((char *)kv + rows[(c * M + m) * Hkv + h] * D * size, (const char *)qkv + (m * Q + (H + c * Hkv + h) * D) * size,
               D * size);
}

/* 8 values of the model's dtype at p[i..i+8) as floats. */
HOT v8 load8(const void *p, int64_t i, const int bf) {
  if (!bf) return load_f32((const float *)p + i);
  v8u u;
  for (int j = 0; j < 8; j++) u[j] = ((const uint16_t *)p)[i + j];
  return (v8)(u << 16);
}

enum { D_MAX = 256, G_MAX = 8 }; /* head sizes and query heads per kv head the kernel takes (decode_layer.py) */

/* Lane u: the sum of a[u]'s lanes (lanes_sum4's pairs, for eight vectors). */
HOT v8 lanes_sum8(const v8 a[8]) {
  const v8 lo = lanes_sum4(a), hi = lanes_sum4(a + 4);
  return SHUFFLE(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* The key or value row of D values at element offset i of kv, fetched ahead: a row's blocks lie anywhere
 * in the arena (paged), and each starts the hardware prefetcher cold. */
HOT void prefetch_row(const void *kv, int64_t i, int64_t D, const int bf) {
  const char *at = (const char *)kv + i * (bf ? 2 : 4);
  for (int64_t l = 0; l < D * (bf ? 2 : 4); l += 64) __builtin_prefetch(at + l);
}

/* d[t] = e^d[t] over n values (scores less their largest), and the sum of d[t] e^d[t] before: the
 * softmax's numerators and, in the same pass, what the entropy needs of them. */
HOT float exp_moment(float *d, int64_t n) {
  v8 acc = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 x = load_f32(d + i), e = exp8(x);
    acc += x * e;
    memcpy(d + i, &e, sizeof e);
  }
  if (i < n) { /* padding lanes hold 0: e^0 * 0 adds nothing */
    v8 x = {0};
    memcpy(&x, d + i, (size_t)(n - i) * 4);
    const v8 e = exp8(x);
    acc += x * e;
    memcpy(d + i, &e, (size_t)(n - i) * 4);
  }
  return lanes_sum(acc);
}

/* A head's statistics (attn_stats.c's Head) from its softmax as attention takes it: the largest score mx,
 * e = e^(s - mx) over its len keys summing to z, and moment = sum (s - mx) e. entropy = log z - moment / z
 * (head_stats' value without another pass over the keys: this costs a multiply-add per key where the
 * passes afterwards cost 0.18 ms of a SmolLM2 batch-8 step); the sink is the first sink keys' share of z.
 * A non-finite score leaves mx, z or the moment non-finite: that head is done again exactly (head_exact). */
HOT Head softmax_stats(const float *s, const float *e, int64_t len, int64_t sink, float mx, float z, float moment) {
  if (!(isfinite(mx) && isfinite(z) && isfinite(moment))) return head_exact(s, NULL, len, sink);
  float zs = 0.f;
  for (int64_t t = 0; t < sink && t < len; t++) zs += e[t];
  return (Head){mx, logf(z) - moment / z, zs / z, 0.f};
}

/* A sampled read's verification inside attention (digest.py): per row the K blocks to verify (M, K: block
 * indices, -1 for none), the digest's weights of K and V (H_kv, D) and of this layer's record columns (mix: U,
 * one per position), and out (M, K, H_kv): each row's, pick's and kv head's share of the block's digest in
 * this layer. */
typedef struct {
  const int64_t *block, *wk, *wv, *mix;
  int64_t K;
  uint64_t *out;
} Verify;

/* Row b, kv head kh and the G query heads that share it: scores, softmax and the weighted sums of V into
 * o (G heads of D floats; D a multiple of 8). Each key and value row is read once for the G heads (it was
 * read G times, a head at a time, from L2 or beyond), the next block's rows are fetched while a block is
 * read, and scores are reduced eight keys at a time (one horizontal sum per eight keys, not per key):
 * attention took 4.2 ms of a 33 ms SmolLM2 step at batch 8 (the step without it, 29.2), and this is
 * 1.6-1.9x faster over the same paged K/V (a harness of 30 layers' arenas). */
HOT void attend_group(const int bf, int64_t M, int64_t H, int64_t Hkv, int64_t D, const void *qkv, const void *kv,
                      const int64_t *kv_rows, int64_t nb, int64_t bs, const int32_t *lens, float scale,
                      float *scores, float *probs, int64_t T, int64_t b, int64_t kh, float *o, Head *stat,
                      int64_t sink, const Verify *vf) {
  const int64_t G = H / Hkv, C = D / 8, Q = (H + 2 * Hkv) * D, len = lens[b], blocks = (len + bs - 1) / bs;
  const int64_t *krow = kv_rows + (b * Hkv + kh) * nb, *vrow = kv_rows + ((M + b) * Hkv + kh) * nb;
  float *s = scores + (b * H + kh * G) * T, *p = probs + (b * H + kh * G) * T; /* head g's at + g * T */
  v8 q[G_MAX][D_MAX / 8], acc[G_MAX][D_MAX / 8];
  for (int64_t g = 0; g < G; g++)
    for (int64_t c = 0; c < C; c++) {
      q[g][c] = load8(qkv, b * Q + (kh * G + g) * D + c * 8, bf);
      acc[g][c] = (v8){0};
    }
  int64_t j = 0, u = 0; /* key t's block and position in it */
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = len - t0 < 8 ? len - t0 : 8;
    v8 dot[G_MAX][8] = {{{0}}};
    for (int64_t i = 0; i < n; i++) {
      const int64_t at = krow[j] + u * D;
      if (j + 1 < blocks) prefetch_row(kv, krow[j + 1] + u * D, D, bf);
      if (++u == bs) { u = 0; j++; }
      for (int64_t c = 0; c < C; c++) {
        const v8 k = load8(kv, at + c * 8, bf);
        for (int64_t g = 0; g < G; g++) dot[g][i] += q[g][c] * k;
      }
    }
    for (int64_t g = 0; g < G; g++) {
      const v8 sums = lanes_sum8(dot[g]) * scale;
      memcpy(s + g * T + t0, &sums, (size_t)n * sizeof(float));
    }
  }
  for (int64_t i = 0; i < bs && i < len; i++) prefetch_row(kv, vrow[0] + i * D, D, bf);
  float sum[G_MAX];
  for (int64_t g = 0; g < G; g++) {
    const float *sg = s + g * T;
    float *pg = p + g * T, mx = -FLT_MAX;
    for (int64_t t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
    for (int64_t t = 0; t < len; t++) pg[t] = sg[t] - mx;
    const float moment = exp_moment(pg, len);
    sum[g] = 0.f;
    for (int64_t t = 0; t < len; t++) sum[g] += pg[t];
    if (stat) stat[g] = softmax_stats(sg, pg, len, sink, mx, sum[g], moment);
  }
  j = 0, u = 0;
  for (int64_t t = 0; t < len; t++) {
    const int64_t at = vrow[j] + u * D;
    if (j + 1 < blocks) prefetch_row(kv, vrow[j + 1] + u * D, D, bf);
    if (++u == bs) { u = 0; j++; }
    v8 pt[G_MAX];
    for (int64_t g = 0; g < G; g++) {
      p[g * T + t] /= sum[g];
      pt[g] = (v8){0} + p[g * T + t];
    }
    for (int64_t c = 0; c < C; c++) {
      const v8 v = load8(kv, at + c * 8, bf);
      for (int64_t g = 0; g < G; g++) acc[g][c] += pt[g] * v;
    }
  }
  for (int64_t g = 0; g < G; g++) {
    memcpy(o + g * D, acc[g], (size_t)D * sizeof *o);
    for (int64_t t = len; t < T; t++) { s[g * T + t] = -FLT_MAX; p[g * T + t] = 0.f; }
  }
  for (int64_t pick = 0; vf && pick < vf->K; pick++) { /* the row's blocks verified this step: bytes just read */
    const int64_t j = vf->block[b * vf->K + pick], size = bf ? 2 : 4;
    if (j < 0) continue;
    const int64_t n = len - j * bs < bs ? len - j * bs : bs;
    uint64_t share = 0;
    for (int64_t u = 0; u < n; u++)
      share += (uint64_t)vf->mix[u] * (unit_sum((const char *)kv + (krow[j] + u * D) * size, vf->wk + kh * D, D, bf) +
                                       unit_sum((const char *)kv + (vrow[j] + u * D) * size, vf->wv + kh * D, D, bf));
    vf->out[(b * vf->K + pick) * Hkv + kh] = share;
  }
}

/* (row, kv head) pairs of a layer's attention (a share of the pool's): attend_group's arguments. */
typedef struct {
  int bf;
  int64_t M, H, Hkv, D, nb, bs, T, sink;
  const void *qkv, *kv;
  const int64_t *kv_rows;
  const int32_t *lens;
  float scale;
  float *scores, *probs, *o;
  Head *stats;
  const Verify *vf;
} attend_job;

HOT void attend_pairs_of(const int bf, const attend_job *j, int64_t first, int64_t end, int64_t step) {
  const int64_t H = j->H, Hkv = j->Hkv;
  for (int64_t bk = first; bk < end; bk += step) {
    const int64_t first_head = bk / Hkv * H + bk % Hkv * (H / Hkv); /* the group's first head, as b * H + h */
    attend_group(bf, j->M, H, Hkv, j->D, j->qkv, j->kv, j->kv_rows, j->nb, j->bs, j->lens, j->scale, j->scores,
                 j->probs, j->T, bk / Hkv, bk % Hkv, j->o + first_head * j->D, j->stats ? j->stats + first_head : NULL,
                 j->sink, j->vf);
  }
}
POOL_BODY_BF(attend_pairs, attend_job, attend_pairs_of)

/* Rows of SiLU(gate) * up (a share of the pool's): y's rows hold gate then up (2 I), out's the product, rounded. */
typedef struct {
  int bf;
  int64_t I;
  float *y, *out;
} swiglu_job;

HOT void swiglu_rows_of(const int bf, const swiglu_job *j, int64_t first, int64_t end, int64_t step) {
  const int64_t I = j->I;
  for (int64_t m = first; m < end; m += step) {
    float *g = j->y + m * 2 * I, *u = g + I, *out = j->out + m * I;
    for (int64_t i = 0; i < 2 * I; i++) g[i] = rnd(g[i], bf);
    if (bf) EACH8(g, g, I, silu8_bf16);
    else EACH8(g, g, I, silu8_f32);
    for (int64_t i = 0; i < I; i++) out[i] = rnd(g[i] * u[i], bf);
  }
}
POOL_BODY_BF(swiglu_rows, swiglu_job, swiglu_rows_of)

HOT void layer_post(const int bf, int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D, int64_t I, void *x,
                    const void *qkv, const void *kv, const int64_t *kv_rows, int64_t nb, int64_t bs,
                    const int32_t *lens, float scale, float *scores, float *probs, int64_t T, Head *stats,
                    int64_t sink, const Verify *vf, const void *wo, const void *norm_w, float eps, const void *wgu,
                    const void *wd, float *scratch, int threads) {
  float *o = scratch, *y = o + M * H * D, *xn = y + M * 2 * I, *mv = xn + M * (I > hidden ? I : hidden);
  const int64_t work = M * H * T * D;
  /* rows of different lengths: (row, kv head) pairs dealt in turn, or the longer rows all fall to one thread */
  attend_job attend = {bf, M, H, Hkv, D, nb, bs, T, sink, qkv, kv, kv_rows, lens, scale, scores, probs, o, stats, vf};
  kvdoctor_parallel(M * Hkv, work > 65536 ? threads : 1, 1, attend_pairs, &attend);
  for (int64_t i = 0; i < M * H * D; i++) o[i] = rnd(o[i], bf);
  matvec(o, wo, y, mv, M, hidden, H * D, threads, bf);
  residual(x, y, M * hidden, bf);
  rms_norm(x, norm_w, eps, xn, M, hidden, bf);
  matvec(xn, wgu, y, mv, M, 2 * I, hidden, threads, bf);
  swiglu_job swiglu = {bf, I, y, xn}; /* SiLU(gate) * up, the product rounded too */
  kvdoctor_parallel(M, M >= ROWS_PARALLEL ? threads : 1, 0, swiglu_rows, &swiglu);
  matvec(xn, wd, y, mv, M, hidden, I, threads, bf);
  residual(x, y, M * hidden, bf);
}

/* The fields of decode_args (decode_layer.h) as locals of the same names. */
#define DECODE_LOCAL(T, name) T const name = a->name;

HOT void decode_layers(const int bf, const decode_args *a) {
  DECODE_ARGS(DECODE_LOCAL)
  (void)is_bf16; /* the dtype is bf, a constant in each instantiation */
  const int64_t Q = (H + 2 * Hkv) * D, size = bf ? 2 : 4;
  for (int64_t l = 0; l < L; l++) {
    const layer_weights *w = layers + l;
    const Verify vf = {vblock, wk, wv, mix + l * U, vk, vsums + l * M * vk * Hkv};
    void *q = (char *)qkv + l * M * Q * size;
    float *scores = newest + (keep ? l : 0) * 2 * M * H * T, *probs = scores + M * H * T;
    layer_pre(bf, M, hidden, H, Hkv, D, x, w->norm1, w->eps1, w->qkv, cos, sin, q, kv[l], rows, wk, wv,
              units ? units + l * M : NULL, scratch, threads);
    layer_post(bf, M, hidden, H, Hkv, D, I, x, q, kv[l], kv_rows, nb, bs, lens, w->scale, scores, probs, T,
               heads ? heads + l * M * H : NULL, sink, vblock ? &vf : NULL, w->o, w->norm2, w->eps2, w->gate_up, w->down,
               scratch, threads);
  }
  if (final_w) { /* x normalised by the model's final norm, in place: what the lm head reads */
    rms_norm(x, final_w, final_eps, scratch, M, hidden, bf);
    for (int64_t i = 0; i < M * hidden; i++) st(x, i, scratch[i], bf);
  }
  for (int64_t lm = 0; heads && lm < L * M; lm++) {
    row_summary(heads + lm * H, H, summary + lm * SUMMARY, hent ? hent + lm * H : NULL, hmax ? hmax + lm * H : NULL);
    if (counts) counts[lm] = (int64_t)summary[lm * SUMMARY + 3]; /* the event's integers, without a numpy pass */
  }
  if (units) {
    for (int64_t m = 0; m < M; m++) /* each token's share of a record's digest at every column it may take */
      for (int64_t c = 0; c < U; c++) {
        uint64_t acc = 0;
        for (int64_t l = 0; l < L; l++) acc += units[l * M + m] * (uint64_t)mix[l * U + c];
        shares[m * U + c] = acc;
      }
  }
  for (int64_t mk = 0; vblock && mk < M * vk; mk++) { /* a verified block's digest: its shares over layers and heads */
    if (vblock[mk] < 0) continue;
    uint64_t total = 0;
    for (int64_t l = 0; l < L; l++)
      for (int64_t kh = 0; kh < Hkv; kh++) total += vsums[(l * M * vk + mk) * Hkv + kh];
    vtotal[mk] = total;
  }
}

/* Every layer of a decode step, its arguments the fields of decode_args (decode_layer.h), is_bf16 1 for a
 * bf16 model and 0 for float32: x (M, hidden) in place; each layer's q/k/v into qkv (L, M, Q), its new K/V
 * into kv[l] at rows; its newest-query scores and probabilities into newest (L, 2, M, H, T), or all into
 * one (2, M, H, T) when keep is 0. With heads (scratch of L * M * H Head), the attention statistics of
 * every layer and row (attn_stats.c's, over each row's keys, the first sink of them the sink) into summary
 * (L, M, 4), and each head's entropy and largest score into hent and hmax (L, M, H) and the non-finite counts
 * as integers into counts (L, M) when not NULL. With
 * units, the digest unit sums (digest.c) of each layer's new tokens' K and V, weighted by wk and wv (Hkv, D),
 * into units (L, M): what the cache's digests would sum from them (digest.py, _Layout.kv_units); and each
 * token's share of a block record's digest at each of its U columns, by the digest's weights mix (L, U),
 * into shares (M, U). With vblock (M, vk: up to vk block indices of each row's, -1 for none), each such
 * block's digest over the bytes attention read (digest.py's, by the same weights; its positions below the
 * row's length) into vtotal (M, vk), each layer's and kv head's share of it into vsums (L, M, vk, H_kv). With final_w, x ends normalised
 * by the model's final RMSNorm (weight final_w, final_eps), as the lm head reads it. */
void kvdoctor_decode_layers(const decode_args *args) {
  kvdoctor_pool_hold(1);
  if (args->is_bf16) decode_layers(1, args);
  else decode_layers(0, args);
  kvdoctor_pool_hold(0);
}

/* decode_args' layout as this library was compiled: decode_layer.py checks its mirror against it at load. */
#define DECODE_OFFSET(T, name) (int64_t)offsetof(decode_args, name),
#define DECODE_COUNT(T, name) +1
#define DECODE_NAME(T, name) #name " "
static const int64_t args_layout[] = {0 DECODE_ARGS(DECODE_COUNT), (int64_t)sizeof(decode_args),
                                      DECODE_ARGS(DECODE_OFFSET)};
const int64_t *kvdoctor_decode_args_layout(void) { return args_layout; }
const char *kvdoctor_decode_args_names(void) { return DECODE_ARGS(DECODE_NAME); }
