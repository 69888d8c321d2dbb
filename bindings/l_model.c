/* l_model.c - kiln.model and the kiln.Model userdata: a weight store over mapped
 * safetensors files with load / offload / unload / pin, tensor access (m:tensor(name),
 * m[name]), streaming (fetch / prefetch / release) and weight patches (add_patch /
 * remove_patch / patch_count: LoRA and its family). Lifecycle as liolib's files:
 * :close(), __close and __gc share one idempotent release; later use says where the
 * model was closed. */
#include "l_tensor.h"
#include "l_parts.h"
#include "../runtime/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KILN_MODEL_MT "kiln.Model"

typedef struct {
    kiln_model *m;           /* NULL once closed */
    char name[64];
    char closed_at[128];
} l_model;

static l_model *check_ud(lua_State *L, int idx)
{
    return luaL_checkudata(L, idx, KILN_MODEL_MT);
}

static kiln_model *check_model(lua_State *L, int idx)
{
    l_model *u = check_ud(L, idx);
    if (!u->m) {
        if (u->closed_at[0]) luaL_error(L, "model '%s' was closed at %s", u->name, u->closed_at);
        luaL_error(L, "model '%s' was closed", u->name);
    }
    return u->m;
}

static void release(lua_State *L, l_model *u, int record)
{
    if (!u->m) return;
    kiln_model_close(u->m);
    u->m = NULL;
    if (record) l_where_string(L, u->closed_at, sizeof u->closed_at);
}

/* m:close() [-0, +0, -] */
static int m_close(lua_State *L)
{
    release(L, check_ud(L, 1), 1);
    return 0;
}

static int m_gc(lua_State *L)
{
    release(L, check_ud(L, 1), 0);
    return 0;
}

/* kiln.model(path_or_list [, {name = "unet", prefix = "model.diffusion_model.",
 * owner = "lora"}]) -> kiln.Model [-0, +1, e]; prefix (a string or a list) keeps only
 * the tensors whose names start with it (one part of a single-file checkpoint);
 * owner "lora" accounts the model's memory to "lora:<name>" (a LoRA file's factors),
 * "model" (the default) to "model:<name>". */
static int l_model_new(lua_State *L)
{
    int n = 0;
    if (lua_type(L, 1) == LUA_TSTRING) n = 1;
    else if (lua_istable(L, 1)) n = (int)luaL_len(L, 1);
    else return luaL_typeerror(L, 1, "file name or list of file names");
    if (n < 1) return luaL_argerror(L, 1, "the list of files is empty");
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    const char *name = l_opt_str_field(L, 2, "name", NULL);
    static const char *const owners[] = {"model", "lora", NULL};
    const char *owner = l_opt_str_field(L, 2, "owner", "model");
    if (strcmp(owner, "model") != 0 && strcmp(owner, "lora") != 0) return l_enum_error(L, 2, "owner", owner, owners);
    const char **paths = lua_newuserdatauv(L, sizeof(char *) * (size_t)n, 0);
    if (lua_type(L, 1) == LUA_TSTRING) {
        paths[0] = lua_tostring(L, 1);
    } else {
        for (int i = 0; i < n; i++) {
            if (lua_geti(L, 1, i + 1) != LUA_TSTRING)
                return luaL_argerror(L, 1, lua_pushfstring(L, "file %d is a %s, expected a string", i + 1, luaL_typename(L, -1)));
            paths[i] = lua_tostring(L, -1); /* anchored by the list */
            lua_pop(L, 1);
        }
    }
    int n_prefixes = 0;
    const char **prefixes = NULL;
    if (lua_istable(L, 2)) {
        int t = lua_getfield(L, 2, "prefix");
        if (t == LUA_TSTRING || t == LUA_TTABLE) {
            int pi = lua_gettop(L);
            n_prefixes = t == LUA_TSTRING ? 1 : (int)luaL_len(L, pi);
            prefixes = lua_newuserdatauv(L, sizeof(char *) * (size_t)(n_prefixes ? n_prefixes : 1), 0);
            for (int i = 0; i < n_prefixes; i++) {
                if (t == LUA_TSTRING) { prefixes[0] = lua_tostring(L, pi); break; }
                if (lua_geti(L, pi, i + 1) != LUA_TSTRING) luaL_error(L, "option 'prefix': entry %d is not a string", i + 1);
                prefixes[i] = lua_tostring(L, -1); /* anchored by the list */
                lua_pop(L, 1);
            }
        } else if (t != LUA_TNIL) {
            luaL_error(L, "option 'prefix' must be a string or a list of strings, got %s", luaL_typename(L, -1));
        }
    }
    /* handle first, then acquire: an error below leaves an empty handle to collect */
    l_model *u = lua_newuserdatauv(L, sizeof *u, 0);
    memset(u, 0, sizeof *u);
    luaL_setmetatable(L, KILN_MODEL_MT);
    kiln_model *m;
    L_TRY(L, kiln_model_open_prefixed(paths, n, name, prefixes, n_prefixes, &m));
    u->m = m;
    if (strcmp(owner, "model") != 0) L_TRY(L, kiln_model_set_owner_kind(m, owner));
    snprintf(u->name, sizeof u->name, "%s", kiln_model_name(m));
    return 1;
}

/* Names from a string or a list of strings at idx, anchored on the stack. */
static const char **check_names(lua_State *L, int idx, int *n)
{
    if (lua_type(L, idx) == LUA_TSTRING) {
        const char **v = lua_newuserdatauv(L, sizeof(char *), 0);
        v[0] = lua_tostring(L, idx);
        *n = 1;
        return v;
    }
    if (!lua_istable(L, idx)) luaL_typeerror(L, idx, "tensor name or list of names");
    int k = (int)luaL_len(L, idx);
    const char **v = lua_newuserdatauv(L, sizeof(char *) * (size_t)(k ? k : 1), 0);
    for (int i = 0; i < k; i++) {
        if (lua_geti(L, idx, i + 1) != LUA_TSTRING)
            luaL_argerror(L, idx, lua_pushfstring(L, "name %d is a %s, expected a string", i + 1, luaL_typename(L, -1)));
        v[i] = lua_tostring(L, -1);
        lua_pop(L, 1);
    }
    *n = k;
    return v;
}

static int m_tensor(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    const char *name = luaL_checkstring(L, 2);
    kiln_tensor *t;
    L_TRY(L, kiln_model_tensor(m, name, &t));
    l_push_tensor(L, t);
    return 1;
}

static int m_has(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    lua_pushboolean(L, kiln_model_find(m, luaL_checkstring(L, 2)) >= 0);
    return 1;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* m:names() -> sorted list of tensor names */
static int m_names(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    int n = kiln_model_count(m);
    const char **v = lua_newuserdatauv(L, sizeof(char *) * (size_t)(n ? n : 1), 0);
    for (int i = 0; i < n; i++) v[i] = kiln_model_tensor_name(m, i);
    qsort(v, (size_t)n, sizeof *v, cmp_str);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushstring(L, v[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* m:load([device] [, {dtype = "f16"} or "f16"]) -> m */
static int m_load(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    kiln_device *dev = l_opt_device(L, 2);
    int dtype = -1;
    if (lua_type(L, 3) == LUA_TSTRING) {
        dtype = (int)l_check_dtype(L, 3);
    } else if (lua_istable(L, 3)) {
        if (lua_getfield(L, 3, "dtype") != LUA_TNIL) dtype = (int)l_check_dtype(L, lua_gettop(L));
        lua_pop(L, 1);
        /* a partial residency keeps whole blocks: the networks know theirs, a bare store does not */
        if (lua_getfield(L, 3, "resident") != LUA_TNIL)
            luaL_argerror(L, 3, "resident applies to a network (ckpt.unet, ckpt.vae, a ControlNet: "
                                "part:load(dev, {resident = bytes})), whose blocks kiln knows; a kiln.Model loads whole");
        lua_pop(L, 1);
    } else if (!lua_isnoneornil(L, 3)) {
        luaL_typeerror(L, 3, "options table or dtype name");
    }
    L_TRY(L, kiln_model_load(m, dev, dtype));
    lua_settop(L, 1);
    return 1;
}

/* m:set_streamed(on) -> m: on, later loads keep the weights on the host for
 * streaming whatever the memory mode (the networks' partial residency: kiln.stream
 * keeps some blocks fetched and streams the others); "whole": later loads put every
 * weight on the device, in mode "low" too (a residency of all its bytes); false: the
 * memory mode decides. m.streamed tells whether it streams always. */
static int m_set_streamed(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    luaL_checkany(L, 2);
    int on = lua_toboolean(L, 2);
    if (lua_type(L, 2) == LUA_TSTRING) {
        if (strcmp(lua_tostring(L, 2), "whole") != 0)
            return luaL_argerror(L, 2, lua_pushfstring(L, "true, false or \"whole\" expected, got \"%s\"", lua_tostring(L, 2)));
        on = -1;
    }
    kiln_model_set_stream_always(m, on);
    lua_settop(L, 1);
    return 1;
}

static int m_offload(lua_State *L)
{
    L_TRY(L, kiln_model_offload(check_model(L, 1)));
    lua_settop(L, 1);
    return 1;
}

static int m_unload(lua_State *L)
{
    kiln_model_unload(check_model(L, 1));
    lua_settop(L, 1);
    return 1;
}

static int m_pin(lua_State *L)
{
    kiln_model_pin(check_model(L, 1));
    lua_settop(L, 1);
    return 1;
}

static int m_unpin(lua_State *L)
{
    L_TRY(L, kiln_model_unpin(check_model(L, 1)));
    lua_settop(L, 1);
    return 1;
}

/* m:bytes([device]) -> bytes of the model's copies there (all host and device copies
 * when no device is given) */
static int m_bytes(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    kiln_device *dev = lua_isnoneornil(L, 2) ? NULL : l_check_device(L, 2);
    lua_pushinteger(L, (lua_Integer)kiln_model_bytes(m, dev));
    return 1;
}

static int stream(lua_State *L, kiln_status (*fn)(kiln_model *, const char *const *, int))
{
    kiln_model *m = check_model(L, 1);
    int n;
    const char **names = check_names(L, 2, &n);
    L_TRY(L, fn(m, names, n));
    lua_settop(L, 1);
    return 1;
}

static int m_fetch(lua_State *L) { return stream(L, kiln_model_fetch); }
static int m_release(lua_State *L) { return stream(L, kiln_model_release); }
static int m_prefetch(lua_State *L) { return stream(L, kiln_model_prefetch); }

/* m:where(name) -> "device" | "host" | "mapped" */
static int m_where(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    kiln_residency r;
    L_TRY(L, kiln_model_where(m, luaL_checkstring(L, 2), &r));
    lua_pushstring(L, kiln_residency_name(r));
    return 1;
}

/* ---- patches ---- */

/* m:add_patch(target, spec) -> id [-0, +1, e]
 * spec = {kind = "lora"|"loha"|"lokr"|"diff", scale = 1, strength = 1 (DoRA's mix),
 *         up =, down =, mid =, w1a =, ..., diff =, dora_scale = (tensors),
 *         rows = {first, count} (1-based rows of dim 1)} */
static int m_add_patch(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    const char *target = luaL_checkstring(L, 2);
    luaL_checktype(L, 3, LUA_TTABLE);
    const char *mn = kiln_model_name(m);
    if (kiln_model_find(m, target) < 0) {
        kiln_tensor *t;
        L_TRY(L, kiln_model_tensor(m, target, &t)); /* raises naming the closest names */
        kiln_tensor_free(t);
    }
    /* every key known: a misspelt factor would otherwise be a silent no-op */
    lua_pushnil(L);
    while (lua_next(L, 3)) {
        lua_pop(L, 1);
        int ok = lua_type(L, -1) == LUA_TSTRING;
        const char *k = ok ? lua_tostring(L, -1) : "";
        ok = ok && (strcmp(k, "kind") == 0 || strcmp(k, "scale") == 0 || strcmp(k, "strength") == 0 ||
                    strcmp(k, "rows") == 0);
        for (int f = 0; !ok && lua_type(L, -1) == LUA_TSTRING && f < KILN_AF_COUNT; f++)
            ok = strcmp(k, kiln_adapter_factor_name((kiln_adapter_factor)f)) == 0;
        if (!ok)
            return luaL_error(L, "model '%s': add_patch on '%s': unknown spec field '%s' (fields: kind, scale, strength, "
                              "rows, up, down, mid, w1a, w1b, w2a, w2b, t1, t2, w1, w2, diff, dora_scale)", mn, target,
                              lua_type(L, -1) == LUA_TSTRING ? k : luaL_tolstring(L, -1, NULL));
    }
    kiln_adapter a;
    memset(&a, 0, sizeof a);
    if (lua_getfield(L, 3, "kind") != LUA_TSTRING)
        return luaL_error(L, "model '%s': add_patch on '%s': field 'kind' must be one of lora, loha, lokr, diff (got %s)",
                          mn, target, luaL_typename(L, -1));
    int kind = kiln_adapter_kind_from_name(lua_tostring(L, -1));
    if (kind < 0)
        return luaL_error(L, "model '%s': add_patch on '%s': field 'kind' is '%s', expected one of lora, loha, lokr, diff",
                          mn, target, lua_tostring(L, -1));
    lua_pop(L, 1);
    a.kind = (kiln_adapter_kind)kind;
    static const char *const nums[2] = {"scale", "strength"};
    double *dst[2] = {&a.scale, &a.strength};
    for (int k = 0; k < 2; k++) {
        int ty = lua_getfield(L, 3, nums[k]);
        if (ty == LUA_TNIL) *dst[k] = k == 0 ? 1.0 : 0.0;
        else if (ty == LUA_TNUMBER) *dst[k] = lua_tonumber(L, -1);
        else return luaL_error(L, "model '%s': add_patch on '%s': field '%s' must be a number, got %s", mn, target,
                               nums[k], luaL_typename(L, -1));
        lua_pop(L, 1);
    }
    for (int f = 0; f < KILN_AF_COUNT; f++) {
        const char *fname = kiln_adapter_factor_name((kiln_adapter_factor)f);
        if (lua_getfield(L, 3, fname) == LUA_TNIL) { lua_pop(L, 1); continue; }
        kiln_tensor *t = l_test_tensor(L, -1);
        if (!t) {
            if (luaL_testudata(L, -1, KILN_TENSOR_MT)) l_check_tensor(L, -1); /* says where it was freed */
            return luaL_error(L, "model '%s': add_patch on '%s': field '%s' must be a tensor, got %s", mn, target, fname,
                              luaL_typename(L, -1));
        }
        a.f[f] = t; /* anchored by the spec table */
        lua_pop(L, 1);
    }
    lua_Integer first = 0, count = 0;
    int ty = lua_getfield(L, 3, "rows");
    if (ty != LUA_TNIL) {
        int good = ty == LUA_TTABLE;
        if (good) {
            lua_geti(L, -1, 1);
            lua_geti(L, -2, 2);
            good = lua_isinteger(L, -2) && lua_isinteger(L, -1);
            first = lua_tointeger(L, -2);
            count = lua_tointeger(L, -1);
            lua_pop(L, 2);
            good = good && first >= 1 && count >= 1;
        }
        if (!good)
            return luaL_error(L, "model '%s': add_patch on '%s': field 'rows' must be {first, count} with integers >= 1",
                              mn, target);
    }
    lua_pop(L, 1);
    int id;
    L_TRY(L, kiln_model_add_patch(m, target, &a, count > 0 ? (int64_t)first - 1 : 0, (int64_t)count, &id));
    lua_pushinteger(L, id);
    return 1;
}

/* m:remove_patch(id) -> m [-0, +1, e] */
static int m_remove_patch(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    lua_Integer id = luaL_checkinteger(L, 2);
    if (id < 1 || id > 0x7fffffff) return luaL_error(L, "model '%s': no patch with id %d", kiln_model_name(m), (int)id);
    L_TRY(L, kiln_model_remove_patch(m, (int)id));
    lua_settop(L, 1);
    return 1;
}

/* m:patch_count([target]) -> patches on that tensor, or in the model [-0, +1, e] */
static int m_patch_count(lua_State *L)
{
    kiln_model *m = check_model(L, 1);
    const char *target = luaL_optstring(L, 2, NULL);
    int n = kiln_model_patch_count(m, target);
    if (n < 0) {
        kiln_tensor *t;
        L_TRY(L, kiln_model_tensor(m, target, &t)); /* raises naming the closest names */
        kiln_tensor_free(t);
    }
    lua_pushinteger(L, n);
    return 1;
}

#define SET_INT(L, name, v) (lua_pushinteger((L), (lua_Integer)(v)), lua_setfield((L), -2, (name)))

static void push_residency(lua_State *L, const kiln_model_info *in)
{
    lua_createtable(L, 0, 6);
    for (int r = 0; r < KILN_RES_COUNT; r++) SET_INT(L, kiln_residency_name((kiln_residency)r), in->count[r]);
    SET_INT(L, "tensors", in->n_tensors);
    if (in->device) {
        lua_pushstring(L, in->device->name);
        lua_setfield(L, -2, "target");
    }
}

/* m:stats() -> {tensors, mapped, host, device, file_bytes, host_bytes, device_bytes,
 * pinned, fetches, prefetches, prefetch_waits, prefetch_hits, prefetch_thread, ...} */
static int m_stats(lua_State *L)
{
    kiln_model_info in;
    kiln_model_get_info(check_model(L, 1), &in);
    push_residency(L, &in);
    SET_INT(L, "file_bytes", in.file_bytes);
    SET_INT(L, "host_bytes", in.host_bytes);
    SET_INT(L, "device_bytes", in.device_bytes);
    SET_INT(L, "pinned", in.pinned);
    SET_INT(L, "last_used", in.last_used);
    SET_INT(L, "fetches", in.n_fetch_copies);
    SET_INT(L, "prefetches", in.n_prefetch_copies);
    SET_INT(L, "prefetch_waits", in.n_prefetch_waits);
    SET_INT(L, "prefetch_hits", in.n_prefetch_hits);
    SET_INT(L, "prefetch_thread", in.prefetch_thread);
    if (in.dtype >= 0) {
        lua_pushstring(L, kiln_dtype_name((kiln_dtype)in.dtype));
        lua_setfield(L, -2, "dtype");
    }
    return 1;
}

static int m_tostring(lua_State *L)
{
    l_model *u = check_ud(L, 1);
    if (!u->m) {
        lua_pushfstring(L, "model(%s, closed)", u->name);
        return 1;
    }
    kiln_model_info in;
    kiln_model_get_info(u->m, &in);
    char size[32], state[96];
    kiln_format_bytes(size, sizeof size, (double)(in.bytes[0] + in.bytes[1] + in.bytes[2]));
    int n = in.n_tensors, dev = in.count[KILN_RES_DEVICE], host = in.count[KILN_RES_HOST];
    const char *target = in.device ? in.device->name : "?";
    if (n > 0 && dev == n) snprintf(state, sizeof state, "resident on %s", target);
    else if (dev > 0) snprintf(state, sizeof state, "%d/%d resident on %s", dev, n, target);
    else if (host > 0 && kiln_memory_mode_get() == KILN_MEM_LOW && in.device)
        snprintf(state, sizeof state, "on host, streamed to %s", target);
    else if (n > 0 && host == n) snprintf(state, sizeof state, "on host");
    else if (host > 0) snprintf(state, sizeof state, "%d/%d on host", host, n);
    else if (in.device && kiln_memory_mode_get() == KILN_MEM_LOW) snprintf(state, sizeof state, "mapped, streamed to %s", target);
    else snprintf(state, sizeof state, "mapped");
    lua_pushfstring(L, "model(%s, %d tensor%s, %s, %s%s)", u->name, n, n == 1 ? "" : "s", size, state,
                    in.pinned ? ", pinned" : "");
    return 1;
}

static int m_len(lua_State *L)
{
    lua_pushinteger(L, kiln_model_count(check_model(L, 1)));
    return 1;
}

static const luaL_Reg model_methods[] = {
    {"close", m_close}, {"tensor", m_tensor}, {"has", m_has}, {"names", m_names},
    {"load", m_load}, {"set_streamed", m_set_streamed}, {"offload", m_offload}, {"unload", m_unload}, {"pin", m_pin}, {"unpin", m_unpin},
    {"bytes", m_bytes}, {"fetch", m_fetch}, {"release", m_release}, {"prefetch", m_prefetch},
    {"where", m_where}, {"stats", m_stats},
    {"add_patch", m_add_patch}, {"remove_patch", m_remove_patch}, {"patch_count", m_patch_count},
    {NULL, NULL},
};

/* m.key: a method, a property (name, residency, device, streamed, pinned, closed), else the
 * tensor of that name. */
static int m_index(lua_State *L)
{
    l_model *u = check_ud(L, 1);
    lua_pushvalue(L, 2);
    if (lua_rawget(L, lua_upvalueindex(1)) != LUA_TNIL) return 1;
    lua_pop(L, 1);
    const char *key = luaL_checkstring(L, 2);
    if (strcmp(key, "name") == 0) { lua_pushstring(L, u->name); return 1; }
    if (strcmp(key, "closed") == 0) { lua_pushboolean(L, u->m == NULL); return 1; }
    kiln_model *m = check_model(L, 1);
    kiln_model_info in;
    if (strcmp(key, "residency") == 0) {
        kiln_model_get_info(m, &in);
        push_residency(L, &in);
        return 1;
    }
    if (strcmp(key, "device") == 0) {
        kiln_model_get_info(m, &in);
        if (in.device) lua_pushstring(L, in.device->name);
        else lua_pushnil(L);
        return 1;
    }
    if (strcmp(key, "streamed") == 0) {
        lua_pushboolean(L, kiln_model_stream_always(m) > 0);
        return 1;
    }
    if (strcmp(key, "pinned") == 0) {
        kiln_model_get_info(m, &in);
        lua_pushboolean(L, in.pinned > 0);
        return 1;
    }
    return m_tensor(L);
}

void l_open_model(lua_State *L)
{
    luaL_newmetatable(L, KILN_MODEL_MT);
    luaL_newlib(L, model_methods);
    lua_pushcclosure(L, m_index, 1);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, m_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, m_close);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, m_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pushcfunction(L, m_len);
    lua_setfield(L, -2, "__len");
    lua_pushstring(L, KILN_MODEL_MT);
    lua_setfield(L, -2, "__name");
    lua_pop(L, 1);
    lua_pushcfunction(L, l_model_new);
    lua_setfield(L, -2, "model");
}
