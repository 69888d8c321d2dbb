/* l_io.c - file formats from Lua: kiln.load_safetensors / save_safetensors and
 * kiln.load_gguf / save_gguf (zero-copy mmap views on the CPU), kiln.load_png /
 * save_png. */
#include "l_tensor.h"
#include "l_parts.h"
#include "../runtime/png_io.h"
#include "../runtime/safetensors.h"
#include "../runtime/gguf.h"
#include "../runtime/sha256.h"

#include <stdlib.h>
#include <string.h>

/* A storage over a region of a mapped safetensors file keeps the file mapped. */
static void release_mapped(kiln_storage *s)
{
    kiln_st_release(s->ctx);
}

/* kiln.load_safetensors(path) -> {name = tensor}, metadata; kiln.load_gguf the same
 * for a GGUF file (the opener differs, the description is one) */
static int load_weights(lua_State *L, kiln_status (*opener)(const char *, kiln_st_file **))
{
    const char *path = luaL_checkstring(L, 1);
    kiln_st_file *f;
    L_TRY(L, opener(path, &f));
    /* the file handle goes into a to-be-closed slot so an error below releases it */
    lua_createtable(L, 0, f->n);
    kiln_status st = KILN_OK;
    for (int i = 0; i < f->n && !st; i++) {
        const kiln_st_entry *e = &f->entries[i];
        size_t nbytes = (size_t)(e->end - e->begin);
        kiln_st_retain(f);
        kiln_storage *s = kiln_storage_wrap(kiln_device_cpu(), (void *)kiln_st_data(f, i), nbytes, release_mapped, f);
        if (!s) { kiln_st_release(f); st = kiln_error(KILN_ERR_OOM, "%s: out of host memory", path); break; }
        kiln_storage_set_owner(s, "mapped file");
        kiln_tensor *t = kiln_tensor_from_storage(s, 0, e->dtype, e->ndim, e->shape, NULL);
        kiln_storage_release(s);
        if (!t) { st = kiln_error(KILN_ERR_OOM, "%s: out of host memory", path); break; }
        l_push_tensor(L, t);
        lua_setfield(L, -2, e->name);
    }
    lua_createtable(L, 0, f->n_meta);
    for (int i = 0; i < f->n_meta; i++) {
        lua_pushstring(L, f->meta_values[i]);
        lua_setfield(L, -2, f->meta_keys[i]);
    }
    kiln_st_release(f);
    if (st) l_raise(L, st);
    return 2;
}

static int l_load_safetensors(lua_State *L) { return load_weights(L, kiln_st_open); }
static int l_load_gguf(lua_State *L) { return load_weights(L, kiln_gguf_open); }

/* What a save writes: host copies of a Lua table of name -> tensor (each in the dtype
 * dtype_of picks), anchored in a Lua table left on the stack so that an error frees
 * them, and the metadata table's strings. `what` names the function in errors. */
typedef struct {
    int n, n_meta;
    kiln_st_item *items;
    const char **mk, **mv;
} save_set;

typedef kiln_dtype (*save_dtype_fn)(const kiln_tensor *t, void *ud);

static save_set collect_save_set(lua_State *L, const char *what, int tensors, int meta, save_dtype_fn dtype_of,
                                 void *ud)
{
    save_set s = {0, 0, NULL, NULL, NULL};
    int has_meta = !lua_isnoneornil(L, meta);
    lua_pushnil(L);
    while (lua_next(L, tensors)) { s.n++; lua_pop(L, 1); }
    if (has_meta) {
        lua_pushnil(L);
        while (lua_next(L, meta)) { s.n_meta++; lua_pop(L, 1); }
    }
    lua_createtable(L, s.n, 0);
    int keep = lua_gettop(L);
    s.items = lua_newuserdatauv(L, sizeof(kiln_st_item) * (size_t)(s.n ? s.n : 1), 0);
    s.mk = lua_newuserdatauv(L, sizeof(char *) * (size_t)(s.n_meta ? s.n_meta : 1), 0);
    s.mv = lua_newuserdatauv(L, sizeof(char *) * (size_t)(s.n_meta ? s.n_meta : 1), 0);
    int i = 0;
    lua_pushnil(L);
    while (lua_next(L, tensors)) {
        if (lua_type(L, -2) != LUA_TSTRING)
            luaL_error(L, "%s: tensor names must be strings (got a %s key)", what, luaL_typename(L, -2));
        const char *name = lua_tostring(L, -2);
        kiln_tensor *t = l_test_tensor(L, -1);
        if (!t) luaL_error(L, "%s: '%s' is not a live tensor (a %s)", what, name, luaL_typename(L, -1));
        kiln_tensor *c;
        L_TRY(L, kiln_tensor_to(t, kiln_device_cpu(), dtype_of(t, ud), &c));
        l_push_tensor(L, c);
        lua_rawseti(L, keep, i + 1);
        s.items[i] = (kiln_st_item){.name = name, .dtype = c->dtype, .ndim = c->ndim, .shape = c->shape,
                                    .data = kiln_tensor_data(c)};
        i++;
        lua_pop(L, 1);
    }
    i = 0;
    if (has_meta) {
        lua_pushnil(L);
        while (lua_next(L, meta)) {
            if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING)
                luaL_error(L, "%s: metadata must map strings to strings", what);
            s.mk[i] = lua_tostring(L, -2);
            s.mv[i] = lua_tostring(L, -1);
            i++;
            lua_pop(L, 1);
        }
    }
    return s;
}

/* save_gguf: float tensors whose rows hold whole blocks in the asked type, fp8 as f16,
 * what GGUF cannot hold as f32, the rest as they are */
static kiln_dtype gguf_dtype_of(const kiln_tensor *t, void *ud)
{
    int qtype = *(const int *)ud;
    int blk = qtype >= 0 ? kiln_dtype_block((kiln_dtype)qtype) : 1;
    if (qtype >= 0 && kiln_dtype_is_float(t->dtype) && t->ndim >= 2 && t->shape[t->ndim - 1] % blk == 0)
        return (kiln_dtype)qtype;
    if (t->dtype == KILN_F8_E4M3FN || t->dtype == KILN_F8_E5M2) return KILN_F16;
    if (kiln_gguf_type_of(t->dtype) < 0) return KILN_F32;
    return t->dtype;
}

static kiln_dtype same_dtype(const kiln_tensor *t, void *ud)
{
    (void)ud;
    return t->dtype;
}

/* kiln.save_gguf(path, {name = tensor} [, {type = "q8_0", metadata = {k = v}}]):
 * with a type, every tensor of 2 or more dimensions whose last dimension holds whole
 * blocks is quantized (ggml's reference quantizers); the others (biases, norms, 3x3
 * kernels) keep f32/f16/bf16, fp8 widening to f16 (exact). */
static int l_save_gguf(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    lua_settop(L, 3);
    int qtype = -1;
    if (!lua_isnil(L, 3)) {
        lua_getfield(L, 3, "type");
        if (!lua_isnil(L, -1)) {
            const char *tn = luaL_checkstring(L, -1);
            qtype = kiln_dtype_from_name(tn);
            if (qtype < 0 || kiln_gguf_type_of((kiln_dtype)qtype) < 0 || !kiln_dtype_is_float((kiln_dtype)qtype))
                return luaL_error(L, "save_gguf: type '%s' (expected one of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, "
                                  "q4_k, q5_k, q6_k)", tn);
        }
        lua_pop(L, 1);
        lua_getfield(L, 3, "metadata");
    } else {
        lua_pushnil(L);
    }
    int meta = lua_gettop(L); /* 4 */
    if (!lua_isnil(L, meta)) luaL_checktype(L, meta, LUA_TTABLE);
    save_set set = collect_save_set(L, "save_gguf", 2, meta, gguf_dtype_of, &qtype);
    L_TRY(L, kiln_gguf_save(path, set.n, set.items, set.n_meta, set.mk, set.mv));
    return 0;
}

/* kiln.save_safetensors(path, {name = tensor}, [metadata]) */
static int l_save_safetensors(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    lua_settop(L, 3); /* the work table below must not land on the metadata slot */
    save_set set = collect_save_set(L, "save_safetensors", 2, 3, same_dtype, NULL);
    L_TRY(L, kiln_st_save(path, set.n, set.items, set.n_meta, set.mk, set.mv));
    return 0;
}

/* kiln.load_png(path) -> f32 tensor [1, C, H, W] in [0, 1] */
static int l_load_png(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    float *px;
    int c, h, w;
    L_TRY(L, kiln_png_read(path, &px, &c, &h, &w));
    int64_t shape[4] = {1, c, h, w};
    kiln_tensor *t;
    kiln_status st = kiln_tensor_new(kiln_device_cpu(), KILN_F32, 4, shape, &t);
    if (st) { free(px); l_raise(L, st); }
    memcpy(kiln_tensor_data(t), px, sizeof(float) * (size_t)c * (size_t)h * (size_t)w);
    free(px);
    l_push_tensor(L, t);
    return 1;
}

/* The image and text chunks of save_png / encode_png: the tensor at index 1, the
 * options table at index opt; keys and values sorted by key, anchored on the stack.
 * Returns the picture as f32 on the cpu (the caller frees it). */
typedef struct {
    int c, h, w, n_text;
    const char **keys, **vals;
} png_args;

static kiln_tensor *check_png_args(lua_State *L, const char *fname, int opt, png_args *a)
{
    kiln_tensor *t = l_check_tensor(L, 1);
    char b[128];
    int ndim = t->ndim;
    if (!((ndim == 4 && t->shape[0] == 1) || ndim == 3) || t->shape[ndim - 3] < 1 || t->shape[ndim - 3] > 4)
        luaL_error(L, "%s: expected an image tensor [1, C, H, W] or [C, H, W] with C = 1..4, got %s", fname,
                   kiln_shape_str(t, b, sizeof b));
    a->c = (int)t->shape[ndim - 3], a->h = (int)t->shape[ndim - 2], a->w = (int)t->shape[ndim - 1];
    a->n_text = 0;
    a->keys = a->vals = NULL;
    if (lua_istable(L, opt) && lua_getfield(L, opt, "text") == LUA_TTABLE) {
        int ti = lua_gettop(L);
        int n_text = 0;
        lua_pushnil(L);
        while (lua_next(L, ti)) { n_text++; lua_pop(L, 1); }
        const char **keys = lua_newuserdatauv(L, sizeof(char *) * (size_t)(n_text + 1), 0);
        const char **vals = lua_newuserdatauv(L, sizeof(char *) * (size_t)(n_text + 1), 0);
        lua_newtable(L); /* anchors the converted strings */
        int ai = lua_gettop(L);
        int i = 0;
        lua_pushnil(L);
        while (lua_next(L, ti)) {
            if (lua_type(L, -2) != LUA_TSTRING) luaL_error(L, "%s: text keys must be strings", fname);
            keys[i] = lua_tostring(L, -2);
            vals[i] = luaL_tolstring(L, -1, NULL); /* numbers become text */
            lua_rawseti(L, ai, i + 1);
            lua_pop(L, 1);
            i++;
        }
        /* chunks in key order: a table's traversal order differs from one Lua state to
           the next, and the same picture with the same text must be the same bytes */
        for (int x = 1; x < n_text; x++)
            for (int k = x; k > 0 && strcmp(keys[k - 1], keys[k]) > 0; k--) {
                const char *tk = keys[k], *tv = vals[k];
                keys[k] = keys[k - 1]; vals[k] = vals[k - 1];
                keys[k - 1] = tk; vals[k - 1] = tv;
            }
        a->n_text = n_text, a->keys = keys, a->vals = vals;
    }
    kiln_tensor *c32;
    L_TRY(L, kiln_tensor_to(t, kiln_device_cpu(), KILN_F32, &c32));
    return c32;
}

/* kiln.save_png(tensor [B=1, C, H, W] or [C, H, W], path [, {text = {k = v}}]) */
static int l_save_png(lua_State *L)
{
    const char *path = luaL_checkstring(L, 2);
    lua_settop(L, 3);
    png_args a;
    kiln_tensor *c32 = check_png_args(L, "save_png", 3, &a);
    kiln_status st = kiln_png_write(path, kiln_tensor_data(c32), a.c, a.h, a.w, a.n_text, a.keys, a.vals);
    kiln_tensor_free(c32);
    if (st) l_raise(L, st);
    lua_pushstring(L, path);
    return 1;
}

#define PNG_BOX_MT "kiln.png_bytes"

static int png_box_gc(lua_State *L)
{
    unsigned char **box = luaL_checkudata(L, 1, PNG_BOX_MT);
    free(*box);
    *box = NULL;
    return 0;
}

/* kiln.encode_png(tensor [, {text = {k = v}}]) -> string: the bytes save_png would
 * write, made in memory [-0, +1, e] */
static int l_encode_png(lua_State *L)
{
    lua_settop(L, 2);
    png_args a;
    kiln_tensor *c32 = check_png_args(L, "encode_png", 2, &a);
    /* the bytes wait in a box the collector frees, should pushing them raise */
    unsigned char **box = lua_newuserdatauv(L, sizeof *box, 0);
    *box = NULL;
    if (luaL_newmetatable(L, PNG_BOX_MT)) {
        lua_pushcfunction(L, png_box_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_setmetatable(L, -2);
    size_t len;
    kiln_status st = kiln_png_encode(kiln_tensor_data(c32), a.c, a.h, a.w, a.n_text, a.keys, a.vals, box, &len);
    kiln_tensor_free(c32);
    if (st) l_raise(L, st);
    lua_pushlstring(L, (const char *)*box, len);
    free(*box);
    *box = NULL;
    return 1;
}

/* kiln.sha256_file(path [, skip]) -> hex digest of the file from byte skip (A1111's
 * "Model hash" is the first 10 digits of the whole file's; its LoRA hashes skip the
 * safetensors header) */
static int l_sha256_file(lua_State *L)
{
    char hex[65];
    lua_Integer skip = luaL_optinteger(L, 2, 0);
    luaL_argcheck(L, skip >= 0, 2, "a byte offset >= 0");
    L_TRY(L, kiln_sha256_file(luaL_checkstring(L, 1), (uint64_t)skip, hex));
    lua_pushstring(L, hex);
    return 1;
}

static const luaL_Reg io_funcs[] = {
    {"sha256_file", l_sha256_file},
    {"load_safetensors", l_load_safetensors}, {"save_safetensors", l_save_safetensors},
    {"load_gguf", l_load_gguf}, {"save_gguf", l_save_gguf},
    {"load_png", l_load_png}, {"save_png", l_save_png}, {"encode_png", l_encode_png},
    {NULL, NULL},
};

void l_open_io(lua_State *L)
{
    luaL_setfuncs(L, io_funcs, 0);
}
