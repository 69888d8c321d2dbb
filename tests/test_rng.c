/* test_rng.c - kiln_rng against the mt19937 reference and against torch.randn /
 * torch.rand bit for bit (tests/golden/randn.bin from tests/golden/gen_randn.py). */
#include "rng.h"
#include "test.h"

#include <stdint.h>

#define GOLDEN_RANDN "tests/golden/randn.bin"

/* ---- a bounds-checked little-endian reader over the golden file ---- */
typedef struct {
    unsigned char *buf;
    size_t len, pos;
    int bad;
} reader;

static int read_file(const char *path, reader *r)
{
    memset(r, 0, sizeof *r);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    size_t cap = 1 << 16;
    r->buf = malloc(cap);
    size_t got;
    while (r->buf && (got = fread(r->buf + r->len, 1, cap - r->len, f)) > 0) {
        r->len += got;
        if (r->len == cap) {
            unsigned char *nb = realloc(r->buf, cap * 2);
            if (!nb) { free(r->buf); r->buf = NULL; break; }
            r->buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    return r->buf != NULL;
}

static const unsigned char *take(reader *r, size_t n)
{
    if (r->bad || n > r->len - r->pos) { r->bad = 1; return NULL; }
    const unsigned char *p = r->buf + r->pos;
    r->pos += n;
    return p;
}

static uint64_t get_le(reader *r, int nbytes)
{
    const unsigned char *p = take(r, (size_t)nbytes);
    uint64_t v = 0;
    if (!p) return 0;
    for (int i = nbytes - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void get_floats(reader *r, float *dst, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)get_le(r, 4);
        memcpy(&dst[i], &u, 4);
    }
}

static uint64_t fnv1a64(const float *v, int64_t n)
{
    uint64_t h = 0xcbf29ce484222325u;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        for (int b = 0; b < 4; b++) { h ^= (u >> (8 * b)) & 0xff; h *= 0x100000001b3u; }
    }
    return h;
}

/* ---- tests ---- */

/* The C++ standard fixes the 10000th output of a default-seeded mt19937. */
static void t_mt19937_reference(void)
{
    kiln_rng g;
    kiln_rng_seed(&g, 5489);
    uint32_t v = 0;
    for (int i = 0; i < 10000; i++) v = kiln_rng_u32(&g);
    CHECK(v == 4123659995u, "10000th output %u, expected 4123659995", v);
}

/* torch.manual_seed keeps only the low 32 bits of the seed for the engine. */
static void t_seed_low_32_bits(void)
{
    kiln_rng a, b;
    kiln_rng_seed(&a, (UINT64_C(1) << 32) + 5);
    kiln_rng_seed(&b, 5);
    int same = 1;
    for (int i = 0; i < 2000; i++) same &= kiln_rng_u32(&a) == kiln_rng_u32(&b);
    CHECK(same, "seed 2^32+5 and seed 5 give different streams");
}

static void t_u64_is_two_u32(void)
{
    kiln_rng a, b;
    kiln_rng_seed(&a, 99);
    kiln_rng_seed(&b, 99);
    for (int i = 0; i < 700; i++) {
        uint64_t hi = kiln_rng_u32(&b), lo = kiln_rng_u32(&b);
        uint64_t v = kiln_rng_u64(&a);
        if (v != ((hi << 32) | lo)) { CHECK(0, "u64 #%d = %llx", i, (unsigned long long)v); return; }
    }
}

static void t_rand_range(void)
{
    kiln_rng g;
    kiln_rng_seed(&g, 3);
    enum { N = 10000 };
    static float v[N];
    kiln_rng_rand_f32(&g, v, N);
    double sum = 0;
    for (int i = 0; i < N; i++) {
        float scaled = v[i] * 16777216.0f;
        if (!(v[i] >= 0.0f && v[i] < 1.0f) || scaled != floorf(scaled)) {
            CHECK(0, "rand[%d] = %.9g is not k * 2^-24 in [0, 1)", i, v[i]);
            return;
        }
        sum += v[i];
    }
    CHECK_NEAR(sum / N, 0.5, 0.02);
}

static void t_randn_moments(void)
{
    kiln_rng g;
    kiln_rng_seed(&g, 11);
    enum { N = 1 << 16 };
    float *v = malloc(N * sizeof *v);
    if (!v) { CHECK(0, "out of memory"); return; }
    kiln_rng_randn_f32(&g, v, N);
    double s = 0, s2 = 0;
    int finite = 1;
    for (int i = 0; i < N; i++) { s += v[i]; s2 += (double)v[i] * v[i]; finite &= isfinite(v[i]) != 0; }
    CHECK(finite, "non-finite randn value");
    CHECK_NEAR(s / N, 0.0, 0.02);
    CHECK_NEAR(s2 / N, 1.0, 0.03);
    free(v);
}

/* n <= 0 or NULL pointers draw nothing and leave the stream where it was. */
static void t_empty_calls(void)
{
    kiln_rng a, b;
    kiln_rng_seed(&a, 8);
    kiln_rng_seed(&b, 8);
    float x[4];
    kiln_rng_randn_f32(&a, x, 0);
    kiln_rng_randn_f32(&a, x, -3);
    kiln_rng_randn_f32(&a, NULL, 4);
    kiln_rng_rand_f32(&a, x, 0);
    kiln_rng_rand_f32(&a, NULL, 4);
    kiln_rng_randn_f32(NULL, x, 4);
    CHECK(kiln_rng_u32(&a) == kiln_rng_u32(&b), "an empty call moved the stream");
}

/* Every golden record: one manual_seed, then the same sequence of calls. */
static void t_torch_golden(void)
{
    reader r;
    if (!read_file(GOLDEN_RANDN, &r)) { CHECK(0, "cannot read %s", GOLDEN_RANDN); return; }
    const unsigned char *magic = take(&r, 8);
    CHECK(magic && memcmp(magic, "KRNGOLD1", 8) == 0, "%s: bad magic", GOLDEN_RANDN);
    uint32_t n_rec = (uint32_t)get_le(&r, 4);
    int n_calls_total = 0, n_values = 0, n_bad_calls = 0;
    for (uint32_t ri = 0; ri < n_rec && !r.bad && !test_cur_failed; ri++) {
        uint64_t seed = get_le(&r, 8);
        uint32_t n_calls = (uint32_t)get_le(&r, 4);
        kiln_rng g;
        kiln_rng_seed(&g, seed);
        for (uint32_t ci = 0; ci < n_calls && !r.bad; ci++) {
            uint32_t kind = (uint32_t)get_le(&r, 4), n = (uint32_t)get_le(&r, 4);
            uint32_t n_head = (uint32_t)get_le(&r, 4), n_tail = (uint32_t)get_le(&r, 4);
            uint64_t hash = get_le(&r, 8);
            if (r.bad || kind > 1 || n == 0 || n > (1u << 24) || n_head > n || n_tail > n - n_head) {
                CHECK(0, "%s: malformed call %u of record %u", GOLDEN_RANDN, ci, ri);
                r.bad = 1;
                break;
            }
            float *want = malloc(((size_t)n_head + n_tail + 1) * sizeof(float));
            float *got = malloc((size_t)n * sizeof(float));
            if (!want || !got) { free(want); free(got); CHECK(0, "out of memory"); r.bad = 1; break; }
            get_floats(&r, want, n_head);
            get_floats(&r, want + n_head, n_tail);
            if (r.bad) { free(want); free(got); break; }
            if (kind == 0) kiln_rng_randn_f32(&g, got, n);
            else kiln_rng_rand_f32(&g, got, n);
            const char *what = kind == 0 ? "randn" : "rand";
            int ok = !r.bad && fnv1a64(got, n) == hash;
            for (uint32_t i = 0; i < n_head + n_tail; i++) {
                uint32_t at = i < n_head ? i : n - n_tail + (i - n_head);
                if (memcmp(&got[at], &want[i], 4) != 0) {
                    uint32_t gb, wb;
                    memcpy(&gb, &got[at], 4);
                    memcpy(&wb, &want[i], 4);
                    if (n_bad_calls < 5)
                        CHECK(0, "seed %llu call %u %s(%u)[%u] = %.9g (0x%08x), torch %.9g (0x%08x)",
                              (unsigned long long)seed, ci, what, n, at, got[at], (unsigned)gb, want[i], (unsigned)wb);
                    ok = 0;
                    break;
                }
            }
            if (!ok) {
                n_bad_calls++;
                CHECK(0, "seed %llu call %u %s(%u) differs from torch", (unsigned long long)seed, ci, what, n);
            }
            n_calls_total++;
            n_values += (int)n;
            free(want);
            free(got);
        }
    }
    CHECK(!r.bad, "%s: truncated or malformed", GOLDEN_RANDN);
    CHECK(r.bad || r.pos == r.len, "%s: %zu trailing bytes", GOLDEN_RANDN, r.len - r.pos);
    CHECK(n_calls_total >= 70, "only %d golden calls checked", n_calls_total);
    if (!test_cur_failed) printf("     %d torch calls, %d values bit-exact\n", n_calls_total, n_values);
    free(r.buf);
}

int main(void)
{
    RUN(t_mt19937_reference);
    RUN(t_seed_low_32_bits);
    RUN(t_u64_is_two_u32);
    RUN(t_rand_range);
    RUN(t_randn_moments);
    RUN(t_empty_calls);
    RUN(t_torch_golden);
    return test_summary();
}
