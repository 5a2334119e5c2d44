/* y (M, N) = x (M, K) . w (N, K)^T (+ b (N,)) for the few rows of a decode step; x, b, y float32,
 * w float32 or bfloat16 (the top half of a float: on AMX tiles, in AVX-512 BF16 dot products, or widened).
 *
 * Bandwidth-bound at one row: every weight is read once per call whatever M is. Rows of w are split
 * across kvdoctor's thread pool (pool.c), four at a time; each group of four is multiplied by XROWS of x's
 * rows at a time (4 where AVX-512 gives 32 vector registers: 16 sums, 4 inputs, a weight; 2 with AVX2's 16),
 * so one load of a weight vector feeds XROWS FMAs and a group is read from memory once and from the core's
 * cache M / XROWS - 1 times.
 * At 8 rows the products are as much compute as streaming: two passes of four rows, not four of two,
 * took a SmolLM2 step's products from 24.1 to 21.0 ms on a 2-core Xeon (AVX-512), and float32 runs in
 * 16-lane vectors there. Each output keeps one vector of partial sums added at the end, which rounds
 * closer to the exact product than one running sum. GCC's vector extensions compile to AVX2 or AVX-512
 * under -march=native and to SSE elsewhere.
 *
 * bf16 multiplies x rounded to bf16 (as torch's bf16 product takes bf16 inputs; a bf16 model's activations
 * are bf16 values already), the products summed in float. With AVX-512 BF16 (vdpbf16ps) one instruction
 * multiplies 32 weights by 32 of x; x is converted once per call into ``scratch``. Elsewhere one 32-byte
 * load holds 16 weights, two to each 32-bit lane. The lane shifted left by 16 is the float of the even
 * weight, the lane with its low half cleared the float of the odd one: two integer operations widen 16
 * weights (a per-element conversion took six instructions for 8, and made the one-row product
 * compute-bound at 8.5 GB/s). x's rows are reordered to match once per call, into ``scratch``: per 16
 * elements, the 8 even ones then the 8 odd ones. */
#include "matvec.h"

/* The products for Python (matvec.py): x, b, y float32; w float32 or bf16; round: outputs rounded to bf16 values. */
void kvdoctor_matvec_f32(const float *x, const float *w, const float *b, float *y, float *scratch, int64_t M,
                         int64_t N, int64_t K, int threads, int round) {
  matvec_f32(x, w, b, y, scratch, M, N, K, threads, round);
}

void kvdoctor_matvec_bf16(const float *x, const uint16_t *w, const float *b, float *y, float *scratch, int64_t M,
                          int64_t N, int64_t K, int threads, int round) {
  matvec_bf16(x, w, b, y, scratch, M, N, K, threads, round);
}
