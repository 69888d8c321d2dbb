/* strided.c - see strided.h. */
#include "strided.h"
#include "threadpool.h"

#include <string.h>

void kiln_iter_init(kiln_iter *it, int nops, const kiln_tensor *const *ops)
{
    memset(it, 0, sizeof *it);
    it->nops = nops;
    for (int k = 0; k < nops; k++) {
        it->base[k] = kiln_tensor_data(ops[k]);
        it->esize[k] = kiln_dtype_size(ops[k]->dtype);
    }
    it->ndim = kiln_tensor_coalesce(nops, ops, it->shape, it->stride);
}

typedef struct {
    const kiln_iter *it;
    kiln_iter_fn fn;
    void *ctx;
    int64_t inner;      /* elements per call */
    int64_t split;      /* inner dimension split into this many pieces */
} run_ctx;

static void run_range(void *p, int64_t begin, int64_t end)
{
    const run_ctx *r = p;
    const kiln_iter *it = r->it;
    int last = it->ndim - 1;
    int64_t inner_stride[3];
    for (int k = 0; k < it->nops; k++) inner_stride[k] = it->stride[k][last];
    for (int64_t idx = begin; idx < end; idx++) {
        int64_t piece = idx % r->split, outer = idx / r->split;
        int64_t off[3] = {0, 0, 0};
        for (int d = last - 1; d >= 0; d--) {
            int64_t i = outer % it->shape[d];
            outer /= it->shape[d];
            for (int k = 0; k < it->nops; k++) off[k] += i * it->stride[k][d];
        }
        int64_t b = piece * r->inner, n = it->shape[last] - b < r->inner ? it->shape[last] - b : r->inner;
        char *ptrs[3];
        for (int k = 0; k < it->nops; k++)
            ptrs[k] = it->base[k] + (size_t)((off[k] + b * inner_stride[k]) * (int64_t)it->esize[k]);
        r->fn(r->ctx, n, ptrs, inner_stride);
    }
}

void kiln_iter_run(const kiln_iter *it, kiln_iter_fn fn, void *ctx)
{
    int64_t outer = 1;
    for (int d = 0; d < it->ndim - 1; d++) outer *= it->shape[d];
    int64_t inner = it->shape[it->ndim - 1];
    if (outer == 0 || inner == 0) return;
    run_ctx r = {it, fn, ctx, inner, 1};
    /* split long inner runs so a flat tensor still spreads over the threads */
    const int64_t piece = 16384;
    if (inner > 2 * piece) {
        r.split = (inner + piece - 1) / piece;
        r.inner = piece;
    }
    int64_t total = outer * r.split;
    int64_t grain = (8192 + r.inner - 1) / r.inner;
    kiln_parallel_for(total, grain, run_range, &r);
}
