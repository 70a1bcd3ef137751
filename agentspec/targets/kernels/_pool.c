/* A small persistent thread pool for the native kernels: one call splits a range of tasks
   into contiguous parts, one per thread, the caller running the first part itself.

   Why not OpenMP: torch ships its own OpenMP runtime, and a second one in the process
   would spin against it. Why not a thread per call: a decode step makes ~100 product calls
   of 0.1-1 ms each, and creating a thread costs tens of microseconds. The workers spin a
   short while after a job (the next product follows within microseconds inside a step),
   then sleep on a condition variable, so an idle process uses no CPU.

   Which thread computes which task never changes a value: a task's outputs are computed
   by one thread from start to end (the kernels keep no shared accumulators), so the bits
   do not depend on the thread count. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "_native.h"

#define MAX_WORKERS 63
#define SPIN_ROUNDS 20000 /* ~1 ms of pauses: a step's next product comes sooner */

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cond = PTHREAD_COND_INITIALIZER;
static int started = 0;                 /* workers created so far */
static atomic_uint_fast64_t generation; /* bumped once per job */
static atomic_int remaining;            /* worker parts of the current job not done yet */
static atomic_int sleepers;

/* The generation a worker was created at: the jobs it must run come after it. */
static uint_fast64_t born[MAX_WORKERS];

static struct {
    agentspec_task fn;
    void *ctx;
    int64_t n;
    int parts;
} job;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void run_part(int part) {
    int64_t begin = job.n * part / job.parts, end = job.n * (part + 1) / job.parts;
    if (begin < end) job.fn(job.ctx, begin, end);
}

static void *worker(void *arg) {
    int index = (int)(intptr_t)arg; /* runs part index + 1 of a job */
    uint_fast64_t seen = born[index];
    for (;;) {
        uint_fast64_t now;
        int spins = 0;
        while ((now = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&wake_lock);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load_explicit(&generation, memory_order_acquire) == seen)
                pthread_cond_wait(&wake_cond, &wake_lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&wake_lock);
            spins = 0;
        }
        seen = now;
        if (index + 1 < job.parts) run_part(index + 1);
        /* Every started worker acknowledges every job, so none can still be reading
           this job's fields when the next one is set. */
        atomic_fetch_sub_explicit(&remaining, 1, memory_order_release);
    }
    return 0;
}

/* A forked child has the parent's counters but none of its workers: it starts its own. */
static void forget_workers(void) {
    started = 0;
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&pool_lock, 0);
    pthread_mutex_init(&wake_lock, 0);
    pthread_cond_init(&wake_cond, 0);
}

static pthread_once_t fork_hook = PTHREAD_ONCE_INIT;

static void install_fork_hook(void) { pthread_atfork(0, 0, forget_workers); }

void agentspec_parallel(agentspec_task fn, void *ctx, int64_t n, int threads) {
    pthread_once(&fork_hook, install_fork_hook);
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads > n) threads = (int)n;
    if (threads <= 1) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&pool_lock);
    while (started < threads - 1) {
        pthread_t t;
        born[started] = atomic_load(&generation);
        if (pthread_create(&t, 0, worker, (void *)(intptr_t)started) != 0) break;
        pthread_detach(t);
        started++;
    }
    if (started < threads - 1) threads = started + 1; /* fewer threads: same bits */
    job.fn = fn;
    job.ctx = ctx;
    job.n = n;
    job.parts = threads;
    /* Every started worker wakes for a job; those past the job's parts only acknowledge. */
    atomic_store_explicit(&remaining, started, memory_order_relaxed);
    pthread_mutex_lock(&wake_lock);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    if (atomic_load(&sleepers) > 0) pthread_cond_broadcast(&wake_cond);
    pthread_mutex_unlock(&wake_lock);
    run_part(0);
    while (atomic_load_explicit(&remaining, memory_order_acquire) > 0) cpu_relax();
    pthread_mutex_unlock(&pool_lock);
}
