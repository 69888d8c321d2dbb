/* safetensors.c - .safetensors files: kiln_st_open maps a file read-only and
 * validates every header field before anything trusts it (zero copy: tensors point
 * into the mapping, kept alive by an atomic refcount); kiln_st_save writes a file
 * the reference implementation accepts, atomically (temp file, fsync, rename). */
#define _POSIX_C_SOURCE 200809L
#include "atomic_file.h"
#include "safetensors.h"
#include "json.h"
#include "unicode.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* A header is JSON text describing tensors; 100 MB covers millions of entries and
 * keeps a corrupt length from turning into a huge parse. */
#define ST_MAX_HEADER ((uint64_t)100 << 20)

/* The public struct first, so a kiln_st_file * is also an st_impl *. */
typedef struct {
    kiln_st_file pub;
    int *slots;          /* open-addressing hash: entry index or -1 */
    size_t slot_mask;
    char *strings;       /* one block holding names and metadata strings */
    void *aligned_copy;  /* the data section, copied when the file misaligns a tensor */
} st_impl;

/* ORDER DTYPE: safetensors' names of the kiln dtypes */
static const char *const st_dtype_names[KILN_DTYPE_COUNT] = {"F32", "F16", "BF16", "I32", "I64", "U8", "F8_E4M3",
                                                              "F8_E5M2"}; /* block types: none (NULL) */

/* dtypes of the format that kiln does not handle (a valid file, just not for us) */
static const char *const st_unsupported[] = {
    "F64", "I8", "I16", "U16", "U32", "U64", "BOOL", "F8_E8M0",
    "F6_E2M3", "F6_E3M2", "F4", "C64",
};

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* Slot table with room for n names; slots are -1 when empty. */
static int *slots_new(int n, size_t *mask)
{
    size_t cap = 8;
    while (cap < (size_t)n * 2) cap *= 2;
    int *slots = malloc(cap * sizeof *slots);
    if (!slots) return NULL;
    memset(slots, 0xff, cap * sizeof *slots);
    *mask = cap - 1;
    return slots;
}

/* Inserts index i (named names[i]); returns the index already holding that name, or -1. */
static int slots_insert(int *slots, size_t mask, const char *const *names, int i)
{
    size_t s = (size_t)hash_str(names[i]) & mask;
    while (slots[s] >= 0) {
        if (strcmp(names[slots[s]], names[i]) == 0) return slots[s];
        s = (s + 1) & mask;
    }
    slots[s] = i;
    return -1;
}

static void st_destroy(st_impl *im)
{
    if (!im) return;
    if (im->pub.map) munmap(im->pub.map, im->pub.map_size);
    free(im->pub.path);
    free(im->pub.entries);
    free(im->pub.meta_keys);
    free(im->pub.meta_values);
    free(im->slots);
    free(im->strings);
    free(im->aligned_copy);
    free(im);
}

void kiln_st_retain(kiln_st_file *f)
{
    if (f) __atomic_fetch_add(&f->refcount, 1, __ATOMIC_RELAXED);
}

void kiln_st_release(kiln_st_file *f)
{
    if (f && __atomic_sub_fetch(&f->refcount, 1, __ATOMIC_ACQ_REL) == 0) st_destroy((st_impl *)f);
}

kiln_status kiln_st_check(const kiln_st_file *f)
{
    if (!f) return kiln_error(KILN_ERR_ARG, "kiln_st_check: file is NULL");
    /* nothing is mapped when the data section is empty: nothing to fault on */
    if (!f->map) return KILN_OK;
    return kiln_file_stamp_check(f->path, &f->stamp);
}

kiln_status kiln_st_wrap(const kiln_st_file *desc, char *strings, kiln_st_file **out)
{
    *out = NULL;
    st_impl *im = calloc(1, sizeof *im);
    if (!im) return kiln_error(KILN_ERR_OOM, "%s: out of host memory", desc->path);
    im->pub = *desc;
    im->pub.refcount = 1;
    im->strings = strings;
    const char **names = malloc(sizeof *names * (size_t)(desc->n ? desc->n : 1));
    im->slots = slots_new(desc->n, &im->slot_mask);
    if (!names || !im->slots) {
        free(names);
        st_destroy(im);
        return kiln_error(KILN_ERR_OOM, "%s: out of host memory", desc->path);
    }
    for (int i = 0; i < desc->n; i++) names[i] = desc->entries[i].name;
    for (int i = 0; i < desc->n; i++)
        if (slots_insert(im->slots, im->slot_mask, names, i) >= 0) {
            kiln_status st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s' appears twice", desc->path, names[i]);
            free(names);
            st_destroy(im);
            return st;
        }
    free(names);
    *out = &im->pub;
    return KILN_OK;
}

int kiln_st_find(const kiln_st_file *f, const char *name)
{
    if (!f || !name) return -1;
    const st_impl *im = (const st_impl *)f;
    size_t s = (size_t)hash_str(name) & im->slot_mask;
    while (im->slots[s] >= 0) {
        if (strcmp(f->entries[im->slots[s]].name, name) == 0) return im->slots[s];
        s = (s + 1) & im->slot_mask;
    }
    return -1;
}

/* "[2, 3]" */
static const char *shape_str(const int64_t *shape, int ndim, char *buf, size_t n)
{
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int d = 0; d < ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

static int json_uint(const kiln_json *v, uint64_t *out)
{
    if (!v || v->type != KILN_JSON_NUMBER || !v->is_integer || v->integer < 0) return 0;
    *out = (uint64_t)v->integer;
    return 1;
}

static int cmp_entry(const void *a, const void *b)
{
    const kiln_st_entry *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Validates one tensor entry into e (name set by the caller). */
static kiln_status parse_entry(const char *path, const kiln_json *v, uint64_t data_size, kiln_st_entry *e)
{
    const char *name = e->name;
    if (v->type != KILN_JSON_OBJECT)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': entry is not an object", path, name);
    const kiln_json *dt = kiln_json_get(v, "dtype"), *sh = kiln_json_get(v, "shape"),
                    *off = kiln_json_get(v, "data_offsets");
    if (!dt || !sh || !off)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': missing '%s'", path, name,
                          !dt ? "dtype" : !sh ? "shape" : "data_offsets");
    if (dt->type != KILN_JSON_STRING)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': dtype is not a string", path, name);
    int d = -1;
    for (int i = 0; i < KILN_DTYPE_COUNT; i++)
        if (st_dtype_names[i] && strcmp(dt->string, st_dtype_names[i]) == 0) d = i;
    if (d < 0) {
        for (size_t i = 0; i < sizeof st_unsupported / sizeof st_unsupported[0]; i++)
            if (strcmp(dt->string, st_unsupported[i]) == 0)
                return kiln_error(KILN_ERR_UNSUPPORTED,
                                  "%s: tensor '%s': unsupported dtype %s (kiln reads F32, F16, BF16, I32, I64, U8)",
                                  path, name, st_unsupported[i]);
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': unknown dtype '%.32s'", path, name, dt->string);
    }
    e->dtype = (kiln_dtype)d;

    if (sh->type != KILN_JSON_ARRAY)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': shape is not an array", path, name);
    if (sh->count > KILN_ST_MAX_DIMS)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': shape has %zu dimensions (at most %d)", path, name,
                          sh->count, KILN_ST_MAX_DIMS);
    uint64_t numel = 1;
    int overflow = 0;
    e->ndim = 0;
    for (const kiln_json *x = sh->child; x; x = x->next) {
        if (x->type != KILN_JSON_NUMBER || !x->is_integer)
            return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': shape must hold integers", path, name);
        if (x->integer < 0)
            return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': negative dimension %lld in shape", path, name,
                              (long long)x->integer);
        uint64_t dim = (uint64_t)x->integer;
        if (dim && numel > UINT64_MAX / dim) overflow = 1;
        else numel *= dim;
        e->shape[e->ndim++] = x->integer;
    }
    size_t es = kiln_dtype_size(e->dtype);
    if (overflow || numel > UINT64_MAX / es)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': shape %s overflows", path, name,
                          shape_str(e->shape, e->ndim, (char[160]){0}, 160));
    uint64_t nbytes = numel * es;

    if (off->type != KILN_JSON_ARRAY || off->count != 2)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': data_offsets is not an array [begin, end]", path, name);
    if (!json_uint(off->child, &e->begin) || !json_uint(off->child->next, &e->end))
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': data_offsets must be non-negative integers", path, name);
    if (e->begin > e->end)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] end before they begin", path,
                          name, (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > data_size)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets [%llu, %llu] go past the data section (%llu bytes)", path,
                          name, (unsigned long long)e->begin, (unsigned long long)e->end,
                          (unsigned long long)data_size);
    if (e->end - e->begin != nbytes)
        return kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] do not match shape %s of %s (%llu bytes)",
                          path, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                          shape_str(e->shape, e->ndim, (char[160]){0}, 160), st_dtype_names[e->dtype],
                          (unsigned long long)nbytes);
    return KILN_OK;
}

/* Builds the file object from the parsed header. */
static kiln_status parse_header(st_impl *im, const kiln_json *root)
{
    kiln_st_file *f = &im->pub;
    const char *path = f->path;
    if (root->type != KILN_JSON_OBJECT)
        return kiln_error(KILN_ERR_FORMAT, "%s: header is not a JSON object", path);

    /* sizes first, so names and metadata share one allocation */
    size_t nstr = 0;
    int n = 0, n_meta = 0;
    const kiln_json *meta = NULL;
    for (const kiln_json *c = root->child; c; c = c->next) {
        if (strlen(c->key) != c->key_len)
            return kiln_error(KILN_ERR_FORMAT, "%s: tensor name '%s...' contains a NUL character", path, c->key);
        if (strcmp(c->key, "__metadata__") == 0) {
            if (meta) return kiln_error(KILN_ERR_FORMAT, "%s: __metadata__ appears twice", path);
            meta = c;
            if (c->type != KILN_JSON_OBJECT)
                return kiln_error(KILN_ERR_FORMAT, "%s: __metadata__ is not an object", path);
            for (const kiln_json *m = c->child; m; m = m->next) {
                if (m->type != KILN_JSON_STRING)
                    return kiln_error(KILN_ERR_FORMAT, "%s: __metadata__ value of '%s' is not a string", path, m->key);
                if (strlen(m->key) != m->key_len || strlen(m->string) != m->string_len)
                    return kiln_error(KILN_ERR_FORMAT, "%s: __metadata__ entry '%s' contains a NUL character", path,
                                      m->key);
                nstr += m->key_len + m->string_len + 2;
                n_meta++;
            }
            continue;
        }
        nstr += c->key_len + 1;
        n++;
    }
    im->strings = malloc(nstr ? nstr : 1);
    f->entries = calloc((size_t)n + 1, sizeof *f->entries);
    f->meta_keys = calloc((size_t)n_meta + 1, sizeof *f->meta_keys);
    f->meta_values = calloc((size_t)n_meta + 1, sizeof *f->meta_values);
    im->slots = slots_new(n, &im->slot_mask);
    if (!im->strings || !f->entries || !f->meta_keys || !f->meta_values || !im->slots)
        return kiln_error(KILN_ERR_OOM, "%s: out of memory for the header (%d tensors)", path, n);

    char *sp = im->strings;
    for (const kiln_json *c = root->child; c; c = c->next) {
        if (c == meta) continue;
        kiln_st_entry *e = &f->entries[f->n];
        memcpy(sp, c->key, c->key_len + 1);
        e->name = sp;
        sp += c->key_len + 1;
        kiln_status st = parse_entry(path, c, f->data_size, e);
        if (st) return st;
        f->n++;
    }
    if (meta) {
        for (const kiln_json *m = meta->child; m; m = m->next) {
            for (int k = 0; k < f->n_meta; k++)
                if (strcmp(f->meta_keys[k], m->key) == 0)
                    return kiln_error(KILN_ERR_FORMAT, "%s: __metadata__ key '%s' appears twice", path, m->key);
            memcpy(sp, m->key, m->key_len + 1);
            f->meta_keys[f->n_meta] = sp;
            sp += m->key_len + 1;
            memcpy(sp, m->string, m->string_len + 1);
            f->meta_values[f->n_meta] = sp;
            sp += m->string_len + 1;
            f->n_meta++;
        }
    }

    /* file order; then no two non-empty spans may share a byte (empty tensors
     * occupy nothing, so they may sit anywhere within bounds) */
    qsort(f->entries, (size_t)f->n, sizeof *f->entries, cmp_entry);
    int holder = -1;
    for (int i = 0; i < f->n; i++) {
        const kiln_st_entry *e = &f->entries[i];
        if (e->begin == e->end) continue;
        if (holder >= 0 && e->begin < f->entries[holder].end) {
            const kiln_st_entry *h = &f->entries[holder];
            return kiln_error(KILN_ERR_FORMAT, "%s: tensors '%s' [%llu, %llu] and '%s' [%llu, %llu] overlap", path,
                              h->name, (unsigned long long)h->begin, (unsigned long long)h->end, e->name,
                              (unsigned long long)e->begin, (unsigned long long)e->end);
        }
        if (holder < 0 || e->end > f->entries[holder].end) holder = i;
    }
    /* names are unique (a JSON object may repeat a key; we do not pick one) */
    const char **names = malloc(((size_t)f->n + 1) * sizeof *names);
    if (!names) return kiln_error(KILN_ERR_OOM, "%s: out of memory for the header", path);
    for (int i = 0; i < f->n; i++) names[i] = f->entries[i].name;
    for (int i = 0; i < f->n; i++) {
        if (slots_insert(im->slots, im->slot_mask, names, i) >= 0) {
            kiln_status st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s' appears twice", path, names[i]);
            free(names);
            return st;
        }
    }
    free(names);
    return KILN_OK;
}

/* Whether every tensor starts at an address that is a multiple of its element
 * size: conversions and kernels read elements as typed values. Writers pad the
 * header to 8 bytes and put wider elements first, so files almost always are. */
static int data_aligned(const kiln_st_file *f)
{
    for (int i = 0; i < f->n; i++) {
        size_t es = kiln_dtype_size(f->entries[i].dtype);
        if (es > 1 && f->entries[i].end > f->entries[i].begin &&
            (uintptr_t)(f->data + f->entries[i].begin) % es != 0)
            return 0;
    }
    return 1;
}

/* A file that misaligns a tensor is read once into aligned memory, each tensor at a
 * 64-byte boundary (no longer zero copy, but every tensor is usable), and its
 * mapping dropped; the entries' spans then refer to the copy. */
static kiln_status copy_data_aligned(st_impl *im)
{
    kiln_st_file *f = &im->pub;
    uint64_t total = 0;
    for (int i = 0; i < f->n; i++) total = (total + 63) / 64 * 64 + (f->entries[i].end - f->entries[i].begin);
    if (total > SIZE_MAX - 64)
        return kiln_error(KILN_ERR_OOM, "%s: too large for an aligned copy of its data", f->path);
    uint8_t *copy = aligned_alloc(64, ((size_t)total + 63) / 64 * 64 + 64);
    if (!copy)
        return kiln_error(KILN_ERR_OOM, "%s: out of memory for an aligned copy of its data (%llu bytes)", f->path,
                          (unsigned long long)total);
    uint64_t at = 0;
    for (int i = 0; i < f->n; i++) {
        kiln_st_entry *e = &f->entries[i];
        uint64_t n = e->end - e->begin;
        at = (at + 63) / 64 * 64;
        if (n) memcpy(copy + at, f->data + e->begin, (size_t)n);
        e->begin = at;
        e->end = at + n;
        at += n;
    }
    im->aligned_copy = copy;
    munmap(f->map, f->map_size);
    f->map = NULL;
    f->map_size = 0;
    f->data = copy;
    f->data_size = total;
    return KILN_OK;
}

kiln_status kiln_st_open(const char *path, kiln_st_file **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "kiln_st_open: out is NULL");
    *out = NULL;
    if (!path) return kiln_error(KILN_ERR_ARG, "kiln_st_open: path is NULL");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kiln_error(KILN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        kiln_status st = kiln_error(KILN_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return st;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return kiln_error(KILN_ERR_IO, "%s: not a regular file", path);
    }
    uint64_t size = (uint64_t)sb.st_size;
    if (size < 8) {
        close(fd);
        return kiln_error(KILN_ERR_FORMAT, "%s: file is %llu bytes, too small for a safetensors header", path,
                          (unsigned long long)size);
    }
    if (size > SIZE_MAX) {
        close(fd);
        return kiln_error(KILN_ERR_FORMAT, "%s: file too large to map", path);
    }
    kiln_file_stamp stamp;
    kiln_status stamp_st = kiln_file_stamp_take(fd, path, &stamp);
    if (stamp_st) {
        close(fd);
        return stamp_st;
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd); /* the mapping keeps the file */
    if (map == MAP_FAILED)
        return kiln_error(KILN_ERR_IO, "%s: cannot map %llu bytes: %s", path, (unsigned long long)size,
                          strerror(map_errno));

    st_impl *im = calloc(1, sizeof *im);
    char *pcopy = malloc(strlen(path) + 1);
    if (!im || !pcopy) {
        munmap(map, (size_t)size);
        free(im);
        free(pcopy);
        return kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
    }
    strcpy(pcopy, path);
    kiln_st_file *f = &im->pub;
    f->path = pcopy;
    f->refcount = 1;
    f->map = map;
    f->map_size = (size_t)size;
    f->stamp = stamp;

    const uint8_t *b = map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i]; /* little-endian u64 */
    kiln_status st = KILN_OK;
    if (hlen > size - 8)
        st = kiln_error(KILN_ERR_FORMAT, "%s: header length %llu goes past the end of the file (%llu bytes)", path,
                        (unsigned long long)hlen, (unsigned long long)size);
    else if (hlen > ST_MAX_HEADER)
        st = kiln_error(KILN_ERR_FORMAT, "%s: header length %llu is larger than the %llu-byte limit", path,
                        (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
    if (!st) {
        f->data = b + 8 + hlen;
        f->data_size = size - 8 - hlen;
        kiln_json *root = NULL;
        st = kiln_json_parse((const char *)b + 8, (size_t)hlen, &root);
        if (st) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", kiln_last_error());
            st = kiln_error(st == KILN_ERR_OOM ? KILN_ERR_OOM : KILN_ERR_FORMAT,
                            "%s: header (at byte 8) is not valid JSON: %s", path, msg);
        } else {
            st = parse_header(im, root);
            kiln_json_free(root);
        }
    }
    if (!st && !data_aligned(f)) st = copy_data_aligned(im);
    if (st) {
        st_destroy(im);
        return st;
    }
    if (f->data_size == 0) {
        /* nothing to point into: drop the mapping, keep data valid for empty tensors */
        static const uint8_t empty[8];
        munmap(f->map, f->map_size);
        f->map = NULL;
        f->map_size = 0;
        f->data = empty;
    }
    *out = f;
    return KILN_OK;
}

/* ---- writing ---- */

typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} strbuf;

static void sb_put(strbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->cap - b->n < n + 1) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->n < n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void sb_puts(strbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

/* JSON string with the escapes RFC 8259 requires; UTF-8 passes through. */
static void sb_json_str(strbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    const char *run = s;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        sb_put(b, run, (size_t)(s - run));
        char esc[8];
        switch (c) {
        case '"': sb_puts(b, "\\\""); break;
        case '\\': sb_puts(b, "\\\\"); break;
        case '\n': sb_puts(b, "\\n"); break;
        case '\r': sb_puts(b, "\\r"); break;
        case '\t': sb_puts(b, "\\t"); break;
        case '\b': sb_puts(b, "\\b"); break;
        case '\f': sb_puts(b, "\\f"); break;
        default: snprintf(esc, sizeof esc, "\\u%04x", c); sb_puts(b, esc); break;
        }
        run = s + 1;
    }
    sb_put(b, run, (size_t)(s - run));
    sb_put(b, "\"", 1);
}

/* Checks every argument before the file system is touched, and fills nbytes[i]
 * with item i's data size. */
static kiln_status save_validate(const char *path, int n, const kiln_st_item *items, int n_meta,
                                 const char *const *meta_keys, const char *const *meta_values, uint64_t *nbytes)
{
    const char **names = malloc(((size_t)n + (size_t)n_meta + 1) * sizeof *names);
    size_t mask = 0;
    int *slots = slots_new(n > n_meta ? n : n_meta, &mask);
    kiln_status st = KILN_OK;
    if (!names || !slots) {
        st = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
        goto done;
    }
    for (int i = 0; i < n; i++) {
        const kiln_st_item *it = &items[i];
        const char *name = it->name;
        if (!name) { st = kiln_error(KILN_ERR_ARG, "%s: tensor %d has no name", path, i); goto done; }
        if (strcmp(name, "__metadata__") == 0) {
            st = kiln_error(KILN_ERR_ARG, "%s: '__metadata__' is reserved and cannot name a tensor", path);
            goto done;
        }
        if (!kiln_unicode_utf8_valid(name)) {
            st = kiln_error(KILN_ERR_ARG, "%s: tensor name %d is not valid UTF-8", path, i);
            goto done;
        }
        if ((unsigned)it->dtype >= KILN_DTYPE_COUNT) {
            st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s': invalid dtype %d", path, name, (int)it->dtype);
            goto done;
        }
        if (!st_dtype_names[it->dtype]) {
            st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s': dtype %s has no safetensors form (save it as GGUF)", path,
                            name, kiln_dtype_name(it->dtype));
            goto done;
        }
        if (it->ndim < 0 || it->ndim > KILN_ST_MAX_DIMS || (it->ndim > 0 && !it->shape)) {
            st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s': invalid ndim %d (0..%d)", path, name, it->ndim, KILN_ST_MAX_DIMS);
            goto done;
        }
        uint64_t numel = 1;
        for (int d = 0; d < it->ndim; d++) {
            int64_t dim = it->shape[d];
            if (dim < 0 || (dim && numel > UINT64_MAX / 16 / (uint64_t)dim)) {
                st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s': invalid shape %s", path, name,
                                shape_str(it->shape, it->ndim, (char[160]){0}, 160));
                goto done;
            }
            numel *= (uint64_t)dim;
        }
        nbytes[i] = numel * kiln_dtype_size(it->dtype);
        if (nbytes[i] && !it->data) {
            st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s': data is NULL", path, name);
            goto done;
        }
        names[i] = name;
        int prev = slots_insert(slots, mask, names, i);
        if (prev >= 0) { st = kiln_error(KILN_ERR_ARG, "%s: tensor name '%s' appears twice", path, name); goto done; }
    }
    memset(slots, 0xff, (mask + 1) * sizeof *slots);
    for (int i = 0; i < n_meta; i++) {
        if (!meta_keys[i] || !meta_values[i]) {
            st = kiln_error(KILN_ERR_ARG, "%s: metadata entry %d is NULL", path, i);
            goto done;
        }
        if (!kiln_unicode_utf8_valid(meta_keys[i]) || !kiln_unicode_utf8_valid(meta_values[i])) {
            st = kiln_error(KILN_ERR_ARG, "%s: metadata entry '%s' is not valid UTF-8", path, meta_keys[i]);
            goto done;
        }
        names[i] = meta_keys[i];
        if (slots_insert(slots, mask, names, i) >= 0) {
            st = kiln_error(KILN_ERR_ARG, "%s: metadata key '%s' appears twice", path, meta_keys[i]);
            goto done;
        }
    }
done:
    free(names);
    free(slots);
    return st;
}

/* Lays out the data and writes the JSON header into hb; order receives the items
 * in data order. 8-byte elements come first, then 4, 2, 1 (input order within a
 * size), so every tensor is naturally aligned with no gaps (the reference reader
 * rejects gaps). The header is padded with spaces to a multiple of 8. */
static kiln_status save_header(const char *path, int n, const kiln_st_item *items, int n_meta,
                               const char *const *meta_keys, const char *const *meta_values,
                               const uint64_t *nbytes, int *order, strbuf *hb)
{
    int k = 0;
    for (size_t es = 8; es >= 1; es /= 2)
        for (int i = 0; i < n; i++)
            if (kiln_dtype_size(items[i].dtype) == es) order[k++] = i;
    sb_puts(hb, "{");
    if (n_meta > 0) {
        sb_puts(hb, "\"__metadata__\":{");
        for (int i = 0; i < n_meta; i++) {
            if (i) sb_puts(hb, ",");
            sb_json_str(hb, meta_keys[i]);
            sb_puts(hb, ":");
            sb_json_str(hb, meta_values[i]);
        }
        sb_puts(hb, "}");
    }
    uint64_t at = 0;
    for (int j = 0; j < n; j++) {
        const kiln_st_item *it = &items[order[j]];
        char num[64];
        if (j || n_meta > 0) sb_puts(hb, ",");
        sb_json_str(hb, it->name);
        sb_puts(hb, ":{\"dtype\":\"");
        sb_puts(hb, st_dtype_names[it->dtype]);
        sb_puts(hb, "\",\"shape\":[");
        for (int d = 0; d < it->ndim; d++) {
            snprintf(num, sizeof num, d ? ",%lld" : "%lld", (long long)it->shape[d]);
            sb_puts(hb, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)at,
                 (unsigned long long)(at + nbytes[order[j]]));
        sb_puts(hb, num);
        at += nbytes[order[j]];
    }
    sb_puts(hb, "}");
    while (hb->n % 8) sb_puts(hb, " ");
    if (hb->oom) return kiln_error(KILN_ERR_OOM, "%s: out of memory for the header", path);
    return KILN_OK;
}

/* Writes the file through an atomic save: the header's length (little-endian
 * u64), the header, then the data in order. */
static kiln_status save_write(const char *path, const strbuf *hb, int n, const kiln_st_item *items,
                              const uint64_t *nbytes, const int *order)
{
    kiln_atomic_file out;
    kiln_status st = kiln_atomic_file_open_output(&out, path);
    if (st) return st;
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hb->n >> (8 * i));
    st = kiln_atomic_file_write(&out, len8, 8);
    if (!st) st = kiln_atomic_file_write(&out, hb->p, hb->n);
    for (int j = 0; j < n && !st; j++)
        if (nbytes[order[j]]) st = kiln_atomic_file_write(&out, items[order[j]].data, (size_t)nbytes[order[j]]);
    if (st) {
        kiln_atomic_file_abort(&out);
        return st;
    }
    return kiln_atomic_file_commit(&out);
}

kiln_status kiln_st_save(const char *path, int n, const kiln_st_item *items, int n_meta,
                         const char *const *meta_keys, const char *const *meta_values)
{
    if (!path) return kiln_error(KILN_ERR_ARG, "kiln_st_save: path is NULL");
    if (n < 0 || (n > 0 && !items))
        return kiln_error(KILN_ERR_ARG, "%s: invalid tensor list (n = %d)", path, n);
    if (n_meta < 0 || (n_meta > 0 && (!meta_keys || !meta_values)))
        return kiln_error(KILN_ERR_ARG, "%s: invalid metadata list (n_meta = %d)", path, n_meta);

    uint64_t *nbytes = malloc(((size_t)n + 1) * sizeof *nbytes);
    int *order = malloc(((size_t)n + 1) * sizeof *order);
    strbuf hb = {0};
    kiln_status st;
    if (!nbytes || !order) st = kiln_error(KILN_ERR_OOM, "%s: out of memory", path);
    else if (!(st = save_validate(path, n, items, n_meta, meta_keys, meta_values, nbytes)) &&
             !(st = save_header(path, n, items, n_meta, meta_keys, meta_values, nbytes, order, &hb)))
        st = save_write(path, &hb, n, items, nbytes, order);
    free(hb.p);
    free(nbytes);
    free(order);
    return st;
}
