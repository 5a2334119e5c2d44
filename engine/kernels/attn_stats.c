/* Statistics of the newest query's attention in every layer of a step, in two vector passes per head
 * over its scores, where torch takes about a dozen passes over all of them (attention.py says which).
 *
 * scores[l] is layer l's (B, H, T) float32 scores, contiguous; probs[l] (or probs NULL) the softmax
 * attention took of them, laid out alike; keep (or NULL: every key visible) the keys each row's query
 * may see, (B, T) int32 (0: hidden; a lane wide, as the vectors use it), keep_ls apart per layer (0:
 * one mask for all layers). Per (layer, row): summary[4] = max over heads of the head's largest score,
 * mean over heads of the entropy of its softmax, mean over heads of the probability on the first `sink`
 * keys, and the count of non-finite scores; per head (when hent/hmax are not NULL) the entropy and the
 * largest score.
 *
 * Pass one finds the largest visible score m, and notes a visible score that is not finite (s * 0 is
 * then NaN). Pass two sums e = exp(s - m), (s - m) e and the sink keys' e, for entropy = log Z - E[s - m];
 * given the probabilities, the same sums of p instead, with no exponential (head_stats says how). A head
 * with a non-finite visible score is done again exactly, in double (the rare case): statistics over its
 * finite scores, and the count of the non-finite ones, plus every visible key when one is NaN or +inf
 * (they break the whole softmax), as attention.py's torch passes define them. */
#include "attn_stats.h"

/* One call's statistics (a share of the pool's: (layer, row) pairs). */
typedef struct {
  const float *const *scores, *const *probs;
  const int32_t *keep;
  int64_t keep_ls, B, H, T, sink;
  float *summary, *hent, *hmax;
} stats_job;

static void stats_rows(void *ctx, int64_t first, int64_t end, int64_t step) {
  const stats_job *j = (const stats_job *)ctx;
  const int64_t B = j->B, H = j->H, T = j->T;
  for (int64_t lb = first; lb < end; lb += step) {
    const int64_t l = lb / B, b = lb % B;
    const int32_t *k = j->keep ? j->keep + l * j->keep_ls + b * T : NULL;
    Head heads[H];
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = (b * H + h) * T;
      heads[h] = head_stats(j->scores[l] + row, j->probs ? j->probs[l] + row : NULL, k, T, j->sink);
    }
    row_summary(heads, H, j->summary + lb * SUMMARY, j->hent ? j->hent + lb * H : NULL, j->hmax ? j->hmax + lb * H : NULL);
  }
}

void kvdoctor_attn_stats(const float *const *scores, const float *const *probs, const int32_t *keep, int64_t keep_ls,
                         int64_t L, int64_t B, int64_t H, int64_t T, int64_t sink, float *summary, float *hent,
                         float *hmax, int threads) {
  stats_job job = {scores, probs, keep, keep_ls, B, H, T, sink, summary, hent, hmax};
  kvdoctor_parallel(L * B, threads, 0, stats_rows, &job);
}
