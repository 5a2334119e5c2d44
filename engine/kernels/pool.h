/* kvdoctor's own thread pool for its kernels' loops (pool.c says why and how): one library in the process,
 * loaded before any kernel (native.py), whose kvdoctor_parallel every kernel calls. */
#ifndef KVDOCTOR_POOL_H
#define KVDOCTOR_POOL_H
#include <stdint.h>

/* One thread's share of a loop over n iterations: i = first, first + step, ... while i < end. */
typedef void (*pool_body)(void *ctx, int64_t first, int64_t end, int64_t step);

/* body over 0 .. n on up to ``threads`` threads, the caller one of them, returning when every iteration ran.
 * interleave 0: thread t takes one contiguous run, as OpenMP's schedule(static) deals them (the first n % team
 * threads one iteration more); 1: iterations t, t + team, ..., as schedule(static, 1). Iterations must not
 * depend on each other: which thread runs one never changes what it computes. */
void kvdoctor_parallel(int64_t n, int64_t threads, int interleave, pool_body body, void *ctx);

/* Around a kernel call of many loops: 1 keeps the workers spinning between its loops, 0 lets them rest. */
void kvdoctor_pool_hold(int on);

/* A pool_body that runs an inline function of the model's dtype (a constant in each instantiation, so each
 * loop compiles for float32 and for bf16): NAME(ctx, first, end, step) calls FN(bf, job, first, end, step)
 * for a job of type JOB whose ``bf`` field picks it. */
#define POOL_BODY_BF(NAME, JOB, FN)                                                                     \
  static void NAME(void *ctx, int64_t first, int64_t end, int64_t step) {                               \
    const JOB *job = (const JOB *)ctx;                                                                  \
    if (job->bf) FN(1, job, first, end, step);                                                          \
    else FN(0, job, first, end, step);                                                                  \
  }
#endif
