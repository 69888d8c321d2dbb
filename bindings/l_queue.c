/* l_queue.c - kiln.queue: the Lua face of the Redis client (runtime/queue.h), a
 * kiln.Queue handle with the stream commands `kiln batch` uses (XADD, XREADGROUP,
 * XACK, XAUTOCLAIM, XPENDING) and a plain `command` for the rest. */
#include "l_parts.h"

#include "../runtime/queue.h"

#include <stdlib.h>
#include <string.h>

#define QUEUE_MT "kiln.Queue"

typedef struct {
    kiln_queue *q; /* NULL once closed */
    char closed_at[128];
} l_queue;

static l_queue *check_queue(lua_State *L, int idx)
{
    l_queue *h = luaL_checkudata(L, idx, QUEUE_MT);
    if (h->q == NULL) luaL_error(L, "queue was closed at %s", h->closed_at);
    return h;
}

static void push_reply(lua_State *L, const kiln_queue_reply *r)
{
    switch (r->kind) {
    case KILN_QUEUE_NIL: lua_pushboolean(L, 0); break; /* false: a nil would end a list */
    case KILN_QUEUE_INT: lua_pushinteger(L, (lua_Integer)r->integer); break;
    case KILN_QUEUE_ARRAY:
        luaL_checkstack(L, 4, "queue reply too deep");
        lua_createtable(L, (int)r->n, 0);
        for (size_t i = 0; i < r->n; i++) {
            push_reply(L, &r->items[i]);
            lua_rawseti(L, -2, (lua_Integer)i + 1);
        }
        break;
    default: lua_pushlstring(L, r->str, r->len); break; /* string, status, nested error */
    }
}

/* Runs a status-returning call: raises a client failure; a server error raises
 * "queue: <the server's message>" after freeing the reply. */
static kiln_queue_reply *finish(lua_State *L, kiln_status st, kiln_queue_reply *r)
{
    if (st != KILN_OK) l_raise(L, st);
    if (r->kind == KILN_QUEUE_ERROR) {
        lua_pushfstring(L, "queue: %s", r->str);
        kiln_queue_reply_free(r);
        lua_error(L);
    }
    return r;
}

/* kiln.queue.connect(host, port [, {connect_timeout =, timeout =, retry =}]) (ms;
 * retry -1: fail at once when the server is gone).                 [-0, +1, e] */
static int queue_connect(lua_State *L)
{
    const char *host = luaL_checkstring(L, 1);
    lua_Integer port = luaL_checkinteger(L, 2);
    luaL_argcheck(L, port > 0 && port < 65536, 2, "not a port number");
    kiln_queue_config cfg = {
        .connect_timeout_ms = (int)l_opt_int_field(L, 3, "connect_timeout", 0),
        .io_timeout_ms = (int)l_opt_int_field(L, 3, "timeout", 0),
        .retry_ms = (int)l_opt_int_field(L, 3, "retry", 0),
    };
    l_queue *h = lua_newuserdatauv(L, sizeof *h, 0);
    memset(h, 0, sizeof *h);
    strcpy(h->closed_at, "?");
    luaL_setmetatable(L, QUEUE_MT);
    L_TRY(L, kiln_queue_new(&h->q, host, (int)port, &cfg));
    return 1;
}

static int queue_available(lua_State *L)
{
    lua_pushboolean(L, kiln_queue_available());
    return 1;
}

static int queue_close(lua_State *L)
{
    l_queue *h = luaL_checkudata(L, 1, QUEUE_MT);
    if (h->q) {
        kiln_queue_free(h->q);
        h->q = NULL;
        l_where_string(L, h->closed_at, sizeof h->closed_at);
    }
    return 0;
}

/* q:command(word, ...) -> the reply (arrays as lists, nil as false). [-0, +1, e] */
static int queue_command(lua_State *L)
{
    l_queue *h = check_queue(L, 1);
    int argc = lua_gettop(L) - 1;
    luaL_argcheck(L, argc >= 1, 2, "a command expected");
    const char **argv = lua_newuserdatauv(L, argc * (sizeof *argv + sizeof(size_t)), 0);
    size_t *lens = (size_t *)(argv + argc);
    for (int i = 0; i < argc; i++) argv[i] = luaL_checklstring(L, i + 2, &lens[i]);
    kiln_queue_reply *r;
    kiln_status st = kiln_queue_command(h->q, argc, argv, lens, 0, &r);
    r = finish(L, st, r);
    push_reply(L, r);
    kiln_queue_reply_free(r);
    return 1;
}

/* Pushes one stream entry [id, [k, v, ...]] as {id =, fields = {k = v}} (stream
 * given), or nothing (returns 0) for an entry deleted meanwhile. */
static int push_entry(lua_State *L, const kiln_queue_reply *e, const char *stream)
{
    if (e->kind != KILN_QUEUE_ARRAY || e->n < 2 || e->items[0].kind != KILN_QUEUE_STRING) return 0;
    if (e->items[1].kind != KILN_QUEUE_ARRAY) return 0;
    lua_createtable(L, 0, 3);
    lua_pushlstring(L, e->items[0].str, e->items[0].len);
    lua_setfield(L, -2, "id");
    if (stream) {
        lua_pushstring(L, stream);
        lua_setfield(L, -2, "stream");
    }
    const kiln_queue_reply *f = &e->items[1];
    lua_createtable(L, 0, (int)(f->n / 2));
    for (size_t k = 0; k + 1 < f->n; k += 2) {
        lua_pushlstring(L, f->items[k].str ? f->items[k].str : "", f->items[k].len);
        lua_pushlstring(L, f->items[k + 1].str ? f->items[k + 1].str : "", f->items[k + 1].len);
        lua_rawset(L, -3);
    }
    lua_setfield(L, -2, "fields");
    return 1;
}

/* q:xadd(stream, {k1, v1, k2, v2, ...}) -> the entry's id.          [-0, +1, e] */
static int queue_xadd(lua_State *L)
{
    l_queue *h = check_queue(L, 1);
    const char *stream = luaL_checkstring(L, 2);
    luaL_checktype(L, 3, LUA_TTABLE);
    int n = (int)luaL_len(L, 3);
    luaL_argcheck(L, n > 0 && n % 2 == 0, 3, "a list of field, value pairs expected");
    const char **f = lua_newuserdatauv(L, n * (sizeof *f + sizeof(size_t)), 0);
    size_t *lens = (size_t *)(f + n);
    luaL_checkstack(L, n, "too many fields"); /* each value stays on the stack: a number's string lives there */
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 3, i + 1);
        f[i] = lua_tolstring(L, -1, &lens[i]);
        if (f[i] == NULL) luaL_argerror(L, 3, "fields and values must be strings or numbers");
    }
    kiln_queue_reply *r;
    kiln_status st = kiln_queue_xadd(h->q, stream, n / 2, f, lens, &r);
    r = finish(L, st, r);
    push_reply(L, r);
    kiln_queue_reply_free(r);
    return 1;
}

/* q:xreadgroup(group, consumer, streams [, {count =, block = ms, id = ">"}]) ->
 * list of {stream =, id =, fields =} (empty when nothing came). [-0, +1, e] */
static int queue_xreadgroup(lua_State *L)
{
    l_queue *h = check_queue(L, 1);
    const char *group = luaL_checkstring(L, 2);
    const char *consumer = luaL_checkstring(L, 3);
    luaL_checktype(L, 4, LUA_TTABLE);
    int count = (int)l_opt_int_field(L, 5, "count", 0);
    int block = (int)l_opt_int_field(L, 5, "block", -1);
    const char *id = l_opt_str_field(L, 5, "id", ">");
    int n = (int)luaL_len(L, 4);
    luaL_argcheck(L, n > 0, 4, "a list of streams expected");
    const char **s = lua_newuserdatauv(L, 2 * n * sizeof *s, 0);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 4, i + 1);
        s[i] = lua_tostring(L, -1);
        if (s[i] == NULL) luaL_argerror(L, 4, "stream names must be strings");
        lua_pop(L, 1); /* the table keeps the string alive */
        s[n + i] = id;
    }
    kiln_queue_reply *r;
    kiln_status st = kiln_queue_xreadgroup(h->q, group, consumer, count, block, n, s, s + n, &r);
    r = finish(L, st, r);
    lua_newtable(L);
    int k = 0;
    for (size_t i = 0; r->kind == KILN_QUEUE_ARRAY && i < r->n; i++) {
        const kiln_queue_reply *st = &r->items[i]; /* [stream, [entries]] */
        if (st->kind != KILN_QUEUE_ARRAY || st->n < 2) continue;
        for (size_t e = 0; e < st->items[1].n; e++)
            if (push_entry(L, &st->items[1].items[e], st->items[0].str)) lua_rawseti(L, -2, ++k);
    }
    kiln_queue_reply_free(r);
    return 1;
}

/* q:xack(stream, group, id, ...) -> how many were pending.          [-0, +1, e] */
static int queue_xack(lua_State *L)
{
    l_queue *h = check_queue(L, 1);
    const char *stream = luaL_checkstring(L, 2);
    const char *group = luaL_checkstring(L, 3);
    int n = lua_gettop(L) - 3;
    luaL_argcheck(L, n > 0, 4, "an id expected");
    const char **ids = lua_newuserdatauv(L, n * sizeof *ids, 0);
    for (int i = 0; i < n; i++) ids[i] = luaL_checkstring(L, 4 + i);
    kiln_queue_reply *r;
    kiln_status st = kiln_queue_xack(h->q, stream, group, n, ids, &r);
    r = finish(L, st, r);
    push_reply(L, r);
    kiln_queue_reply_free(r);
    return 1;
}

/* q:xautoclaim(stream, group, consumer, min_idle_ms [, {start = "0-0", count = 100}])
 * -> list of {stream =, id =, fields =} now owned by consumer, next cursor. [-0, +2, e] */
static int queue_xautoclaim(lua_State *L)
{
    l_queue *h = check_queue(L, 1);
    const char *stream = luaL_checkstring(L, 2);
    const char *group = luaL_checkstring(L, 3);
    const char *consumer = luaL_checkstring(L, 4);
    lua_Integer idle = luaL_checkinteger(L, 5);
    const char *start = l_opt_str_field(L, 6, "start", "0-0");
    int count = (int)l_opt_int_field(L, 6, "count", 100);
    kiln_queue_reply *r;
    kiln_status st = kiln_queue_xautoclaim(h->q, stream, group, consumer, idle, start, count, &r);
    r = finish(L, st, r);
    lua_newtable(L);
    int k = 0;
    if (r->kind == KILN_QUEUE_ARRAY && r->n >= 2)
        for (size_t e = 0; e < r->items[1].n; e++)
            if (push_entry(L, &r->items[1].items[e], stream)) lua_rawseti(L, -2, ++k);
    if (r->kind == KILN_QUEUE_ARRAY && r->n >= 1 && r->items[0].str) lua_pushstring(L, r->items[0].str);
    else lua_pushliteral(L, "0-0");
    kiln_queue_reply_free(r);
    return 2;
}

/* q:xpending(stream, group) -> {count =, consumers = {name = n}};
 * q:xpending(stream, group, {start =, stop =, count =, consumer =}) -> list of
 * {id =, consumer =, idle = ms, deliveries =}.                     [-0, +1, e] */
static int queue_xpending(lua_State *L)
{
    l_queue *h = check_queue(L, 1);
    const char *stream = luaL_checkstring(L, 2);
    const char *group = luaL_checkstring(L, 3);
    int extended = lua_istable(L, 4);
    const char *start = l_opt_str_field(L, 4, "start", "-");
    const char *stop = l_opt_str_field(L, 4, "stop", "+");
    int count = extended ? (int)l_opt_int_field(L, 4, "count", 100) : 0;
    const char *consumer = l_opt_str_field(L, 4, "consumer", NULL);
    kiln_queue_reply *r;
    kiln_status st = kiln_queue_xpending(h->q, stream, group, start, stop, count, consumer, &r);
    r = finish(L, st, r);
    lua_newtable(L);
    if (r->kind == KILN_QUEUE_ARRAY && extended) {
        for (size_t i = 0; i < r->n; i++) {
            const kiln_queue_reply *row = &r->items[i];
            if (row->kind != KILN_QUEUE_ARRAY || row->n < 4) continue;
            lua_createtable(L, 0, 4);
            lua_pushstring(L, row->items[0].str); lua_setfield(L, -2, "id");
            lua_pushstring(L, row->items[1].str); lua_setfield(L, -2, "consumer");
            lua_pushinteger(L, row->items[2].integer); lua_setfield(L, -2, "idle");
            lua_pushinteger(L, row->items[3].integer); lua_setfield(L, -2, "deliveries");
            lua_rawseti(L, -2, (lua_Integer)i + 1);
        }
    } else if (r->kind == KILN_QUEUE_ARRAY && r->n >= 4) {
        lua_pushinteger(L, r->items[0].integer);
        lua_setfield(L, -2, "count");
        lua_newtable(L);
        const kiln_queue_reply *cs = &r->items[3];
        for (size_t i = 0; cs->kind == KILN_QUEUE_ARRAY && i < cs->n; i++) {
            const kiln_queue_reply *c = &cs->items[i];
            if (c->kind != KILN_QUEUE_ARRAY || c->n < 2 || !c->items[0].str || !c->items[1].str) continue;
            lua_pushinteger(L, strtoll(c->items[1].str, NULL, 10));
            lua_setfield(L, -2, c->items[0].str);
        }
        lua_setfield(L, -2, "consumers");
    }
    kiln_queue_reply_free(r);
    return 1;
}

/* q:info() -> {server_version =, reconnects =}                      [-0, +1, e] */
static int queue_info(lua_State *L)
{
    l_queue *h = check_queue(L, 1);
    lua_createtable(L, 0, 2);
    lua_pushstring(L, kiln_queue_server_version(h->q));
    lua_setfield(L, -2, "server_version");
    lua_pushinteger(L, kiln_queue_reconnects(h->q));
    lua_setfield(L, -2, "reconnects");
    return 1;
}

static int queue_tostring(lua_State *L)
{
    l_queue *h = luaL_checkudata(L, 1, QUEUE_MT);
    if (h->q) lua_pushfstring(L, "kiln.Queue (Redis %s)", kiln_queue_server_version(h->q));
    else lua_pushliteral(L, "kiln.Queue (closed)");
    return 1;
}

void l_open_queue(lua_State *L)
{
    static const luaL_Reg methods[] = {
        {"command", queue_command}, {"xadd", queue_xadd}, {"xreadgroup", queue_xreadgroup},
        {"xack", queue_xack}, {"xautoclaim", queue_xautoclaim}, {"xpending", queue_xpending},
        {"info", queue_info}, {"close", queue_close}, {NULL, NULL},
    };
    if (luaL_newmetatable(L, QUEUE_MT)) {
        luaL_newlib(L, methods);
        lua_setfield(L, -2, "__index");
        lua_pushcfunction(L, queue_close);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, queue_close);
        lua_setfield(L, -2, "__close");
        lua_pushcfunction(L, queue_tostring);
        lua_setfield(L, -2, "__tostring");
    }
    lua_pop(L, 1);
    static const luaL_Reg funcs[] = {
        {"connect", queue_connect}, {"available", queue_available}, {NULL, NULL},
    };
    luaL_newlib(L, funcs);
    lua_setfield(L, -2, "queue");
}
