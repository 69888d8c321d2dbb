/* reduce.c - sum, mean, max, min and var over one dimension or the whole tensor.
 * The input is viewed as [outer, dim, inner]; accumulation is in double (var with
 * Welford's update) so long reductions stay accurate. */
#include "cpu_backend.h"
#include "threadpool.h"

#include <math.h>
#include <stdlib.h>

typedef struct {
    kiln_redop op;
    int unbiased;
    const float *x;
    float *y;
    int64_t outer, dim, inner;
} red_ctx;

/* Sum of n contiguous floats, and of their squared distances to m, in doubles with
 * eight partial sums (a fixed order: the same result on every run and thread count;
 * two passes instead of Welford's division per element). */
static double sum_contig(const float *x, int64_t n)
{
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        for (int j = 0; j < 8; j++) s[j] += x[k + j];
    double acc = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; k < n; k++) acc += x[k];
    return acc;
}

static double sqdev_contig(const float *x, int64_t n, double m)
{
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        for (int j = 0; j < 8; j++) {
            double d = x[k + j] - m;
            s[j] += d * d;
        }
    double acc = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; k < n; k++) acc += (x[k] - m) * (x[k] - m);
    return acc;
}

static void red_range(void *p, int64_t begin, int64_t end)
{
    const red_ctx *c = p;
    for (int64_t idx = begin; idx < end; idx++) {
        int64_t o = idx / c->inner, i = idx % c->inner;
        const float *x = c->x + o * c->dim * c->inner + i;
        double acc = 0, mean = 0, m2 = 0;
        if (c->inner == 1 && (c->op == KILN_RED_SUM || c->op == KILN_RED_MEAN || c->op == KILN_RED_VAR)) {
            acc = sum_contig(x, c->dim);
            if (c->op != KILN_RED_SUM) acc = c->dim ? acc / (double)c->dim : NAN;
            if (c->op == KILN_RED_VAR)
                acc = c->dim - c->unbiased > 0 ? sqdev_contig(x, c->dim, acc) / (double)(c->dim - c->unbiased) : NAN;
            c->y[idx] = (float)acc;
            continue;
        }
        switch (c->op) {
        case KILN_RED_SUM:
        case KILN_RED_MEAN:
            for (int64_t k = 0; k < c->dim; k++) acc += x[k * c->inner];
            if (c->op == KILN_RED_MEAN) acc = c->dim ? acc / (double)c->dim : NAN;
            break;
        case KILN_RED_MAX:
        case KILN_RED_MIN: {
            acc = x[0];
            for (int64_t k = 1; k < c->dim; k++) {
                double v = x[k * c->inner];
                if (v != v) { acc = v; break; }
                if (c->op == KILN_RED_MAX ? v > acc : v < acc) acc = v;
            }
            break;
        }
        case KILN_RED_VAR:
            for (int64_t k = 0; k < c->dim; k++) {
                double v = x[k * c->inner], d = v - mean;
                mean += d / (double)(k + 1);
                m2 += d * (v - mean);
            }
            acc = c->dim - c->unbiased > 0 ? m2 / (double)(c->dim - c->unbiased) : NAN;
            break;
        default: break;
        }
        c->y[idx] = (float)acc;
    }
}

kiln_status kiln_cpu_reduce(kiln_redop op, kiln_tensor *out, const kiln_tensor *a, int dim, int unbiased)
{
    /* compute in f32 on a contiguous f32 copy when needed */
    kiln_tensor *x = NULL, *y = out;
    kiln_status st;
    if (a->dtype != KILN_F32 || !kiln_tensor_is_contiguous(a)) {
        st = kiln_tensor_new(a->storage->device, KILN_F32, a->ndim, a->shape, &x);
        if (st) return st;
        kiln_cpu_copy(x, a);
    }
    if (out->dtype != KILN_F32) {
        st = kiln_tensor_new(out->storage->device, KILN_F32, out->ndim, out->shape, &y);
        if (st) { kiln_tensor_free(x); return st; }
    }
    red_ctx c = {op, unbiased, kiln_tensor_data(x ? x : a), kiln_tensor_data(y), 1, 1, 1};
    if (dim < 0) {
        c.dim = kiln_tensor_numel(a);
    } else {
        for (int i = 0; i < dim; i++) c.outer *= a->shape[i];
        c.dim = a->shape[dim];
        for (int i = dim + 1; i < a->ndim; i++) c.inner *= a->shape[i];
    }
    int64_t n = c.outer * c.inner;
    kiln_parallel_for(n, c.dim >= 4096 ? 1 : 4096 / (c.dim + 1) + 1, red_range, &c);
    if (y != out) { kiln_cpu_copy(out, y); kiln_tensor_free(y); }
    kiln_tensor_free(x);
    return KILN_OK;
}
