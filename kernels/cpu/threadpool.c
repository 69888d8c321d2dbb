/* threadpool.c - a fixed pool of pthreads that runs kiln_parallel_for jobs.
 * One job at a time (ops run one after another); the caller thread takes part. Idle
 * workers spin briefly before they sleep (spin_iters).
 * Work is handed out in chunks through an atomic counter, so uneven chunks balance.
 * A job carries its submitter's precision scope (precision.h), which the workers
 * take on while they run its chunks: the kernels answer as the calling thread would. */
#define _GNU_SOURCE
#include "threadpool.h"
#include "../../runtime/precision.h"
#include "../../runtime/tunables.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct {
    void (*fn)(void *, int64_t, int64_t);
    void *ctx;
    int64_t n, chunk;
    atomic_int_fast64_t next;
    atomic_int pending;            /* workers still inside this job */
    int prec_scope;                /* the submitter's kiln_precision_scope_current() */
} job_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t submit_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done = PTHREAD_COND_INITIALIZER;
static pthread_t *workers;
static int n_threads;               /* including the caller */
static int started;
static int stopping;
static uint64_t generation;
static uint64_t base_generation; /* generation when the workers were created */
static job_t *current;
static _Thread_local int tl_index = 0;
static _Thread_local int tl_in_job = 0;

static int default_threads(void)
{
    int n = kiln_tunable_int("KILN_THREADS", 0);
    if (n > 0) return n > 256 ? 256 : n;
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    return c > 0 ? (int)c : 1;
}

static void run_chunks(job_t *j)
{
    for (;;) {
        int64_t b = atomic_fetch_add(&j->next, j->chunk);
        if (b >= j->n) break;
        int64_t e = b + j->chunk < j->n ? b + j->chunk : j->n;
        j->fn(j->ctx, b, e);
    }
}

/* Before sleeping on a condition variable, a worker waiting for the next job and the
 * caller waiting for a job's end spin this many pause instructions (tens of
 * microseconds): the ops of a network follow one another closely, and a wake-up through
 * the kernel costs more than that on a virtual machine (a network evaluation dispatches
 * about a thousand jobs). Longer spins save more wake-ups but keep other threads (the
 * weight streamer's copy thread) off the cores between jobs (README: speed).
 * KILN_SPIN=0 sleeps at once. */
static int spin_iters(void)
{
    static atomic_int n = -1;
    int v = atomic_load_explicit(&n, memory_order_relaxed);
    if (v < 0) {
        v = kiln_tunable_int("KILN_SPIN", 4000);
        if (v < 0) v = 4000;
        atomic_store_explicit(&n, v, memory_order_relaxed);
    }
    return v;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *worker_main(void *arg)
{
    tl_index = (int)(intptr_t)arg;
    tl_in_job = 1; /* nested parallel_for from a worker runs serially */
    /* jobs before this worker existed are not its own: start from the generation
     * at creation (written before pthread_create, so visible here) */
    uint64_t seen = base_generation;
    for (;;) {
        for (int s = spin_iters(); s > 0; s--) {
            if (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) != seen || __atomic_load_n(&stopping, __ATOMIC_ACQUIRE)) break;
            cpu_relax();
        }
        pthread_mutex_lock(&lock);
        while (!stopping && generation == seen) pthread_cond_wait(&wake, &lock);
        if (stopping) break;
        seen = generation;
        job_t *j = current;
        pthread_mutex_unlock(&lock);
        int tok = kiln_precision_scope_begin(j->prec_scope);
        run_chunks(j);
        kiln_precision_scope_end(tok);
        pthread_mutex_lock(&lock);
        if (atomic_fetch_sub(&j->pending, 1) == 1) pthread_cond_broadcast(&done);
        pthread_mutex_unlock(&lock);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

static void start_pool(int n)
{
    n_threads = n < 1 ? 1 : n;
    stopping = 0;
    base_generation = generation;
    workers = n_threads > 1 ? calloc((size_t)n_threads - 1, sizeof *workers) : NULL;
    int made = 1;
    for (int i = 1; i < n_threads && workers; i++) {
        if (pthread_create(&workers[i - 1], NULL, worker_main, (void *)(intptr_t)i) != 0) break;
        made++;
    }
    n_threads = made;
    started = 1;
}

static void stop_pool(void)
{
    pthread_mutex_lock(&lock);
    __atomic_store_n(&stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    for (int i = 1; i < n_threads; i++) pthread_join(workers[i - 1], NULL);
    free(workers);
    workers = NULL;
    started = 0;
}

static void ensure_started(void)
{
    if (!started) {
        pthread_mutex_lock(&submit_lock);
        if (!started) start_pool(default_threads());
        pthread_mutex_unlock(&submit_lock);
    }
}

int kiln_cpu_threads(void)
{
    ensure_started();
    return n_threads;
}

int kiln_thread_index(void) { return tl_index; }

void kiln_cpu_set_threads(int n)
{
    pthread_mutex_lock(&submit_lock);
    if (started) stop_pool();
    start_pool(n <= 0 ? default_threads() : n);
    pthread_mutex_unlock(&submit_lock);
}

void kiln_parallel_for(int64_t n, int64_t grain, void (*fn)(void *, int64_t, int64_t), void *ctx)
{
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    ensure_started();
    if (tl_in_job || n_threads == 1 || n <= grain) {
        fn(ctx, 0, n);
        return;
    }
    /* about 4 chunks per thread for balance, never below grain */
    int64_t chunk = (n + (int64_t)n_threads * 4 - 1) / ((int64_t)n_threads * 4);
    if (chunk < grain) chunk = grain;
    job_t j;
    j.fn = fn; j.ctx = ctx; j.n = n; j.chunk = chunk;
    j.prec_scope = kiln_precision_scope_current();
    atomic_init(&j.next, 0);
    pthread_mutex_lock(&submit_lock);
    atomic_init(&j.pending, n_threads - 1);
    pthread_mutex_lock(&lock);
    current = &j;
    __atomic_store_n(&generation, generation + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    tl_in_job = 1;
    run_chunks(&j);
    tl_in_job = 0;
    for (int s = spin_iters(); s > 0 && atomic_load(&j.pending) > 0; s--) cpu_relax();
    pthread_mutex_lock(&lock);
    while (atomic_load(&j.pending) > 0) pthread_cond_wait(&done, &lock);
    current = NULL;
    pthread_mutex_unlock(&lock);
    pthread_mutex_unlock(&submit_lock);
}
