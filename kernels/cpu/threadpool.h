/* threadpool.h - the one pthread pool shared by every CPU op.
 * Size from KILN_THREADS (default: number of online cores). Nested calls from a
 * worker run serially, so kernels may call each other freely. */
#ifndef KILN_THREADPOOL_H
#define KILN_THREADPOOL_H

#include <stdint.h>

/* Splits [0, n) into chunks of at least `grain` items and runs fn(ctx, begin, end)
 * on the pool; returns when all chunks are done. Every chunk runs under the calling
 * thread's precision scope (kiln_precision_scope_begin), whichever thread runs it. */
void kiln_parallel_for(int64_t n, int64_t grain, void (*fn)(void *ctx, int64_t begin, int64_t end), void *ctx);
int kiln_cpu_threads(void);
/* Changes the pool size (joins and restarts workers); n <= 0 means default. */
void kiln_cpu_set_threads(int n);
/* Index of the calling worker in [0, kiln_cpu_threads()), for per-thread scratch. */
int kiln_thread_index(void);

#endif
