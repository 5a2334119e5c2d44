/* kvdoctor's own thread pool for its kernels' parallel loops, with a wait whose spin the caller bounds.
 *
 * A decode step runs ~211 short parallel loops (7 a layer in decode_layer.c, the lm head's product), each
 * ending when its slowest thread does. On OpenMP (torch's libgomp) the waiting threads spin, for as long as
 * libgomp decided when torch loaded: on a quiet machine that is the fastest wait, beside other processes it
 * burns the slices a descheduled team mate needs (a step beside two busy loops took 4-13x its quiet time),
 * and OMP_WAIT_POLICY=PASSIVE, which sleeps at once, costs 9-14% quiet. libgomp's wait cannot change at run
 * time; this pool's can: kvdoctor_pool_spin sets how long a thread spins before it sleeps on a futex, and the
 * thread policy (engine/model/threads.py) sets it from the load it measures: long when the CPUs are free,
 * none when other processes want them.
 *
 * The caller runs one share of each loop itself and then takes any share no worker has claimed yet (each
 * share is claimed once, by compare-and-swap on its slot): a worker that is asleep or descheduled when a loop
 * starts costs the caller its share's work, not a wait for the scheduler to run it. Only a worker descheduled
 * in the middle of its share is waited for. Which thread runs a share never changes what it computes (the
 * kernels' iterations are independent), so results are the same on any team, spin and claim order.
 *
 * Workers (team - 1 of them; the caller is the other) start on first use and are named "kvdoctor-pool". One
 * caller at a time: a second thread that calls while the pool is busy (two Python threads in kernels at
 * once), or a share's body that calls again, runs its loop alone. A forked child starts without workers (the
 * parent's do not exist there) and starts its own when it first needs them. */
#define _GNU_SOURCE
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdalign.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { MAX_TEAM = 64 };

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() ((void)0)
#endif

#define LOAD(p) __atomic_load_n(p, __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n(p, v, __ATOMIC_SEQ_CST)

static struct {
  pthread_mutex_t lock; /* held by the one caller whose loop the workers share */
  alignas(64) uint32_t gen; /* the loop now offered (never 0): workers wait for it to change (futex) */
  uint32_t sleepers;        /* workers asleep on gen: the caller wakes them */
  alignas(64) uint32_t remaining; /* the workers' shares not finished yet: the caller waits for 0 (futex) */
  uint32_t caller_waits;          /* the caller is asleep on remaining: the last share's end wakes it */
  alignas(64) int64_t spin_ns;    /* how long a thread waiting for work or for the team spins before it sleeps */
  uint32_t resting;               /* the last caller's kernel call returned: workers sleep at once (no spin) */
  int started;                    /* workers running in this process */
  /* the loop offered: valid from gen's change until remaining reaches 0 */
  pool_body body;
  void *ctx;
  int64_t n;
  int team, interleave;
  alignas(64) uint32_t claim[MAX_TEAM]; /* share t (t >= 1) is open while claim[t] == gen; 0 once taken */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .gen = 1, .spin_ns = 1000000 /* pool.py's SPIN_US */};

static void futex_wait(uint32_t *word, uint32_t value) {
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}
static void futex_wake(uint32_t *word, int count) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0); }

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Spin until (*word == value) == equal, for at most the pool's spin budget (a worker: and only while the pool is
 * not resting); whether it came true. */
static int spin_until(uint32_t *word, uint32_t value, int equal, int worker) {
  const int64_t budget = __atomic_load_n(&P.spin_ns, __ATOMIC_RELAXED);
  const int64_t until = budget > 0 ? now_ns() + budget : 0;
  for (unsigned i = 1;; i++) {
    if ((LOAD(word) == value) == equal) return 1;
    if (budget <= 0 || (i % 32 == 0 && (now_ns() >= until || (worker && LOAD(&P.resting))))) return 0;
    RELAX();
  }
}

/* Share t of the loop offered: one contiguous run of iterations (as schedule(static) deals them) or every
 * team-th iteration from t. */
static void run_share(int t) {
  const int64_t n = P.n, team = P.team;
  if (P.interleave) {
    P.body(P.ctx, t, n, team);
    return;
  }
  const int64_t q = n / team, r = n % team, first = t * q + (t < r ? t : r);
  P.body(P.ctx, first, first + q + (t < r), 1);
}

static void share_done(void) {
  if (__atomic_sub_fetch(&P.remaining, 1, __ATOMIC_SEQ_CST) == 0 && LOAD(&P.caller_waits))
    futex_wake(&P.remaining, 1);
}

static void *worker(void *arg) {
  const int t = (int)(intptr_t)arg;
  uint32_t seen = LOAD(&P.gen);
  for (;;) {
    if (!spin_until(&P.gen, seen, 0, 1)) {
      __atomic_add_fetch(&P.sleepers, 1, __ATOMIC_SEQ_CST);
      while (LOAD(&P.gen) == seen) futex_wait(&P.gen, seen);
      __atomic_sub_fetch(&P.sleepers, 1, __ATOMIC_SEQ_CST);
    }
    seen = LOAD(&P.gen);
    uint32_t open = seen; /* the loop's fields hold until its shares are done, and this one is not yet */
    if (__atomic_compare_exchange_n(&P.claim[t], &open, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
      run_share(t);
      share_done();
    }
  }
  return NULL;
}

/* Workers up to ``want`` (the caller holds the lock); how many run. */
static int start_workers(int want) {
  while (P.started < want) {
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    const int t = P.started + 1;
    STORE(&P.claim[t], 0);
    const int failed = pthread_create(&thread, &attr, worker, (void *)(intptr_t)t);
    pthread_attr_destroy(&attr);
    if (failed) break;
    pthread_setname_np(thread, "kvdoctor-pool");
    P.started++;
  }
  return P.started;
}

static void before_fork(void) { pthread_mutex_lock(&P.lock); } /* no loop half-offered in the child's copy */
static void after_fork_parent(void) { pthread_mutex_unlock(&P.lock); }
static void after_fork_child(void) {
  P.started = 0; /* the parent's workers are not in the child */
  P.sleepers = P.caller_waits = P.remaining = 0;
  pthread_mutex_unlock(&P.lock);
}

static __thread int held; /* this thread is inside a kernel call that holds the spin (kvdoctor_pool_hold) */
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

void kvdoctor_parallel(int64_t n, int64_t threads, int interleave, pool_body body, void *ctx) {
  int64_t team = threads < n ? threads : n;
  team = team < MAX_TEAM ? team : MAX_TEAM;
  if (team <= 1 || pthread_mutex_trylock(&P.lock) != 0) {
    if (n > 0) body(ctx, 0, n, 1);
    return;
  }
  pthread_once(&once, register_fork);
  const int workers = start_workers((int)team - 1);
  team = workers + 1 < team ? workers + 1 : team;
  if (team <= 1) {
    pthread_mutex_unlock(&P.lock);
    body(ctx, 0, n, 1);
    return;
  }
  uint32_t g = P.gen + 1;
  g = g ? g : 1;
  P.body = body, P.ctx = ctx, P.n = n, P.team = (int)team, P.interleave = interleave;
  STORE(&P.remaining, (uint32_t)team - 1);
  for (int t = 1; t < team; t++) STORE(&P.claim[t], g);
  STORE(&P.resting, 0);
  STORE(&P.gen, g);
  if (LOAD(&P.sleepers)) futex_wake(&P.gen, INT_MAX);
  run_share(0);
  for (int t = 1; t < team; t++) { /* shares no worker has taken yet: a sleeping or descheduled one's */
    uint32_t open = g;
    if (__atomic_compare_exchange_n(&P.claim[t], &open, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
      run_share(t);
      share_done();
    }
  }
  if (!spin_until(&P.remaining, 0, 1, 0)) {
    for (uint32_t left; (left = LOAD(&P.remaining)) != 0;) {
      STORE(&P.caller_waits, 1);
      if (LOAD(&P.remaining) == left) futex_wait(&P.remaining, left);
    }
    STORE(&P.caller_waits, 0);
  }
  if (!held) STORE(&P.resting, 1);
  pthread_mutex_unlock(&P.lock);
}

/* A kernel call that runs many loops (the decode layers' 210 a step) holds the workers' spin between them (1) and
 * lets them rest when it returns (0). Any other loop lets them rest as it ends: what follows a kernel call is
 * torch's ops (prefill, a step on the torch path), whose own OpenMP team wants the CPUs that a worker spinning
 * for a loop that is not coming would take (the serve example ran 18-35% slower quiet before this). */
void kvdoctor_pool_hold(int on) {
  held += on ? 1 : -1;
  if (!held) STORE(&P.resting, 1);
}

/* How long (microseconds) a thread waiting for work or for its team spins before it sleeps (threads.py sets it). */
void kvdoctor_pool_spin(int64_t us) { __atomic_store_n(&P.spin_ns, us * 1000, __ATOMIC_RELAXED); }

/* The workers running in this process (a test's view: started lazily, none after fork). */
int64_t kvdoctor_pool_workers(void) { return P.started; }
