/* test_adapter.c - the weight adapters' arithmetic (runtime/adapter_delta.c) on small
 * cases worked out by hand in the comments (LoRA, LoCon CP, LoHa and its CP form,
 * LoKr with full and factored operands, diff, DoRA), the reshape rule (a delta fits
 * any weight of its element count), a larger LoRA through the backend's GEMM against
 * a plain loop, factor checks naming the field, and row slices through the model
 * store (a q/k/v part of a fused weight). */
#define _GNU_SOURCE
#include "adapter_delta.h"
#include "model.h"
#include "safetensors.h"
#include "test.h"

#include <stdint.h>
#include <unistd.h>

static char dir[64];

/* A cpu tensor of the given shape holding vals (f32), or dtype dt. */
static kiln_tensor *mk_dt(kiln_dtype dt, int ndim, const int64_t *shape, const float *vals)
{
    kiln_tensor *t = NULL, *f = NULL;
    if (kiln_tensor_new(kiln_device_cpu(), KILN_F32, ndim, shape, &f)) return NULL;
    memcpy(kiln_tensor_data(f), vals, sizeof(float) * (size_t)kiln_tensor_numel(f));
    if (dt == KILN_F32) return f;
    kiln_tensor_to(f, kiln_device_cpu(), dt, &t);
    kiln_tensor_free(f);
    return t;
}

#define MK(ndim, shape, ...) mk_dt(KILN_F32, ndim, (const int64_t[])shape, (const float[])__VA_ARGS__)
#define S(...) {__VA_ARGS__}

static void free_all(kiln_adapter *a)
{
    for (int f = 0; f < KILN_AF_COUNT; f++) kiln_tensor_free((kiln_tensor *)a->f[f]);
}

/* Applies a to w (ndim, shape) and compares with want. */
static void expect(kiln_adapter *a, float *w, int ndim, const int64_t *shape, const float *want, int n, double tol)
{
    kiln_status st = kiln_adapter_apply(a, w, ndim, shape);
    CHECK(st == KILN_OK, "apply: %s", kiln_last_error());
    for (int i = 0; i < n; i++) CHECK(fabs(w[i] - want[i]) <= tol, "element %d: %.9g, expected %.9g", i, w[i], want[i]);
}

static void t_lora(void)
{
    /* up [2,1] = (1, 2)^T, down [1,3] = (1, 0, -1): up @ down = [[1,0,-1],[2,0,-2]];
     * scale 0.5 on w = ones: [[1.5, 1, 0.5], [2, 1, 0]] */
    kiln_adapter a = {.kind = KILN_ADAPTER_LORA, .scale = 0.5};
    a.f[KILN_AF_UP] = MK(2, S(2, 1), {1, 2});
    a.f[KILN_AF_DOWN] = MK(2, S(1, 3), {1, 0, -1});
    float w[6] = {1, 1, 1, 1, 1, 1};
    expect(&a, w, 2, (const int64_t[]){2, 3}, (const float[]){1.5f, 1, 0.5f, 2, 1, 0}, 6, 0);
    /* f16 factors: the same values are exact in f16 */
    kiln_adapter h = {.kind = KILN_ADAPTER_LORA, .scale = 0.5};
    h.f[KILN_AF_UP] = mk_dt(KILN_F16, 2, (const int64_t[]){2, 1}, (const float[]){1, 2});
    h.f[KILN_AF_DOWN] = mk_dt(KILN_BF16, 2, (const int64_t[]){1, 3}, (const float[]){1, 0, -1});
    float w2[6] = {0};
    expect(&h, w2, 2, (const int64_t[]){2, 3}, (const float[]){0.5f, 0, -0.5f, 1, 0, -1}, 6, 0);
    free_all(&a);
    free_all(&h);
}

static void t_lora_cp(void)
{
    /* LoCon CP: up [2,2,1,1] = [[1,1],[0,2]], mid [2,2,1,2] with mid[0,0]=(1,2),
     * mid[0,1]=(3,4), mid[1,0]=(5,6), mid[1,1]=(7,8), down [2,1,1,1] = (1, 2).
     * down'[p,0,:] = sum_b down[b] mid[p,b,:]: p=0: (1,2)+2(3,4) = (7,10);
     * p=1: (5,6)+2(7,8) = (19,22). delta = up @ down': row 0 = (7+19, 10+22) =
     * (26, 32); row 1 = 2 (19, 22) = (38, 44); shape [2,1,1,2]. */
    kiln_adapter a = {.kind = KILN_ADAPTER_LORA, .scale = 1};
    a.f[KILN_AF_UP] = MK(4, S(2, 2, 1, 1), {1, 1, 0, 2});
    a.f[KILN_AF_MID] = MK(4, S(2, 2, 1, 2), {1, 2, 3, 4, 5, 6, 7, 8});
    a.f[KILN_AF_DOWN] = MK(4, S(2, 1, 1, 1), {1, 2});
    int nd;
    int64_t s[KILN_MAX_DIMS];
    CHECK(kiln_adapter_delta_shape(&a, &nd, s) == KILN_OK, "%s", kiln_last_error());
    CHECK(nd == 4 && s[0] == 2 && s[1] == 1 && s[2] == 1 && s[3] == 2, "shape [2,1,1,2]");
    float w[4] = {0};
    expect(&a, w, 4, (const int64_t[]){2, 1, 1, 2}, (const float[]){26, 32, 38, 44}, 4, 0);
    free_all(&a);
}

static void t_loha(void)
{
    /* w1a (1,2)^T @ w1b (3,4) = [[3,4],[6,8]]; w2a (1,-1)^T @ w2b (1,0.5) =
     * [[1,0.5],[-1,-0.5]]; Hadamard: [[3,2],[-6,-4]]; scale 2: [[6,4],[-12,-8]] */
    kiln_adapter a = {.kind = KILN_ADAPTER_LOHA, .scale = 2};
    a.f[KILN_AF_W1A] = MK(2, S(2, 1), {1, 2});
    a.f[KILN_AF_W1B] = MK(2, S(1, 2), {3, 4});
    a.f[KILN_AF_W2A] = MK(2, S(2, 1), {1, -1});
    a.f[KILN_AF_W2B] = MK(2, S(1, 2), {1, 0.5f});
    float w[4] = {0};
    expect(&a, w, 2, (const int64_t[]){2, 2}, (const float[]){6, 4, -12, -8}, 4, 0);
    free_all(&a);

    /* CP: m1[p,r,0,l] = t1[0,0,0,l] w1b[0,r] w1a[0,p] with t1 (1,2), w1a [1,2] = (1,2)
     * ([rank, out]), w1b [1,1] = 3: p=0: (3,6); p=1: (6,12). t2, w2a, w2b all ones:
     * m2 = 1. delta [2,1,1,2] = (3, 6, 6, 12). */
    kiln_adapter c = {.kind = KILN_ADAPTER_LOHA, .scale = 1};
    c.f[KILN_AF_T1] = MK(4, S(1, 1, 1, 2), {1, 2});
    c.f[KILN_AF_W1A] = MK(2, S(1, 2), {1, 2});
    c.f[KILN_AF_W1B] = MK(2, S(1, 1), {3});
    c.f[KILN_AF_T2] = MK(4, S(1, 1, 1, 2), {1, 1});
    c.f[KILN_AF_W2A] = MK(2, S(1, 2), {1, 1});
    c.f[KILN_AF_W2B] = MK(2, S(1, 1), {1});
    float w2[4] = {0};
    expect(&c, w2, 4, (const int64_t[]){2, 1, 1, 2}, (const float[]){3, 6, 6, 12}, 4, 0);
    free_all(&c);
}

static void t_lokr(void)
{
    /* kron(w1 [[1,2],[3,4]], w2 [[1,10]]) = [[1,10,2,20],[3,30,4,40]]; scale 0.5 */
    kiln_adapter a = {.kind = KILN_ADAPTER_LOKR, .scale = 0.5};
    a.f[KILN_AF_W1] = MK(2, S(2, 2), {1, 2, 3, 4});
    a.f[KILN_AF_W2] = MK(2, S(1, 2), {1, 10});
    float w[8] = {0};
    expect(&a, w, 2, (const int64_t[]){2, 4}, (const float[]){0.5f, 5, 1, 10, 1.5f, 15, 2, 20}, 8, 0);
    free_all(&a);

    /* factored w1 = w1a (1,2)^T @ w1b [[1]] = [[1],[2]] next to a 4-D w2 [1,1,1,2] =
     * (5,6): w1 becomes [2,1,1,1], kron = [2,1,1,2] = (5,6,10,12) */
    kiln_adapter b = {.kind = KILN_ADAPTER_LOKR, .scale = 1};
    b.f[KILN_AF_W1A] = MK(2, S(2, 1), {1, 2});
    b.f[KILN_AF_W1B] = MK(2, S(1, 1), {1});
    b.f[KILN_AF_W2] = MK(4, S(1, 1, 1, 2), {5, 6});
    int nd;
    int64_t s[KILN_MAX_DIMS];
    CHECK(kiln_adapter_delta_shape(&b, &nd, s) == KILN_OK, "%s", kiln_last_error());
    CHECK(nd == 4 && s[0] == 2 && s[1] == 1 && s[2] == 1 && s[3] == 2, "kron shape [2,1,1,2]: nd %d", nd);
    float w2[4] = {0};
    expect(&b, w2, 4, (const int64_t[]){2, 1, 1, 2}, (const float[]){5, 6, 10, 12}, 4, 0);
    free_all(&b);

    /* factored w2 = w2a [[1],[1]] @ w2b [[2,3]] = [[2,3],[2,3]], w1 [[1],[-1]]:
     * kron [4,2] = [[2,3],[2,3],[-2,-3],[-2,-3]] */
    kiln_adapter c = {.kind = KILN_ADAPTER_LOKR, .scale = 1};
    c.f[KILN_AF_W1] = MK(2, S(2, 1), {1, -1});
    c.f[KILN_AF_W2A] = MK(2, S(2, 1), {1, 1});
    c.f[KILN_AF_W2B] = MK(2, S(1, 2), {2, 3});
    float w3[8] = {0};
    expect(&c, w3, 2, (const int64_t[]){4, 2}, (const float[]){2, 3, 2, 3, -2, -3, -2, -3}, 8, 0);
    free_all(&c);
}

static void t_diff_reshape(void)
{
    /* diff [2,2] = (1,2,3,4) onto a 1-D weight of 4: w += 0.25 diff */
    kiln_adapter a = {.kind = KILN_ADAPTER_DIFF, .scale = 0.25};
    a.f[KILN_AF_DIFF] = MK(2, S(2, 2), {1, 2, 3, 4});
    float w[4] = {1, 1, 1, 1};
    expect(&a, w, 1, (const int64_t[]){4}, (const float[]){1.25f, 1.5f, 1.75f, 2}, 4, 0);
    free_all(&a);

    /* a linear LoRA ([2,1] @ [1,3]) on a 1x1 conv weight [2,3,1,1], and a conv LoRA
     * ([2,1,1,1] @ [1,3,1,1]) on a linear [2,3]: the same flat delta
     * (1,2,3, 2,4,6) from up (1,2) and down (1,2,3) */
    kiln_adapter l = {.kind = KILN_ADAPTER_LORA, .scale = 1};
    l.f[KILN_AF_UP] = MK(2, S(2, 1), {1, 2});
    l.f[KILN_AF_DOWN] = MK(2, S(1, 3), {1, 2, 3});
    float w1[6] = {0};
    expect(&l, w1, 4, (const int64_t[]){2, 3, 1, 1}, (const float[]){1, 2, 3, 2, 4, 6}, 6, 0);
    free_all(&l);
    kiln_adapter c = {.kind = KILN_ADAPTER_LORA, .scale = 1};
    c.f[KILN_AF_UP] = MK(4, S(2, 1, 1, 1), {1, 2});
    c.f[KILN_AF_DOWN] = MK(4, S(1, 3, 1, 1), {1, 2, 3});
    float w2[6] = {0};
    expect(&c, w2, 2, (const int64_t[]){2, 3}, (const float[]){1, 2, 3, 2, 4, 6}, 6, 0);
    /* a different element count is refused */
    float w3[8] = {0};
    CHECK(kiln_adapter_apply(&c, w3, 2, (const int64_t[]){2, 4}) == KILN_ERR_ARG, "element count mismatch refused");
    free_all(&c);
}

static void t_dora(void)
{
    /* w = [[1,0],[0,1]], up (1,1)^T @ down (1,1) = ones: wc = [[2,1],[1,2]]; the norm of
     * each column (dim 2) is sqrt(5); dora_scale (1, 2): wc = [[2,2],[1,4]] / sqrt(5).
     * strength 1: w = wc. */
    const float r5 = 1.0f / sqrtf(5.0f);
    kiln_adapter a = {.kind = KILN_ADAPTER_LORA, .scale = 1};
    a.f[KILN_AF_UP] = MK(2, S(2, 1), {1, 1});
    a.f[KILN_AF_DOWN] = MK(2, S(1, 2), {1, 1});
    a.f[KILN_AF_DORA_SCALE] = MK(2, S(1, 2), {1, 2});
    float w[4] = {1, 0, 0, 1};
    expect(&a, w, 2, (const int64_t[]){2, 2}, (const float[]){2 * r5, 2 * r5, r5, 4 * r5}, 4, 1e-6);
    /* strength 0.5 with scale 0.5 (the delta's own factor stays 1): the same wc, mixed
     * half in: w + 0.5 (wc - w) = [[0.5 + r5, r5], [0.5 r5, 0.5 + 2 r5]] */
    a.scale = 0.5;
    a.strength = 0.5;
    float w2[4] = {1, 0, 0, 1};
    expect(&a, w2, 2, (const int64_t[]){2, 2}, (const float[]){0.5f + r5, r5, 0.5f * r5, 0.5f + 2 * r5}, 4, 1e-6);
    /* scale 0 and strength 0: nothing changes */
    a.scale = 0;
    a.strength = 0;
    float w3[4] = {1, 0, 0, 1};
    expect(&a, w3, 2, (const int64_t[]){2, 2}, (const float[]){1, 0, 0, 1}, 4, 0);
    /* one value per column, else refused */
    a.scale = 1;
    float w4[4] = {0};
    CHECK(kiln_adapter_apply(&a, w4, 2, (const int64_t[]){1, 4}) == KILN_ERR_ARG && strstr(kiln_last_error(), "dora_scale"),
          "dora_scale of 2 on 4 columns refused: %s", kiln_last_error());
    free_all(&a);
}

/* A rank-32 LoRA [320 x 32] @ [32 x 768] through the backend's GEMM against a loop in
 * double. */
static void t_lora_gemm(void)
{
    enum { O = 320, R = 32, I = 768 };
    float *u = malloc(sizeof(float) * O * R), *d = malloc(sizeof(float) * R * I), *w = calloc(O * I, sizeof(float));
    for (int i = 0; i < O * R; i++) u[i] = (float)((i * 37 % 101) - 50) / 50.0f;
    for (int i = 0; i < R * I; i++) d[i] = (float)((i * 53 % 97) - 48) / 48.0f;
    kiln_adapter a = {.kind = KILN_ADAPTER_LORA, .scale = 0.25};
    a.f[KILN_AF_UP] = mk_dt(KILN_F32, 2, (const int64_t[]){O, R}, u);
    a.f[KILN_AF_DOWN] = mk_dt(KILN_F32, 2, (const int64_t[]){R, I}, d);
    CHECK(kiln_adapter_apply(&a, w, 2, (const int64_t[]){O, I}) == KILN_OK, "%s", kiln_last_error());
    double worst = 0;
    for (int o = 0; o < O; o += 7)
        for (int i = 0; i < I; i += 5) {
            double s = 0;
            for (int r = 0; r < R; r++) s += (double)u[o * R + r] * d[r * I + i];
            double e = fabs(w[o * I + i] - 0.25 * s);
            if (e > worst) worst = e;
        }
    CHECK(worst < 1e-4, "max error %g", worst);
    free_all(&a);
    free(u);
    free(d);
    free(w);
}

static void t_checks(void)
{
    int nd;
    int64_t s[KILN_MAX_DIMS];
    kiln_adapter a = {.kind = KILN_ADAPTER_LORA, .scale = 1};
    static const float zeros[16];
    a.f[KILN_AF_UP] = mk_dt(KILN_F32, 2, (const int64_t[]){4, 3}, zeros);
    a.f[KILN_AF_DOWN] = mk_dt(KILN_F32, 2, (const int64_t[]){2, 5}, zeros);
    CHECK(kiln_adapter_delta_shape(&a, &nd, s) == KILN_ERR_ARG && strstr(kiln_last_error(), "'up' [4,3]") &&
              strstr(kiln_last_error(), "'down' [2,5]"),
          "rank mismatch names both: %s", kiln_last_error());
    kiln_tensor_free((kiln_tensor *)a.f[KILN_AF_DOWN]);
    a.f[KILN_AF_DOWN] = NULL;
    CHECK(kiln_adapter_delta_shape(&a, &nd, s) == KILN_ERR_ARG && strstr(kiln_last_error(), "'down'"),
          "missing factor named: %s", kiln_last_error());
    a.kind = KILN_ADAPTER_LOHA;
    CHECK(kiln_adapter_delta_shape(&a, &nd, s) == KILN_ERR_ARG && strstr(kiln_last_error(), "'up' is not a factor of a loha"),
          "foreign factor: %s", kiln_last_error());
    free_all(&a);
    CHECK(kiln_adapter_kind_from_name("lokr") == KILN_ADAPTER_LOKR && kiln_adapter_kind_from_name("x") == -1, "kinds");
    CHECK(strcmp(kiln_adapter_factor_name(KILN_AF_DORA_SCALE), "dora_scale") == 0, "factor names");
}

/* Rows 3..4 (0-based 2..3) of a fused [6,2] weight through the model store; the rest
 * untouched, removal exact. */
static void t_rows(void)
{
    char path[128];
    snprintf(path, sizeof path, "%s/rows.safetensors", dir);
    float v[12];
    for (int i = 0; i < 12; i++) v[i] = (float)i;
    int64_t shape[2] = {6, 2};
    kiln_st_item item = {"qkv", KILN_F32, 2, shape, v};
    CHECK(kiln_st_save(path, 1, &item, 0, NULL, NULL) == KILN_OK, "%s", kiln_last_error());
    const char *p = path;
    kiln_model *m = NULL;
    CHECK(kiln_model_open(&p, 1, "rows", &m) == KILN_OK, "%s", kiln_last_error());
    if (!m) return;
    /* diff (10, 20, 30, 40) on rows 2..3: elements 4..7 become 14, 25, 36, 47 */
    kiln_adapter a = {.kind = KILN_ADAPTER_DIFF, .scale = 1};
    a.f[KILN_AF_DIFF] = MK(2, S(2, 2), {10, 20, 30, 40});
    int id = 0;
    CHECK(kiln_model_add_patch(m, "qkv", &a, 2, 2, &id) == KILN_OK && id > 0, "%s", kiln_last_error());
    free_all(&a); /* the store holds its own references */
    kiln_tensor *t = NULL;
    CHECK(kiln_model_tensor(m, "qkv", &t) == KILN_OK, "%s", kiln_last_error());
    const float want[12] = {0, 1, 2, 3, 14, 25, 36, 47, 8, 9, 10, 11};
    for (int i = 0; t && i < 12; i++) CHECK(((float *)kiln_tensor_data(t))[i] == want[i], "element %d", i);
    kiln_tensor_free(t);
    CHECK(kiln_model_patch_count(m, "qkv") == 1 && kiln_model_patch_count(m, NULL) == 1, "count");
    /* rows past the end are refused, naming the tensor */
    kiln_adapter b = {.kind = KILN_ADAPTER_DIFF, .scale = 1};
    b.f[KILN_AF_DIFF] = MK(1, S(4), {0, 0, 0, 0});
    int id2;
    CHECK(kiln_model_add_patch(m, "qkv", &b, 5, 2, &id2) == KILN_ERR_ARG && strstr(kiln_last_error(), "'qkv' [6,2]"),
          "%s", kiln_last_error());
    free_all(&b);
    CHECK(kiln_model_remove_patch(m, id) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_tensor(m, "qkv", &t) == KILN_OK, "%s", kiln_last_error());
    CHECK(t && memcmp(kiln_tensor_data(t), v, sizeof v) == 0, "removed: the file's values");
    kiln_tensor_free(t);
    kiln_model_close(m);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kiln_adapter_XXXXXX");
    if (!mkdtemp(dir)) { printf("FAIL setup: mkdtemp\n"); return 1; }
    RUN(t_lora);
    RUN(t_lora_cp);
    RUN(t_loha);
    RUN(t_lokr);
    RUN(t_diff_reshape);
    RUN(t_dora);
    RUN(t_lora_gemm);
    RUN(t_checks);
    RUN(t_rows);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("# could not remove %s\n", dir);
    return test_summary();
}
