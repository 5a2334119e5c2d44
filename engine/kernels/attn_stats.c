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

void kvdoctor_attn_stats(const float *const *scores, const float *const *probs, const int32_t *keep, int64_t keep_ls,
                         int64_t L, int64_t B, int64_t H, int64_t T, int64_t sink, float *summary, float *hent,
                         float *hmax, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t lb = 0; lb < L * B; lb++) {
    const int64_t l = lb / B, b = lb % B;
    const int32_t *k = keep ? keep + l * keep_ls + b * T : NULL;
    Head heads[H];
    for (int64_t h = 0; h < H; h++) {
      const int64_t row = (b * H + h) * T;
      heads[h] = head_stats(scores[l] + row, probs ? probs[l] + row : NULL, k, T, sink);
    }
    row_summary(heads, H, summary + lb * SUMMARY, hent ? hent + lb * H : NULL, hmax ? hmax + lb * H : NULL);
  }
}
