/* gguf.c - GGUF v2/v3 reading (mmap, zero copy, into a kiln_st_file so models, LoRA
 * and the bindings treat it as any weight file) and writing. The reader walks the
 * header with a cursor that checks the bytes left before every read, and bounds
 * each declared count by what the rest of the file could hold before allocating. */
#define _POSIX_C_SOURCE 200809L
#include "gguf.h"
#include "atomic_file.h"
#include "file_stamp.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGN 32
#define GGUF_MAX_DIMS 4

enum { T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STRING, T_ARRAY, T_U64, T_I64, T_F64, T_COUNT };
static const unsigned scalar_size[T_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

/* ggml's type numbers: names for messages, and the kiln dtype where there is one */
static const struct { int id; const char *name; int dt; } ggml_types[] = {
    {0, "f32", KILN_F32}, {1, "f16", KILN_F16}, {2, "q4_0", KILN_Q4_0}, {3, "q4_1", KILN_Q4_1},
    {6, "q5_0", KILN_Q5_0}, {7, "q5_1", KILN_Q5_1}, {8, "q8_0", KILN_Q8_0}, {9, "q8_1", -1},
    {10, "q2_K", -1}, {11, "q3_K", -1}, {12, "q4_K", KILN_Q4_K}, {13, "q5_K", KILN_Q5_K},
    {14, "q6_K", KILN_Q6_K}, {15, "q8_K", -1}, {16, "iq2_xxs", -1}, {17, "iq2_xs", -1},
    {18, "iq3_xxs", -1}, {19, "iq1_s", -1}, {20, "iq4_nl", -1}, {21, "iq3_s", -1}, {22, "iq2_s", -1},
    {23, "iq4_xs", -1}, {24, "i8", -1}, {25, "i16", -1}, {26, "i32", KILN_I32}, {27, "i64", KILN_I64},
    {28, "f64", -1}, {29, "iq1_m", -1}, {30, "bf16", KILN_BF16}, {34, "tq1_0", -1}, {35, "tq2_0", -1},
    {39, "mxfp4", -1},
};

int kiln_gguf_type_of(kiln_dtype dt)
{
    for (size_t i = 0; i < sizeof ggml_types / sizeof ggml_types[0]; i++)
        if (ggml_types[i].dt == (int)dt) return ggml_types[i].id;
    return -1;
}

/* ---- reading ---- */

typedef struct {
    const char *path;
    const uint8_t *b;
    uint64_t size, pos;
    char *str;             /* growing block of names and metadata text */
    size_t str_n, str_cap;
} cursor;

static kiln_status truncated(const cursor *c, const char *what)
{
    return kiln_error(KILN_ERR_FORMAT, "%s: truncated header: %s at byte %" PRIu64 " runs past the end (%" PRIu64 " bytes)",
                      c->path, what, c->pos, c->size);
}

static kiln_status rd(cursor *c, void *out, uint64_t n, const char *what)
{
    if (c->size - c->pos < n) return truncated(c, what);
    memcpy(out, c->b + c->pos, (size_t)n); /* little-endian hosts only, as ggml */
    c->pos += n;
    return KILN_OK;
}

static kiln_status rd_u32(cursor *c, uint32_t *v, const char *what) { return rd(c, v, 4, what); }
static kiln_status rd_u64(cursor *c, uint64_t *v, const char *what) { return rd(c, v, 8, what); }

/* Appends n bytes and a NUL to the string block; returns the offset or -1. */
static int64_t str_add(cursor *c, const char *s, size_t n)
{
    if (c->str_cap - c->str_n < n + 1) {
        size_t cap = c->str_cap ? c->str_cap : 4096;
        while (cap - c->str_n < n + 1) cap *= 2;
        char *p = realloc(c->str, cap);
        if (!p) return -1;
        c->str = p;
        c->str_cap = cap;
    }
    memcpy(c->str + c->str_n, s, n);
    c->str[c->str_n + n] = 0;
    int64_t off = (int64_t)c->str_n;
    c->str_n += n + 1;
    return off;
}

/* A GGUF string (u64 length, bytes) into the block; *off receives its offset. */
static kiln_status rd_str(cursor *c, int64_t *off, const char *what)
{
    uint64_t n;
    kiln_status st = rd_u64(c, &n, what);
    if (st) return st;
    if (n > c->size - c->pos) {
        return kiln_error(KILN_ERR_FORMAT, "%s: %s at byte %" PRIu64 " declares %" PRIu64 " bytes, past the end of the file",
                          c->path, what, c->pos - 8, n);
    }
    const char *s = (const char *)c->b + c->pos;
    size_t len = strnlen(s, (size_t)n); /* text after an embedded NUL is dropped */
    c->pos += n;
    if (off && (*off = str_add(c, s, len)) < 0) return kiln_error(KILN_ERR_OOM, "%s: out of host memory", c->path);
    return KILN_OK;
}

/* One metadata value as text (NULL off: skipped). */
static kiln_status rd_value(cursor *c, uint32_t type, int64_t *off, const char *key, uint64_t *u)
{
    char buf[64];
    kiln_status st;
    if (type == T_STRING) return rd_str(c, off, key);
    if (type == T_ARRAY) {
        uint32_t et;
        uint64_t n;
        if ((st = rd_u32(c, &et, key)) || (st = rd_u64(c, &n, key))) return st;
        if (et >= T_COUNT || et == T_ARRAY)
            return kiln_error(KILN_ERR_FORMAT, "%s: metadata '%s': array of unknown type %u", c->path, key, et);
        uint64_t min = et == T_STRING ? 8 : scalar_size[et];
        if (n > (c->size - c->pos) / min)
            return kiln_error(KILN_ERR_FORMAT, "%s: metadata '%s': array of %" PRIu64 " items cannot fit in the file",
                              c->path, key, n);
        if (et == T_STRING) {
            for (uint64_t i = 0; i < n; i++)
                if ((st = rd_str(c, NULL, key))) return st;
        } else {
            c->pos += n * min;
        }
        snprintf(buf, sizeof buf, "[array of %" PRIu64 "]", n);
    } else {
        if (type >= T_COUNT) return kiln_error(KILN_ERR_FORMAT, "%s: metadata '%s': unknown value type %u", c->path, key, type);
        uint8_t raw[8] = {0};
        if ((st = rd(c, raw, scalar_size[type], key))) return st;
        int64_t i = 0;
        uint64_t uu = 0;
        double d = 0;
        switch (type) {
        case T_U8: uu = raw[0]; break;
        case T_I8: i = (int8_t)raw[0]; break;
        case T_U16: { uint16_t v; memcpy(&v, raw, 2); uu = v; } break;
        case T_I16: { int16_t v; memcpy(&v, raw, 2); i = v; } break;
        case T_U32: { uint32_t v; memcpy(&v, raw, 4); uu = v; } break;
        case T_I32: { int32_t v; memcpy(&v, raw, 4); i = v; } break;
        case T_U64: memcpy(&uu, raw, 8); break;
        case T_I64: memcpy(&i, raw, 8); break;
        case T_F32: { float v; memcpy(&v, raw, 4); d = v; } break;
        case T_F64: memcpy(&d, raw, 8); break;
        default: break;
        }
        if (type == T_BOOL) snprintf(buf, sizeof buf, "%s", raw[0] ? "true" : "false");
        else if (type == T_F32 || type == T_F64) snprintf(buf, sizeof buf, "%.17g", d);
        else if (type == T_U8 || type == T_U16 || type == T_U32 || type == T_U64) snprintf(buf, sizeof buf, "%" PRIu64, uu);
        else snprintf(buf, sizeof buf, "%" PRId64, i);
        if (u) *u = type == T_I8 || type == T_I16 || type == T_I32 || type == T_I64 ? (uint64_t)i : uu;
    }
    if (off && (*off = str_add(c, buf, strlen(buf))) < 0) return kiln_error(KILN_ERR_OOM, "%s: out of host memory", c->path);
    return KILN_OK;
}

/* Parses the header of a GGUF image of size bytes into *f (path, map set by the
 * caller); on success the names and texts live in c->str. */
static kiln_status parse(cursor *c, kiln_st_file *f)
{
    kiln_status st;
    char magic[4];
    uint32_t version;
    uint64_t n_tensors, n_kv;
    if ((st = rd(c, magic, 4, "magic"))) return st;
    if (memcmp(magic, GGUF_MAGIC, 4) != 0) return kiln_error(KILN_ERR_FORMAT, "%s: not a GGUF file (no GGUF magic)", c->path);
    if ((st = rd_u32(c, &version, "version"))) return st;
    if (version != 2 && version != 3)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: GGUF version %u (kiln reads versions 2 and 3)", c->path, version);
    if ((st = rd_u64(c, &n_tensors, "tensor count")) || (st = rd_u64(c, &n_kv, "metadata count"))) return st;
    /* smallest key/value: 8-byte length, 4-byte type, 1-byte value; smallest tensor
     * info: 8 + 4 + 4 + 8 */
    if (n_kv > (c->size - c->pos) / 13 || n_kv > (uint64_t)INT32_MAX)
        return kiln_error(KILN_ERR_FORMAT, "%s: %" PRIu64 " metadata entries cannot fit in the file", c->path, n_kv);
    if (n_tensors > (c->size - c->pos) / 24 || n_tensors > (uint64_t)INT32_MAX / 2)
        return kiln_error(KILN_ERR_FORMAT, "%s: %" PRIu64 " tensors cannot fit in the file", c->path, n_tensors);
    int64_t *koff = malloc(sizeof *koff * (size_t)(n_kv ? n_kv : 1)), *voff = malloc(sizeof *voff * (size_t)(n_kv ? n_kv : 1));
    int64_t *noff = malloc(sizeof *noff * (size_t)(n_tensors ? n_tensors : 1));
    f->entries = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof *f->entries);
    if (!koff || !voff || !noff || !f->entries) {
        st = kiln_error(KILN_ERR_OOM, "%s: out of host memory", c->path);
        goto done;
    }
    uint64_t align = GGUF_DEFAULT_ALIGN;
    for (uint64_t i = 0; i < n_kv && !st; i++) {
        uint32_t type;
        if ((st = rd_str(c, &koff[i], "metadata key")) || (st = rd_u32(c, &type, "metadata type"))) break;
        uint64_t u = 0;
        const char *key = c->str + koff[i];
        char keycopy[128];
        snprintf(keycopy, sizeof keycopy, "%s", key); /* c->str may move */
        if ((st = rd_value(c, type, &voff[i], keycopy, &u))) break;
        if (strcmp(keycopy, "general.alignment") == 0) {
            if (type != T_U32 || u == 0 || (u & (u - 1)) || u > 65536) {
                st = kiln_error(KILN_ERR_FORMAT, "%s: general.alignment must be a u32 power of two up to 65536", c->path);
                break;
            }
            align = u;
        }
    }
    f->n_meta = (int)n_kv;
    for (uint64_t i = 0; i < n_tensors && !st; i++) {
        kiln_st_entry *e = &f->entries[i];
        uint32_t nd, type;
        uint64_t ne[GGUF_MAX_DIMS];
        if ((st = rd_str(c, &noff[i], "tensor name"))) break;
        const char *name = c->str + noff[i];
        if ((st = rd_u32(c, &nd, "tensor dimensions"))) break;
        if (nd > GGUF_MAX_DIMS) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': %u dimensions (at most %d)", c->path, name, nd, GGUF_MAX_DIMS);
            break;
        }
        uint64_t numel = 1;
        for (uint32_t d = 0; d < nd && !st; d++) {
            if ((st = rd_u64(c, &ne[d], "tensor shape"))) break;
            if (ne[d] > ((uint64_t)1 << 40) || (ne[d] && numel > ((uint64_t)1 << 40) / ne[d]))
                st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': shape too large", c->path, name);
            numel *= ne[d];
        }
        if (st || (st = rd_u32(c, &type, "tensor type")) || (st = rd_u64(c, &e->begin, "tensor offset"))) break;
        int dt = -2;
        const char *tname = NULL;
        for (size_t k = 0; k < sizeof ggml_types / sizeof ggml_types[0]; k++)
            if (ggml_types[k].id == (int)type) { dt = ggml_types[k].dt; tname = ggml_types[k].name; }
        if (dt == -2) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': unknown GGUF type %u", c->path, name, type);
            break;
        }
        if (dt < 0) {
            st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: tensor '%s': GGUF type %s is not supported (kiln reads f32, f16, bf16, "
                            "q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K)", c->path, name, tname);
            break;
        }
        e->dtype = (kiln_dtype)dt;
        e->ndim = (int)nd;
        for (uint32_t d = 0; d < nd; d++) e->shape[nd - 1 - d] = (int64_t)ne[d];
        int blk = kiln_dtype_block(e->dtype);
        if (blk > 1 && (nd == 0 || ne[0] % (uint64_t)blk)) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': %s rows of %" PRIu64 " are not whole blocks of %d", c->path,
                            name, tname, nd ? ne[0] : 1, blk);
            break;
        }
        e->end = kiln_dtype_nbytes(e->dtype, (int64_t)numel); /* the size, for now */
        if (e->begin % align) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': offset %" PRIu64 " is not a multiple of the alignment %" PRIu64,
                            c->path, name, e->begin, align);
            break;
        }
        f->n = (int)i + 1;
    }
    if (st) goto done;
    uint64_t data_start = (c->pos + align - 1) / align * align;
    if (data_start > c->size) data_start = c->size;
    f->data = c->b + data_start;
    f->data_size = c->size - data_start;
    for (int i = 0; i < f->n; i++) {
        kiln_st_entry *e = &f->entries[i];
        uint64_t nbytes = e->end;
        if (e->begin > f->data_size || nbytes > f->data_size - e->begin) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tensor '%s': data truncated (bytes %" PRIu64 "..%" PRIu64
                            " of a %" PRIu64 "-byte data section)", c->path, c->str + noff[i], e->begin, e->begin + nbytes,
                            f->data_size);
            goto done;
        }
        e->end = e->begin + nbytes;
    }
    /* names and texts are offsets into c->str until it stops moving */
    f->meta_keys = malloc(sizeof *f->meta_keys * (size_t)(n_kv ? n_kv : 1));
    f->meta_values = malloc(sizeof *f->meta_values * (size_t)(n_kv ? n_kv : 1));
    if (!f->meta_keys || !f->meta_values) {
        st = kiln_error(KILN_ERR_OOM, "%s: out of host memory", c->path);
        goto done;
    }
    for (uint64_t i = 0; i < n_kv; i++) {
        f->meta_keys[i] = c->str + koff[i];
        f->meta_values[i] = c->str + voff[i];
    }
    for (int i = 0; i < f->n; i++) f->entries[i].name = c->str + noff[i];
done:
    free(koff);
    free(voff);
    free(noff);
    return st;
}

int kiln_gguf_probe(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char m[4];
    ssize_t r = read(fd, m, 4);
    close(fd);
    return r == 4 && memcmp(m, GGUF_MAGIC, 4) == 0;
}

kiln_status kiln_gguf_open(const char *path, kiln_st_file **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "kiln_gguf_open: out is NULL");
    *out = NULL;
    if (!path) return kiln_error(KILN_ERR_ARG, "kiln_gguf_open: path is NULL");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kiln_error(KILN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    kiln_file_stamp stamp;
    kiln_status st = KILN_OK;
    if (fstat(fd, &sb) != 0) st = kiln_error(KILN_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode)) st = kiln_error(KILN_ERR_IO, "%s: not a regular file", path);
    else if (sb.st_size < 24) st = kiln_error(KILN_ERR_FORMAT, "%s: %lld bytes, too small for a GGUF header", path, (long long)sb.st_size);
    else if ((uint64_t)sb.st_size > SIZE_MAX) st = kiln_error(KILN_ERR_FORMAT, "%s: file too large to map", path);
    else st = kiln_file_stamp_take(fd, path, &stamp);
    if (st) { close(fd); return st; }
    size_t size = (size_t)sb.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) return kiln_error(KILN_ERR_IO, "%s: cannot map %zu bytes: %s", path, size, strerror(map_errno));
    kiln_st_file f;
    memset(&f, 0, sizeof f);
    f.map = map;
    f.map_size = size;
    f.stamp = stamp;
    f.path = malloc(strlen(path) + 1);
    cursor c = {path, map, size, 0, NULL, 0, 0};
    st = f.path ? parse(&c, &f) : kiln_error(KILN_ERR_OOM, "%s: out of host memory", path);
    if (f.path) strcpy(f.path, path);
    if (st) {
        munmap(map, size);
        free(f.path);
        free(f.entries);
        free(f.meta_keys);
        free(f.meta_values);
        free(c.str);
        return st;
    }
    return kiln_st_wrap(&f, c.str, out);
}

kiln_status kiln_weights_open(const char *path, kiln_st_file **out)
{
    return path && kiln_gguf_probe(path) ? kiln_gguf_open(path, out) : kiln_st_open(path, out);
}

/* ---- writing ---- */

typedef struct {
    kiln_atomic_file af;
    kiln_status st;
} writer;

static void w_bytes(writer *w, const void *p, size_t n)
{
    if (!w->st) w->st = kiln_atomic_file_write(&w->af, p, n);
}
static void w_u32(writer *w, uint32_t v) { w_bytes(w, &v, 4); }
static void w_u64(writer *w, uint64_t v) { w_bytes(w, &v, 8); }
static void w_str(writer *w, const char *s)
{
    w_u64(w, strlen(s));
    w_bytes(w, s, strlen(s));
}

kiln_status kiln_gguf_save(const char *path, int n, const kiln_st_item *items,
                           int n_meta, const char *const *meta_keys, const char *const *meta_values)
{
    if (!path) return kiln_error(KILN_ERR_ARG, "kiln_gguf_save: path is NULL");
    if (n < 0 || n_meta < 0 || (n && !items) || (n_meta && (!meta_keys || !meta_values)))
        return kiln_error(KILN_ERR_ARG, "%s: bad tensor or metadata list", path);
    uint64_t *size = malloc(sizeof *size * (size_t)(n ? n : 1));
    if (!size) return kiln_error(KILN_ERR_OOM, "%s: out of host memory", path);
    kiln_status st = KILN_OK;
    for (int i = 0; i < n && !st; i++) {
        const kiln_st_item *it = &items[i];
        if (!it->name) { st = kiln_error(KILN_ERR_ARG, "%s: tensor %d has no name", path, i + 1); break; }
        if (kiln_gguf_type_of(it->dtype) < 0) {
            st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s': dtype %s has no GGUF type", path, it->name, kiln_dtype_name(it->dtype));
            break;
        }
        if (it->ndim < 0 || it->ndim > GGUF_MAX_DIMS) {
            st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s': %d dimensions (GGUF holds at most %d)", path, it->name, it->ndim, GGUF_MAX_DIMS);
            break;
        }
        int64_t numel = 1;
        for (int d = 0; d < it->ndim; d++) numel *= it->shape[d];
        int blk = kiln_dtype_block(it->dtype);
        if (blk > 1 && (it->ndim == 0 || it->shape[it->ndim - 1] % blk)) {
            st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s': %s needs the last dimension a multiple of %d", path, it->name,
                            kiln_dtype_name(it->dtype), blk);
            break;
        }
        size[i] = kiln_dtype_nbytes(it->dtype, numel);
        for (int j = 0; j < i; j++)
            if (strcmp(items[j].name, it->name) == 0) { st = kiln_error(KILN_ERR_ARG, "%s: tensor '%s' given twice", path, it->name); break; }
    }
    if (st) { free(size); return st; }
    writer w = {{0}, KILN_OK};
    if ((st = kiln_atomic_file_open_output(&w.af, path))) { free(size); return st; }
    uint64_t pos = 0;
    w_bytes(&w, GGUF_MAGIC, 4);
    w_u32(&w, 3);
    w_u64(&w, (uint64_t)n);
    w_u64(&w, (uint64_t)n_meta);
    pos = 24;
    for (int i = 0; i < n_meta; i++) {
        w_str(&w, meta_keys[i]);
        w_u32(&w, T_STRING);
        w_str(&w, meta_values[i]);
        pos += 8 + strlen(meta_keys[i]) + 4 + 8 + strlen(meta_values[i]);
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const kiln_st_item *it = &items[i];
        w_str(&w, it->name);
        w_u32(&w, (uint32_t)it->ndim);
        for (int d = it->ndim - 1; d >= 0; d--) w_u64(&w, (uint64_t)it->shape[d]);
        w_u32(&w, (uint32_t)kiln_gguf_type_of(it->dtype));
        w_u64(&w, off);
        pos += 8 + strlen(it->name) + 4 + 8 * (uint64_t)it->ndim + 4 + 8;
        off += (size[i] + GGUF_DEFAULT_ALIGN - 1) / GGUF_DEFAULT_ALIGN * GGUF_DEFAULT_ALIGN;
    }
    static const char zeros[GGUF_DEFAULT_ALIGN];
    w_bytes(&w, zeros, (size_t)((GGUF_DEFAULT_ALIGN - pos % GGUF_DEFAULT_ALIGN) % GGUF_DEFAULT_ALIGN));
    for (int i = 0; i < n; i++) {
        w_bytes(&w, items[i].data, (size_t)size[i]);
        w_bytes(&w, zeros, (size_t)((GGUF_DEFAULT_ALIGN - size[i] % GGUF_DEFAULT_ALIGN) % GGUF_DEFAULT_ALIGN));
    }
    free(size);
    if (w.st) {
        kiln_atomic_file_abort(&w.af);
        return w.st;
    }
    return kiln_atomic_file_commit(&w.af);
}
