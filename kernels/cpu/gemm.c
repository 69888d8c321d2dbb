/* gemm.c - matrix products (gemm, batched gemm, linear, the prepacked and serial forms
 * the convolutions use) on the shared thread pool: the choice of path, the split into
 * blocks and tasks, and the OpenBLAS fallback. On CPUs with AVX-512 a packed,
 * cache-blocked kernel of our own runs (gemm_f32.c, and gemm_bf16.c under
 * kiln.precision("bf16"); `make bench` compares it with OpenBLAS; it shares our pool
 * instead of a second set of spinning threads); elsewhere OpenBLAS sgemm does the work.
 * The same kernel serves conv2d (conv2d.c) through kiln_cpu_gemm_ex, which takes f16/bf16
 * A and a callback that packs B straight from the image (implicit im2col). */
#define _GNU_SOURCE
#include "gemm_internal.h"
#include "threadpool.h"
#include "../../runtime/precision.h"

#include <cblas.h>
#include <stdatomic.h>
#include <stdlib.h>

/* Fewest rows for which precision int8 takes the W8A8 kernel: its weights are quantized
 * and packed at each call, a pass over N x K that costs about as much
 * as a hundred rows of int8 products, so the products' 2x over bf16 pays from a few
 * hundred rows (bench_int8.c); fewer rows stay bf16. */
#define INT8_MIN_ROWS 256
/* With the weights already packed (a model's cached copy) only the activations are
 * quantized: a pass over M x K, paid from a few dozen rows. */
#define INT8_MIN_ROWS_PACKED 32

int64_t kiln_cpu_int8_min_rows(int packed_ready) { return packed_ready ? INT8_MIN_ROWS_PACKED : INT8_MIN_ROWS; }

/* ---------- OpenBLAS fallback ---------- */

static atomic_int blas_threads_set;

/* OpenBLAS keeps its own threads, which spin for a while after each call and would
 * steal cores from our pool. With the AVX-512 kernel BLAS only sees products too small
 * to split, so it runs on one thread; otherwise it gets as many threads as the pool. */
static void blas_init(void)
{
    if (!atomic_load(&blas_threads_set)) {
        openblas_set_num_threads(have_avx512() ? 1 : kiln_cpu_threads());
        atomic_store(&blas_threads_set, 1);
    }
}

static void scale_c(float *C, int64_t ldc, int64_t M, int64_t N, float beta)
{
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * ldc;
        if (beta == 0.0f) memset(c, 0, (size_t)N * sizeof *c);
        else if (beta != 1.0f) for (int64_t j = 0; j < N; j++) c[j] *= beta;
    }
}

static void add_bias(const gemm_args *g)
{
    for (int64_t i = 0; i < g->M; i++) {
        float *c = g->C + i * g->ldc;
        float br = g->bias_row ? g->bias_row[i] : 0.0f;
        for (int64_t j = 0; j < g->N; j++) c[j] += br + (g->bias_col ? g->bias_col[j] : 0.0f);
    }
}

/* f32 A and B through cblas; f16/bf16 B (only as trans_b, the linear case) converted
 * in panels of 256 rows so the whole weight is never converted at once. Returns -1
 * when the panel cannot be allocated. */
static int blas_gemm(const gemm_args *g)
{
    blas_init();
    if (g->b_dt == KILN_F32) {
        cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans, g->trans_b ? CblasTrans : CblasNoTrans,
                    (int)g->M, (int)g->N, (int)g->K, g->alpha, g->A, (int)g->lda, g->B, (int)g->ldb,
                    g->beta, g->C, (int)g->ldc);
    } else {
        const int64_t rows = 256;
        float *panel = kiln_cpu_scratch_get((size_t)rows * (size_t)g->K * sizeof *panel);
        if (!panel) return -1;
        size_t esz = kiln_dtype_size(g->b_dt);
        for (int64_t n0 = 0; n0 < g->N; n0 += rows) {
            int64_t nb = g->N - n0 < rows ? g->N - n0 : rows;
            for (int64_t j = 0; j < nb; j++)
                kiln_to_f32(panel + j * g->K, (const char *)g->B + (size_t)((n0 + j) * g->ldb) * esz, g->b_dt,
                            (size_t)g->K);
            cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans, CblasTrans, (int)g->M, (int)nb,
                        (int)g->K, g->alpha, g->A, (int)g->lda, panel, (int)g->K, g->beta, g->C + n0, (int)g->ldc);
        }
        kiln_cpu_scratch_put(panel);
    }
    if (g->bias_row || g->bias_col) add_bias(g);
    return 0;
}

/* ---------- blocks and tasks of the packed kernel ---------- */
#ifdef GEMM_X86

typedef struct {
    const gemm_args *g;
    int64_t mb, nb, n_nblk;     /* block sizes, number of column blocks */
    float *scratch;             /* per thread: KC*nb floats of B panel + KC*MR of A sliver */
    size_t per_thread;          /* floats */
} task_ctx;

static void task_fn(void *vctx, int64_t begin, int64_t end)
{
    task_ctx *t = vctx;
    const gemm_args *g = t->g;
    /* prepacked operands need no scratch (NULL) */
    float *bpanel = t->scratch ? t->scratch + (size_t)kiln_thread_index() * t->per_thread : NULL;
    float *asliver = bpanel ? bpanel + (size_t)KC * (size_t)t->nb : NULL;
    for (int64_t task = begin; task < end; task++) {
        int64_t bi = task / t->n_nblk, bj = task % t->n_nblk;
        int64_t i0 = bi * t->mb, j0 = bj * t->nb;
        int64_t i1 = i0 + t->mb < g->M ? i0 + t->mb : g->M;
        int64_t j1 = j0 + t->nb < g->N ? j0 + t->nb : g->N;
        kiln_cpu_gemm_run_block(g, bpanel, asliver, i0, i1, j0, j1);
    }
}

static size_t per_thread_floats(int64_t nb) { return (size_t)KC * (size_t)nb + (size_t)KC * MR + 16; }

/* Block sizes, from a cost model in cycles: a task's multiply-adds (16 per cycle), the
 * tasks run in rounds of `threads`, and the overheads of a split: every row block packs
 * its column block's B panels again (f16 conversion included, ~1 cycle per element) and
 * every column block reads its rows of A again (~1/4 cycle per element). Columns go in
 * blocks of 2 .. NB_MAX/NR slivers (3 when <= 8 rows use the 4 x 96 kernel), rows in
 * halvings down to 4 slivers. At SD's shapes, splitting columns rather than rows where M
 * is small (256 tokens) and keeping the B panel <= 480 KB (NB_MAX 320) is what brings the
 * linear layers near the FMA peak (README: speed). */
static void choose_blocks(int64_t M, int64_t N, int64_t K, int threads, int64_t *mb, int64_t *nb)
{
    int64_t ns = (N + NR - 1) / NR, sm = (M + MR - 1) / MR; /* slivers of columns, of rows */
    int64_t min_s = M <= 8 ? 3 : 2, max_s = NB_MAX / NR;
    if (min_s > ns) min_s = ns;
    double best = -1;
    *nb = (min_s < 1 ? 1 : min_s) * NR;
    *mb = sm * MR;
    if (threads <= 1) { /* one task: the widest column blocks, all rows (what the model picks, without the search) */
        *nb = (ns < max_s ? ns : max_s) * NR;
        return;
    }
    for (int64_t per = min_s; per <= max_s && per <= ns; per++) {
        int64_t ncb = (ns + per - 1) / per;
        for (int64_t rows = sm;;) {
            int64_t nrb = (sm + rows - 1) / rows, tasks = ncb * nrb;
            double work = (double)rows * MR * (double)per * NR * (double)K / 16.0;
            double span = (double)((tasks + threads - 1) / threads) * work;
            double pack = (double)nrb * (double)N * (double)K;
            double aload = (double)ncb * (double)M * (double)K * 0.25;
            double cost = span + (pack + aload) / threads;
            if (best < 0 || cost < best) {
                best = cost;
                *nb = per * NR;
                *mb = rows * MR;
            }
            if (rows <= 4) break;
            rows = (rows + 1) / 2;
        }
    }
}

/* Runs g on the pool (serially when called from a pool worker); -1 when no scratch. */
static int packed_gemm(const gemm_args *g, float *scratch, int threads)
{
    task_ctx t;
    choose_blocks(g->M, g->N, g->K, threads, &t.mb, &t.nb);
    t.n_nblk = (g->N + t.nb - 1) / t.nb;
    gemm_args ga;
    uint32_t *a_round = NULL;
    if (g->bf16 && !g->a_packed && t.n_nblk > 1) {
        int64_t kp = (g->K + 1) / 2, ns = (g->M + MR - 1) / MR;
        a_round = kiln_cpu_scratch_get((size_t)(ns * kp * MR) * sizeof(uint32_t));
        if (a_round) { /* else every block rounds its own slivers */
            kiln_cpu_gemm_round_a_bf16(g, a_round, kp, ns);
            ga = *g;
            ga.A = a_round;
            ga.a_packed = ga.a_bf16 = 1;
            ga.a_sliver = kp * MR;
            g = &ga;
        }
    }
    t.g = g;
    t.per_thread = g->a_packed && g->b_packed ? 0 : per_thread_floats(t.nb);
    float *own = NULL;
    if (!scratch && t.per_thread) {
        own = kiln_cpu_scratch_get((size_t)threads * t.per_thread * sizeof(float));
        if (!own) return -1;
        scratch = own;
    }
    t.scratch = scratch;
    int64_t n_tasks = ((g->M + t.mb - 1) / t.mb) * t.n_nblk;
    kiln_parallel_for(n_tasks, 1, task_fn, &t);
    kiln_cpu_scratch_put(own);
    kiln_cpu_scratch_put(a_round);
    return 0;
}

#else
static int packed_gemm(const gemm_args *g, float *scratch, int threads)
{
    (void)g; (void)scratch; (void)threads;
    return -1;
}
static void choose_blocks(int64_t M, int64_t N, int64_t K, int threads, int64_t *mb, int64_t *nb)
{
    (void)threads; (void)K;
    *mb = M;
    *nb = N;
}
static size_t per_thread_floats(int64_t nb) { return (size_t)nb; }
#endif

/* ---------- entry points ---------- */

/* Handles the degenerate shapes BLAS leaves to the caller; returns 1 when done. */
static int trivial(const gemm_args *g)
{
    if (g->M <= 0 || g->N <= 0) return 1;
    if (g->K <= 0 || g->alpha == 0.0f) {
        scale_c(g->C, g->ldc, g->M, g->N, g->beta);
        if (g->bias_row || g->bias_col) add_bias(g);
        return 1;
    }
    return 0;
}

/* Below this many multiply-adds one thread of OpenBLAS wins: no packing, no pool
 * wake-up. */
static const double SMALL_MACS = 32.0 * 32.0 * 32.0;

static void gemm_dispatch(const gemm_args *g)
{
    if (trivial(g)) return;
    double macs = (double)g->M * (double)g->N * (double)g->K;
    if (have_avx512() && macs >= SMALL_MACS && packed_gemm(g, NULL, kiln_cpu_threads()) == 0) return;
    if (blas_gemm(g) == 0) return;
    /* no memory for a conversion panel: element by element (slow, but correct) */
    for (int64_t i = 0; i < g->M; i++)
        for (int64_t j = 0; j < g->N; j++) {
            double s = 0;
            for (int64_t k = 0; k < g->K; k++) {
                float a = ((const float *)g->A)[g->trans_a ? k * g->lda + i : i * g->lda + k];
                int64_t bi = g->trans_b ? j * g->ldb + k : k * g->ldb + j;
                float b = g->b_dt == KILN_F32 ? ((const float *)g->B)[bi]
                        : g->b_dt == KILN_F16 ? kiln_f16_to_f32(((const uint16_t *)g->B)[bi])
                                              : kiln_bf16_to_f32(((const uint16_t *)g->B)[bi]);
                s += (double)a * b;
            }
            float *c = g->C + i * g->ldc + j;
            *c = (float)(g->alpha * s) + (g->beta == 0.0f ? 0.0f : g->beta * *c) +
                 (g->bias_row ? g->bias_row[i] : 0.0f) + (g->bias_col ? g->bias_col[j] : 0.0f);
        }
}

int kiln_cpu_gemm_have_simd(void) { return have_avx512(); }

/* C[M,N] = A[M,K] (f32/f16/bf16, row-major, lda) * B + bias_row[i], where B is
 * produced panel by panel by pack_b. Returns -1 (nothing written) when the SIMD kernel
 * is unavailable or scratch cannot be allocated; the caller then takes another path. */
int kiln_cpu_gemm_ex(int64_t M, int64_t N, int64_t K, const void *A, kiln_dtype a_dt, int64_t lda,
                     pack_b_fn pack_b, void *pack_ctx, float *C, int64_t ldc, const float *bias_row)
{
    gemm_args g = {.M = M, .N = N, .K = K, .alpha = 1.0f, .A = A, .lda = lda, .a_dt = a_dt, .b_dt = KILN_F32,
                   .pack_b = pack_b, .pack_ctx = pack_ctx, .C = C, .ldc = ldc, .bias_row = bias_row,
                   .bf16 = kiln_cpu_bf16_mode(M)};
    if (!have_avx512()) return -1;
    if (trivial(&g)) return 0;
    return packed_gemm(&g, NULL, kiln_cpu_threads());
}

void kiln_cpu_gemm_f32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float *A, int64_t lda, const float *B, int64_t ldb,
                       float beta, float *C, int64_t ldc)
{
    gemm_args g = {.trans_a = trans_a, .trans_b = trans_b, .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta,
                   .A = A, .lda = lda, .a_dt = KILN_F32, .B = B, .ldb = ldb, .b_dt = KILN_F32, .C = C, .ldc = ldc,
                   .bf16 = kiln_cpu_bf16_mode(M)};
    gemm_dispatch(&g);
}

typedef struct {
    gemm_args g;
    int64_t stride_a, stride_b, stride_c;
    float *scratch;
} batch_ctx;

static void batch_fn(void *vctx, int64_t begin, int64_t end)
{
    batch_ctx *b = vctx;
    for (int64_t i = begin; i < end; i++) {
        gemm_args g = b->g;
        g.A = (const float *)g.A + i * b->stride_a;
        g.B = (const float *)g.B + i * b->stride_b;
        g.C += i * b->stride_c;
        /* inside a pool job: runs serially on this thread, in its slot of the scratch;
         * prepacked operands (Winograd's 36 products a strip, thousands a layer) go
         * straight to the kernel loop */
#ifdef GEMM_X86
        if (g.a_packed && g.b_packed) {
            kiln_cpu_gemm_run_block(&g, NULL, NULL, 0, g.M, 0, g.N);
            continue;
        }
#endif
        packed_gemm(&g, b->scratch, 1);
    }
}

void kiln_cpu_gemm_batched_f32(int trans_a, int trans_b, int64_t batch, int64_t M, int64_t N, int64_t K,
                               float alpha, const float *A, int64_t lda, int64_t stride_a,
                               const float *B, int64_t ldb, int64_t stride_b,
                               float beta, float *C, int64_t ldc, int64_t stride_c)
{
    if (batch <= 0) return;
    gemm_args g = {.trans_a = trans_a, .trans_b = trans_b, .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta,
                   .A = A, .lda = lda, .a_dt = KILN_F32, .B = B, .ldb = ldb, .b_dt = KILN_F32, .C = C, .ldc = ldc,
                   .bf16 = kiln_cpu_bf16_mode(M)};
    int threads = kiln_cpu_threads();
    double macs = (double)M * (double)N * (double)K;
    /* Many products (or several small ones): one whole product per task, each on one
     * thread, no sharing. Few large ones: one after another, each split over the pool. */
    int per_thread = batch >= 4 * (int64_t)threads || (batch >= threads && macs < 8.0 * 1024 * 1024);
    if (have_avx512() && threads > 1 && per_thread && !trivial(&g) && macs >= SMALL_MACS / 8) {
        int64_t mb, nb;
        choose_blocks(M, N, K, 1, &mb, &nb);
        batch_ctx b = {g, stride_a, stride_b, stride_c, NULL};
        b.scratch = kiln_cpu_scratch_get((size_t)threads * per_thread_floats(nb) * sizeof(float));
        if (b.scratch) {
            kiln_parallel_for(batch, 1, batch_fn, &b);
            kiln_cpu_scratch_put(b.scratch);
            return;
        }
    }
    for (int64_t i = 0; i < batch; i++) {
        gemm_args gi = g;
        gi.A = A + i * stride_a;
        gi.B = B + i * stride_b;
        gi.C = C + i * stride_c;
        gemm_dispatch(&gi);
    }
}

/* One product on the calling thread (no pool, no blocking of its own), for kernels that
 * block their work themselves (conv2d_winograd_few.c): C (M x N, row stride ldc) = A B,
 * or C += A B when accumulate; A row-major f32 (row stride lda); B prepacked in slivers of
 * NR columns, [ceil(N/NR)][K][NR], b_sliver floats apart. scratch: KILN_CPU_GEMM_SERIAL_SCRATCH
 * floats, 64-byte aligned (the A slivers that are packed). -1 without AVX-512. */
int kiln_cpu_gemm_serial(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *Bp,
                         int64_t b_sliver, float *C, int64_t ldc, int accumulate, float *scratch)
{
#ifdef GEMM_X86
    if (!have_avx512()) return -1;
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    gemm_args g = {.M = M, .N = N, .K = K, .alpha = 1.0f, .beta = accumulate ? 1.0f : 0.0f, .A = A, .lda = lda,
                   .a_dt = KILN_F32, .B = Bp, .b_dt = KILN_F32, .C = C, .ldc = ldc, .b_packed = 1,
                   .b_sliver = b_sliver};
    kiln_cpu_gemm_run_block(&g, NULL, scratch, 0, M, 0, N);
    return 0;
#else
    (void)M; (void)N; (void)K; (void)A; (void)lda; (void)Bp; (void)b_sliver; (void)C; (void)ldc;
    (void)accumulate; (void)scratch;
    return -1;
#endif
}

/* batch products of prepacked operands g (A, B, C of the first; the others strides
 * apart): whole products on the threads when there are enough, else one by one. */
static void prepacked_run(const gemm_args *g, int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c)
{
    int threads = kiln_cpu_threads();
    if (threads > 1 && batch >= threads) {
        batch_ctx b = {*g, stride_a, stride_b, stride_c, NULL};
        kiln_parallel_for(batch, 1, batch_fn, &b);
        return;
    }
    for (int64_t i = 0; i < batch; i++) {
        gemm_args gi = *g;
        gi.A = (const float *)g->A + i * stride_a;
        gi.B = (const float *)g->B + i * stride_b;
        gi.C = g->C + i * stride_c;
        packed_gemm(&gi, NULL, threads);
    }
}

/* Batched C_b[M,N] = A_b B_b for operands already in the kernel's sliver layout: A as
 * ceil(M/12) slivers of K x 12 floats (row r of sliver s is row 12s+r, zero past M),
 * B as ceil(N/32) slivers of K x 32 floats (zero past N). Winograd writes its
 * transforms this way and skips packing. -1 without the SIMD kernel. */
int kiln_cpu_gemm_prepacked(int64_t batch, int64_t M, int64_t N, int64_t K, const float *Ap, int64_t stride_a,
                            const float *Bp, int64_t stride_b, float *C, int64_t ldc, int64_t stride_c)
{
    if (!have_avx512()) return -1;
    gemm_args g = {.M = M, .N = N, .K = K, .alpha = 1.0f, .A = Ap, .a_dt = KILN_F32, .B = Bp, .b_dt = KILN_F32,
                   .C = C, .ldc = ldc, .a_packed = 1, .b_packed = 1, .bf16 = kiln_cpu_bf16_mode(M)};
    if (batch > 0 && !trivial(&g)) prepacked_run(&g, batch, stride_a, stride_b, stride_c);
    return 0;
}

int kiln_cpu_gemm_prepacked_bf16(int64_t batch, int64_t M, int64_t N, int64_t K, const uint32_t *Ap,
                                  int64_t stride_a, const uint32_t *Bp, int64_t stride_b, float *C, int64_t ldc,
                                  int64_t stride_c)
{
    if (!have_avx512()) return -1;
    gemm_args g = {.M = M, .N = N, .K = K, .alpha = 1.0f, .A = Ap, .a_dt = KILN_F32, .B = Bp, .b_dt = KILN_F32,
                   .C = C, .ldc = ldc, .a_packed = 1, .b_packed = 1, .bf16 = kiln_cpu_bf16_mode(MR), .a_bf16 = 1,
                   .b_bf16 = 1};
    if (!g.bf16) return -1;
    if (batch > 0 && !trivial(&g)) prepacked_run(&g, batch, stride_a, stride_b, stride_c);
    return 0;
}

int kiln_cpu_linear_bf16_pairs_mode(int64_t M, int64_t N, int64_t K)
{
    if (!have_avx512() || M <= 0 || N <= 0 || K <= 0 || (double)M * (double)N * (double)K < SMALL_MACS) return 0;
    return kiln_cpu_bf16_mode(M);
}

int kiln_cpu_linear_bf16_pairs(float *y, const float *x, const uint32_t *Wp, const float *bias, int64_t M, int64_t N,
                               int64_t K)
{
    gemm_args g = {.trans_b = 1, .M = M, .N = N, .K = K, .alpha = 1.0f, .A = x, .lda = K, .a_dt = KILN_F32, .B = Wp,
                   .b_dt = KILN_F32, .C = y, .ldc = N, .bias_col = bias, .b_packed = 1, .b_bf16 = 1,
                   .b_sliver = ((K + 1) / 2) * NR, .bf16 = kiln_cpu_linear_bf16_pairs_mode(M, N, K)};
    if (!g.bf16) return -1;
    return packed_gemm(&g, NULL, kiln_cpu_threads());
}

/* Low-bit weights (fp8, ggml's block types): rows of W are decoded to f32 a panel
 * at a time (about 4 MB, in parallel), and each panel is one product writing its
 * columns of y, so no more than a panel of the weight ever exists in f32. */
typedef struct { float *panel; const char *w; kiln_dtype dt; int64_t n0, K; } decode_ctx;

static void decode_rows(void *p, int64_t r0, int64_t r1)
{
    const decode_ctx *c = p;
    for (int64_t r = r0; r < r1; r++)
        kiln_to_f32(c->panel + r * c->K, c->w + kiln_dtype_nbytes(c->dt, (c->n0 + r) * c->K), c->dt, (size_t)c->K);
}

/* Rows of the decoded weight panel of linear_lowbit: about 1 Mi floats. */
static int64_t lowbit_panel_rows(int64_t N, int64_t K)
{
    int64_t nb = ((int64_t)1 << 20) / (K ? K : 1);
    nb = nb < 32 ? 32 : nb / 32 * 32;
    return nb > N ? N : nb;
}

static kiln_status linear_lowbit(float *y, const float *x, const void *w, kiln_dtype dt, const float *bias,
                                 int64_t M, int64_t N, int64_t K)
{
    if (K % kiln_dtype_block(dt))
        return kiln_error(KILN_ERR_ARG, "linear: %s weight rows of %lld are not whole blocks of %d", kiln_dtype_name(dt),
                          (long long)K, kiln_dtype_block(dt));
    int64_t nb = lowbit_panel_rows(N, K);
    float *panel = kiln_cpu_scratch_get((size_t)(nb * K) * sizeof(float));
    if (!panel) return kiln_error(KILN_ERR_OOM, "linear: no memory for a %lld x %lld weight panel", (long long)nb, (long long)K);
    for (int64_t n0 = 0; n0 < N; n0 += nb) {
        int64_t rows = N - n0 < nb ? N - n0 : nb;
        decode_ctx c = {panel, w, dt, n0, K};
        kiln_parallel_for(rows, 8, decode_rows, &c);
        gemm_args g = {.trans_b = 1, .M = M, .N = rows, .K = K, .alpha = 1.0f, .A = x, .lda = K, .a_dt = KILN_F32,
                       .B = panel, .ldb = K, .b_dt = KILN_F32, .C = y + n0, .ldc = N,
                       .bias_col = bias ? bias + n0 : NULL, .bf16 = kiln_cpu_bf16_mode(M)};
        gemm_dispatch(&g);
    }
    kiln_cpu_scratch_put(panel);
    return KILN_OK;
}

kiln_status kiln_cpu_linear(float *y, const float *x, const void *w, kiln_dtype w_dtype,
                            const float *bias, int64_t M, int64_t N, int64_t K)
{
    int lowbit = w_dtype == KILN_F8_E4M3FN || w_dtype == KILN_F8_E5M2 || kiln_dtype_is_blocked(w_dtype);
    if (w_dtype != KILN_F32 && w_dtype != KILN_F16 && w_dtype != KILN_BF16 && !lowbit)
        return kiln_error(KILN_ERR_UNSUPPORTED, "linear: weight dtype %s (expected a float type: f32, f16, bf16, fp8 "
                          "or a ggml block type)", kiln_dtype_name(w_dtype));
    if (M < 0 || N < 0 || K < 0)
        return kiln_error(KILN_ERR_ARG, "linear: negative size M=%lld N=%lld K=%lld", (long long)M, (long long)N,
                          (long long)K);
    if (M == 0 || N == 0) return KILN_OK;
    if (!y || !x || (!w && K > 0)) return kiln_error(KILN_ERR_ARG, "linear: NULL buffer");
    /* precision int8: W8A8 on VNNI (gemm_int8.c) for products of enough rows to pay for
     * quantizing the weights each call; else on below (bf16) */
    if (M >= INT8_MIN_ROWS && kiln_precision_for(NULL) == KILN_PREC_INT8 &&
        kiln_cpu_linear_int8(y, x, w, w_dtype, bias, M, N, K) == 0)
        return KILN_OK;
    if (lowbit) {
        /* the packed kernel decodes while packing B; elsewhere, decoded panels */
        gemm_args g = {.trans_b = 1, .M = M, .N = N, .K = K, .alpha = 1.0f, .A = x, .lda = K, .a_dt = KILN_F32,
                       .B = w, .ldb = K, .b_dt = w_dtype, .C = y, .ldc = N, .bias_col = bias,
                       .bf16 = kiln_cpu_bf16_mode(M)};
        if (K % kiln_dtype_block(w_dtype) == 0 && have_avx512() && (double)M * (double)N * (double)K >= SMALL_MACS &&
            packed_gemm(&g, NULL, kiln_cpu_threads()) == 0)
            return KILN_OK;
        return linear_lowbit(y, x, w, w_dtype, bias, M, N, K);
    }
    /* f16/bf16 weights are converted while packing B, one KC x NB panel at a time (on
     * the BLAS path, 256 rows at a time); the bias is added as C is stored. */
    gemm_args g = {.trans_b = 1, .M = M, .N = N, .K = K, .alpha = 1.0f, .A = x, .lda = K, .a_dt = KILN_F32,
                   .B = w, .ldb = K, .b_dt = w_dtype, .C = y, .ldc = N, .bias_col = bias,
                   .bf16 = kiln_cpu_bf16_mode(M)};
    gemm_dispatch(&g);
    return KILN_OK;
}

/* ---- the scratch a call takes, bounded from above for a dry run's model ----
 * Every block a path of these products can take (the rounded A, the per-thread
 * packing, the BLAS path's converted panel, the low-bit path's decoded panel) counted
 * as if all were taken together: only one path runs, so the sum is never below what a
 * call holds at once. */
size_t kiln_cpu_gemm_scratch_bound(int64_t M, int64_t N, int64_t K, kiln_dtype b_dt, int batched)
{
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    int threads = kiln_cpu_threads();
    size_t pack = (size_t)threads * per_thread_floats(NB_MAX) * sizeof(float);
    size_t n = kiln_cpu_scratch_block_bound(((size_t)(M + MR - 1) / MR * MR) * (size_t)((K + 1) / 2) * sizeof(uint32_t));
    n += kiln_cpu_scratch_block_bound(pack);
    if (batched) n += kiln_cpu_scratch_block_bound(pack);
    if (b_dt != KILN_F32) n += kiln_cpu_scratch_block_bound((size_t)256 * (size_t)K * sizeof(float));
    if (b_dt != KILN_F32 && b_dt != KILN_F16 && b_dt != KILN_BF16)
        n += kiln_cpu_scratch_block_bound((size_t)lowbit_panel_rows(N, K) * (size_t)K * sizeof(float));
    return n;
}
