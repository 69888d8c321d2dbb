/* test_precision_scope.c - the thread-scoped precision (runtime/precision.c): a scope
 * wins over the process-wide setting for its thread only, nests and restores; the CPU
 * pool's workers run a job under the submitter's scope (kernels/cpu/threadpool.c); a
 * linear layer inside a bf16 scope computes what a process-wide bf16 run computes. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"

#include "cpu_internal.h"
#include "cpu_kernels.h"
#include "precision.h"
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

static void t_scope_wins_nests_restores(void)
{
    kiln_precision_set(KILN_PREC_F32);
    CHECK(kiln_precision_scope_current() == KILN_PREC_SCOPE_NONE, "no scope at start");
    int a = kiln_precision_scope_begin(KILN_PREC_BF16);
    CHECK(a == KILN_PREC_SCOPE_NONE, "the first token is 'none', got %d", a);
    CHECK(kiln_precision_get() == KILN_PREC_BF16, "the scope wins over the set f32");
    CHECK(kiln_precision_for(NULL) == KILN_PREC_BF16, "for the host");
    CHECK(kiln_precision_for_type(KILN_DEV_CUDA) == KILN_PREC_BF16, "for every device type");
    CHECK(kiln_precision_is_set(), "the process-wide setting is still there");

    int b = kiln_precision_scope_begin(KILN_PREC_F16);
    CHECK(b == KILN_PREC_BF16, "the nested token is the outer scope, got %d", b);
    CHECK(kiln_precision_get() == KILN_PREC_F16, "the inner scope wins");
    /* a set inside a scope changes the process, not this thread's answer */
    kiln_precision_set(KILN_PREC_BF16);
    CHECK(kiln_precision_get() == KILN_PREC_F16, "set inside a scope: the scope still wins");
    kiln_precision_set(KILN_PREC_F32);

    int c = kiln_precision_scope_begin(KILN_PREC_SCOPE_NONE);
    CHECK(kiln_precision_get() == KILN_PREC_F32, "a scope without override: the set one");
    int d = kiln_precision_scope_begin(42);
    CHECK(kiln_precision_scope_current() == KILN_PREC_SCOPE_NONE && d == KILN_PREC_SCOPE_NONE,
          "an invalid precision changes nothing");
    kiln_precision_scope_end(d);
    kiln_precision_scope_end(c);
    CHECK(kiln_precision_get() == KILN_PREC_F16, "ended: the inner scope again");

    kiln_precision_scope_end(b);
    CHECK(kiln_precision_get() == KILN_PREC_BF16, "ended: the outer scope again");
    kiln_precision_scope_end(a);
    CHECK(kiln_precision_scope_current() == KILN_PREC_SCOPE_NONE, "all ended: no scope");
    CHECK(kiln_precision_get() == KILN_PREC_F32, "all ended: the set precision");

    /* unset inside a scope: the defaults come back only once it ends */
    kiln_precision_unset();
    a = kiln_precision_scope_begin(KILN_PREC_BF16);
    CHECK(kiln_precision_for_type(KILN_DEV_CPU) == KILN_PREC_BF16, "scope over the type default");
    kiln_precision_scope_end(a);
    CHECK(kiln_precision_for_type(KILN_DEV_CPU) == KILN_PREC_F32, "the CPU's default again");
    kiln_precision_set(KILN_PREC_F32);
}

/* ---- other threads ---- */

typedef struct {
    int seen;   /* what the thread read */
    int own;    /* a scope the thread opens itself, or KILN_PREC_SCOPE_NONE */
    int seen_in_own;
} peer_t;

static void *peer_main(void *arg)
{
    peer_t *p = arg;
    p->seen = (int)kiln_precision_get();
    int t = kiln_precision_scope_begin(p->own);
    p->seen_in_own = (int)kiln_precision_get();
    kiln_precision_scope_end(t);
    return NULL;
}

static void t_scope_is_the_threads_own(void)
{
    kiln_precision_set(KILN_PREC_F32);
    int tok = kiln_precision_scope_begin(KILN_PREC_BF16);
    peer_t p = {.seen = -9, .own = KILN_PREC_F16, .seen_in_own = -9};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, peer_main, &p) == 0, "thread");
    pthread_join(th, NULL);
    CHECK(p.seen == KILN_PREC_F32, "another thread sees the process-wide f32, got %d", p.seen);
    CHECK(p.seen_in_own == KILN_PREC_F16, "and its own scope, got %d", p.seen_in_own);
    CHECK(kiln_precision_get() == KILN_PREC_BF16, "its scope did not touch this thread's");
    kiln_precision_scope_end(tok);
}

/* ---- the compute pool ---- */

typedef struct {
    atomic_int wrong;          /* chunks that saw another precision than expected */
    atomic_int on_workers;     /* chunks run by a worker (thread index > 0) */
    int want;
} pool_probe;

static void probe_chunk(void *ctx, int64_t b, int64_t e)
{
    pool_probe *p = ctx;
    for (int64_t i = b; i < e; i++) {
        if ((int)kiln_precision_for(NULL) != p->want) atomic_fetch_add(&p->wrong, 1);
        if (kiln_thread_index() > 0) atomic_fetch_add(&p->on_workers, 1);
        /* long enough that the workers wake up and take chunks too */
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

/* runs the probe until some chunks ran on a worker (a few tries: on a loaded machine
 * the caller may finish a short job alone); returns the chunks that saw another
 * precision, -1 when no worker took part */
static int pool_run(int want)
{
    for (int attempt = 0; attempt < 20; attempt++) {
        pool_probe p = {.want = want};
        atomic_init(&p.wrong, 0);
        atomic_init(&p.on_workers, 0);
        kiln_parallel_for(64, 1, probe_chunk, &p);
        if (atomic_load(&p.wrong)) return atomic_load(&p.wrong);
        if (atomic_load(&p.on_workers)) return 0;
    }
    return -1;
}

static void t_pool_carries_scope(void)
{
    int threads = kiln_cpu_threads();
    if (threads < 2) kiln_cpu_set_threads(2);
    kiln_precision_set(KILN_PREC_F32);

    int tok = kiln_precision_scope_begin(KILN_PREC_BF16);
    int r = pool_run(KILN_PREC_BF16);
    kiln_precision_scope_end(tok);
    if (r < 0) {
        SKIP("no chunk ran on a worker thread in 20 jobs");
    } else {
        CHECK(r == 0, "%d chunks did not see the caller's bf16 scope", r);
        /* after the job the workers are back to the process-wide precision */
        r = pool_run(KILN_PREC_F32);
        CHECK(r <= 0, "%d chunks still saw the scope after it ended", r);
        tok = kiln_precision_scope_begin(KILN_PREC_F16);
        r = pool_run(KILN_PREC_F16);
        kiln_precision_scope_end(tok);
        CHECK(r <= 0, "%d chunks did not see an f16 scope", r);
    }
    if (threads < 2) kiln_cpu_set_threads(threads);
}

/* ---- a layer ---- */

static uint64_t rs = 0x2545F4914F6CDD1Dull;
static float frand(void)
{
    rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
    return (float)((rs >> 40) * (2.0 / 16777216.0)) - 1.0f;
}

static void t_linear_in_scope(void)
{
    kiln_precision_set(KILN_PREC_F32);
    int tok = kiln_precision_scope_begin(KILN_PREC_BF16);
    int active = kiln_cpu_bf16_active();
    kiln_precision_scope_end(tok);
    if (!active) { SKIP("no AVX-512 on this CPU: bf16 products run as f32"); return; }

    const int64_t M = 100, N = 96, K = 320;
    float *x = malloc((size_t)(M * K) * 4), *w = malloc((size_t)(N * K) * 4), *b = malloc((size_t)N * 4);
    float *y32 = malloc((size_t)(M * N) * 4), *yset = malloc((size_t)(M * N) * 4), *yscope = malloc((size_t)(M * N) * 4);
    for (int64_t i = 0; i < M * K; i++) x[i] = frand();
    for (int64_t i = 0; i < N * K; i++) w[i] = frand() * 0.5f;
    for (int64_t i = 0; i < N; i++) b[i] = frand();

    CHECK(kiln_cpu_linear(y32, x, w, KILN_F32, b, M, N, K) == KILN_OK, "f32: %s", kiln_last_error());
    kiln_precision_set(KILN_PREC_BF16);
    CHECK(kiln_cpu_linear(yset, x, w, KILN_F32, b, M, N, K) == KILN_OK, "set bf16: %s", kiln_last_error());
    kiln_precision_set(KILN_PREC_F32);
    tok = kiln_precision_scope_begin(KILN_PREC_BF16);
    CHECK(kiln_cpu_linear(yscope, x, w, KILN_F32, b, M, N, K) == KILN_OK, "scoped bf16: %s", kiln_last_error());
    kiln_precision_scope_end(tok);

    CHECK(kiln_precision_get() == KILN_PREC_F32 && kiln_precision_is_set(), "the process stayed f32");
    CHECK(!memcmp(yscope, yset, (size_t)(M * N) * 4), "the scoped result is the process-wide bf16 one");
    CHECK(memcmp(yscope, y32, (size_t)(M * N) * 4) != 0, "and not the f32 one");
    free(x); free(w); free(b); free(y32); free(yset); free(yscope);
}

int main(void)
{
    RUN(t_scope_wins_nests_restores);
    RUN(t_scope_is_the_threads_own);
    RUN(t_pool_carries_scope);
    RUN(t_linear_in_scope);
    return test_summary();
}
