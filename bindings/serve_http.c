/* serve_http.c - the sockets of `kiln serve`: HTTP on civetweb's threads, handed to
 * the Lua state's thread as events (require "kiln.serve_http"). The API logic lives in
 * Lua (kiln.serve and kiln.serve.*); this file owns what must not wait for it:
 * accepting, the token, the body limit, WebSocket connections, previews and SIGTERM.
 *
 * Why civetweb (Debian's libcivetweb-dev 1.15): of the three servers Debian packages,
 * it is a small library (240 KB, nothing else pulled into `make deps`) with a thread
 * per connection, so a request simply blocks until the generation thread answers it,
 * and a WebSocket's own thread writes its frames. libmicrohttpd parses HTTP at least
 * as carefully, but its callbacks must not block (suspend/resume instead) and it brings
 * GnuTLS's development packages; libwebsockets has everything but is a 1.7 MB
 * event-loop framework that pulls libuv, libev, OpenSSL and glib development packages
 * in, with one service thread that would have to multiplex the waiting requests. We use
 * none of civetweb's parts with past advisories (no document root, no CGI, no
 * form-to-file storage), and not its WebSocket handlers either: writing to one of
 * them from another thread (the generation thread) races with its read loop, which
 * crashed the server in our tests, so the WebSocket is ours (serve_ws.c: the
 * handshake and server frames) on the connection's own request thread.
 *
 * Threads: civetweb's threads read requests, check the token and the body size, queue
 * an event and wait for the Lua thread's answer (srv:respond) under the server's
 * mutex; a WebSocket's thread writes the frames the Lua thread queues (srv:ws_send).
 * A signal handler and thread turn SIGTERM / SIGINT into a "stop" event. */
#define _GNU_SOURCE

#include "serve_http.h"
#include "serve_ws.h"

#include "lauxlib.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <png.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define SERVER_MT "kiln.serve.Server"

/* ---------------------------------------------------------------- base64, paths */

static const char b64chars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* b64encode(s) -> text [-1, +1, m] */
static int l_b64encode(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    luaL_Buffer b;
    char *out = luaL_buffinitsize(L, &b, (n + 2) / 3 * 4);
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0) | (i + 2 < n ? s[i + 2] : 0);
        out[o++] = b64chars[v >> 18 & 63];
        out[o++] = b64chars[v >> 12 & 63];
        out[o++] = i + 1 < n ? b64chars[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? b64chars[v & 63] : '=';
    }
    luaL_pushresultsize(&b, o);
    return 1;
}

/* b64decode(text) -> bytes | nil, message [-1, +1|2, m]: standard or URL-safe
 * alphabet, padding optional, whitespace skipped; a data: URL prefix is dropped (what
 * A1111 clients often send). */
static int l_b64decode(lua_State *L)
{
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    const char *comma = n > 5 && strncmp(s, "data:", 5) == 0 ? memchr(s, ',', n) : NULL;
    if (comma) { n -= (size_t)(comma + 1 - s); s = comma + 1; }
    luaL_Buffer b;
    char *out = luaL_buffinitsize(L, &b, n / 4 * 3 + 3);
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0, pad = 0;
    for (size_t i = 0; i < n; i++) {
        int c = (unsigned char)s[i], v;
        if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
        if (c == '=') { pad++; continue; }
        if (pad) { lua_pushnil(L); lua_pushfstring(L, "data after '=' padding at byte %d", (int)i); return 2; }
        if (c >= 'A' && c <= 'Z') v = c - 'A';
        else if (c >= 'a' && c <= 'z') v = c - 'a' + 26;
        else if (c >= '0' && c <= '9') v = c - '0' + 52;
        else if (c == '+' || c == '-') v = 62;
        else if (c == '/' || c == '_') v = 63;
        else { lua_pushnil(L); lua_pushfstring(L, "not base64: byte %d is %d", (int)i, c); return 2; }
        acc = acc << 6 | (uint32_t)v;
        bits += 6;
        if (bits >= 8) { bits -= 8; out[o++] = (char)(acc >> bits & 255); }
    }
    luaL_pushresultsize(&b, o);
    return 1;
}

/* realpath(path) -> resolved | nil [-1, +1, m]: the absolute path with every link and
 * ".." resolved (nil where it does not exist): what /view compares with its folders. */
static int l_realpath(lua_State *L)
{
    const char *p = luaL_checkstring(L, 1);
    char *r = realpath(p, NULL);
    if (!r) { lua_pushnil(L); return 1; }
    lua_pushstring(L, r);
    free(r);
    return 1;
}

#ifdef KILN_CIVETWEB
#include <civetweb.h>

/* ---------------------------------------------------------------- the server */

/* An HTTP request waiting for the Lua thread's answer. */
typedef struct pending {
    struct pending *next;
    long id;
    int done, status;
    char *ctype, *body, *headers;
    size_t len;
} pending;

/* ORDER EVENT_KIND */
enum { EV_HTTP, EV_WS_OPEN, EV_WS_CLOSE, EV_STOP };
static const char *const event_kinds[] = {"http", "ws_open", "ws_close", "stop"};

typedef struct event {
    struct event *next;
    int kind;
    long id;
    char *method, *path, *query, *ctype, *body, *auth;
    size_t blen;
    double arrived; /* CLOCK_MONOTONIC seconds (kiln.time's clock) when the body was read */
    char client[72];
} event;

/* A frame waiting for its connection's thread to write it. */
typedef struct frame {
    struct frame *next;
    size_t len;
    unsigned char data[];
} frame;

/* A WebSocket connection: its own request thread writes what the Lua thread queues
 * (a socket is written by one thread only; a client that stops reading is dropped
 * once WS_MAX_QUEUED bytes wait for it, so it costs the run nothing). */
typedef struct wsconn {
    struct wsconn *next;
    pthread_cond_t cv;
    frame *head, *tail;
    size_t queued;
    int dead;
    char client[72];
} wsconn;

#define WS_MAX_QUEUED (16u << 20)
#define WS_PING_SECONDS 20

typedef struct server {
    struct mg_context *mg;
    kiln_ctx *kctx;
    pthread_mutex_t mu;
    pthread_cond_t ev_cv;   /* an event was queued (the Lua thread waits) */
    pthread_cond_t done_cv; /* an answer was given (the request threads wait) */
    event *head, *tail;
    pending *pend;
    long next_id;
    wsconn *ws;
    char token[256];
    size_t max_body;
    int stopping, closed, port;
    int in_flight; /* request threads between queueing and the end of their answer */
    /* the run in progress: its client gets the previews */
    int running;
    char run_client[72];
    unsigned char *preview;
    size_t preview_len;
    int preview_step, preview_total, preview_seq;
    /* SIGTERM / SIGINT */
    pthread_t sigthread;
    int have_sigthread;
    struct sigaction old_term, old_int;
} server;

static char *dupn(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (!d) return NULL;
    if (n) memcpy(d, s, n);
    d[n] = 0;
    return d;
}

static char *dups(const char *s) { return s ? dupn(s, strlen(s)) : NULL; }

static void event_free(event *e)
{
    if (!e) return;
    free(e->method); free(e->path); free(e->query); free(e->ctype); free(e->body); free(e->auth);
    free(e);
}

/* Queues e (the caller holds mu). */
static void push_event(server *s, event *e)
{
    e->next = NULL;
    if (s->tail) s->tail->next = e;
    else s->head = e;
    s->tail = e;
    pthread_cond_signal(&s->ev_cv);
}

static void push_simple(server *s, int kind, const char *client)
{
    event *e = calloc(1, sizeof *e);
    if (!e) return;
    e->kind = kind;
    if (client) snprintf(e->client, sizeof e->client, "%s", client);
    pthread_mutex_lock(&s->mu);
    push_event(s, e);
    pthread_mutex_unlock(&s->mu);
}

/* Appends text to a header being built in a fixed buffer (cut at its end). */
static size_t put_text(char *buf, size_t cap, size_t at, const char *text)
{
    while (*text && at + 1 < cap) buf[at++] = *text++;
    buf[at] = 0;
    return at;
}

static size_t put_number(char *buf, size_t cap, size_t at, unsigned long long v)
{
    char digits[24];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n && at + 1 < cap) buf[at++] = digits[--n];
    buf[at] = 0;
    return at;
}

/* The answer's head is built without the printf family: civetweb's request threads have
 * small stacks, and glibc's formatter (deep under the sanitizers) overflowed them. */
static void send_plain(struct mg_connection *conn, int status, const char *ctype, const char *body, size_t len,
                       const char *headers)
{
    size_t cap = 512 + (headers ? strlen(headers) : 0);
    char *h = malloc(cap);
    if (!h) return;
    size_t at = put_text(h, cap, 0, "HTTP/1.1 ");
    at = put_number(h, cap, at, (unsigned long long)status);
    at = put_text(h, cap, at, " ");
    at = put_text(h, cap, at, mg_get_response_code_text(conn, status));
    at = put_text(h, cap, at, "\r\nContent-Type: ");
    at = put_text(h, cap, at, ctype);
    at = put_text(h, cap, at, "\r\nContent-Length: ");
    at = put_number(h, cap, at, (unsigned long long)len);
    at = put_text(h, cap, at, "\r\nCache-Control: no-cache\r\nConnection: close\r\n");
    if (headers) at = put_text(h, cap, at, headers);
    at = put_text(h, cap, at, "\r\n");
    mg_write(conn, h, at);
    free(h);
    if (len) mg_write(conn, body, len);
}

static void send_json_error(struct mg_connection *conn, int status, const char *type, const char *msg)
{
    char body[640];
    int n = snprintf(body, sizeof body,
                     "{\"error\":{\"type\":\"%s\",\"message\":\"%s\",\"details\":\"\",\"extra_info\":{}},"
                     "\"node_errors\":{}}",
                     type, msg);
    send_plain(conn, status, "application/json", body, (size_t)n, NULL);
}

/* The token, if one was set: "Authorization: Bearer T" (or, for a WebSocket, whose
 * browser API cannot set headers, ?token=T). Compared in constant time. */
static int authorized(server *s, struct mg_connection *conn)
{
    if (!s->token[0]) return 1;
    const char *h = mg_get_header(conn, "Authorization");
    char given[256] = "";
    if (h && strncmp(h, "Bearer ", 7) == 0) snprintf(given, sizeof given, "%s", h + 7);
    else {
        const struct mg_request_info *ri = mg_get_request_info(conn);
        if (ri->query_string) mg_get_var(ri->query_string, strlen(ri->query_string), "token", given, sizeof given);
    }
    size_t a = strlen(given), b = strlen(s->token);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < b; i++) diff |= (unsigned)(given[i < a ? i : 0] ^ s->token[i]);
    return diff == 0 && a > 0;
}

static int ws_serve(server *s, struct mg_connection *conn);

/* civetweb's "handle everything" callback, before its own WebSocket and file handling
 * (neither is used): GET /ws with "Upgrade: websocket" is ours; everything else goes on
 * to on_request. */
static int on_begin_request(struct mg_connection *conn)
{
    server *s = mg_get_user_data(mg_get_context(conn));
    const struct mg_request_info *ri = mg_get_request_info(conn);
    const char *up = mg_get_header(conn, "Upgrade");
    if (!s || !ri->local_uri || strcmp(ri->local_uri, "/ws") != 0 || !up || strcasecmp(up, "websocket") != 0) return 0;
    if (!authorized(s, conn)) {
        send_json_error(conn, 401, "unauthorized",
                        "this server needs 'Authorization: Bearer TOKEN' or ?token=TOKEN (kiln serve --token)");
        return 401;
    }
    return ws_serve(s, conn);
}

static int on_request(struct mg_connection *conn, void *cbdata)
{
    server *s = cbdata;
    const struct mg_request_info *ri = mg_get_request_info(conn);
    if (!authorized(s, conn)) {
        send_json_error(conn, 401, "unauthorized", "this server needs 'Authorization: Bearer TOKEN' (kiln serve --token)");
        return 401;
    }
    long long clen = ri->content_length;
    if (clen > (long long)s->max_body) {
        char msg[160];
        snprintf(msg, sizeof msg, "body too large: %lld bytes, the limit is %zu (--max-body)", clen, s->max_body);
        send_json_error(conn, 413, "body_too_large", msg);
        return 413;
    }
    /* the body, whole (chunked bodies too, up to the limit) */
    size_t cap = clen > 0 ? (size_t)clen : 4096, len = 0;
    char *body = malloc(cap + 1);
    if (!body) { send_json_error(conn, 503, "no_memory", "out of memory reading the body"); return 503; }
    for (;;) {
        if (len == cap) {
            if (cap >= s->max_body + 1) break;
            size_t ncap = cap * 2 > s->max_body + 1 ? s->max_body + 1 : cap * 2;
            char *nb = realloc(body, ncap + 1);
            if (!nb) break;
            body = nb;
            cap = ncap;
        }
        int r = mg_read(conn, body + len, cap - len);
        if (r <= 0) break;
        len += (size_t)r;
    }
    if (len > s->max_body) {
        free(body);
        char msg[160];
        snprintf(msg, sizeof msg, "body too large: over %zu bytes (--max-body)", s->max_body);
        send_json_error(conn, 413, "body_too_large", msg);
        return 413;
    }
    event *e = calloc(1, sizeof *e);
    pending *p = calloc(1, sizeof *p);
    if (!e || !p) {
        free(e); free(p); free(body);
        send_json_error(conn, 503, "no_memory", "out of memory");
        return 503;
    }
    e->kind = EV_HTTP;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    e->arrived = (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
    e->method = dups(ri->request_method);
    e->path = dups(ri->local_uri);
    e->query = dups(ri->query_string ? ri->query_string : "");
    e->ctype = dups(mg_get_header(conn, "Content-Type"));
    e->body = body;
    e->blen = len;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        event_free(e); free(p);
        send_json_error(conn, 503, "stopping", "the server is stopping");
        return 503;
    }
    e->id = p->id = ++s->next_id;
    s->in_flight++;
    p->next = s->pend;
    s->pend = p;
    push_event(s, e);
    while (!p->done && !s->stopping) pthread_cond_wait(&s->done_cv, &s->mu);
    /* unlink */
    for (pending **pp = &s->pend; *pp; pp = &(*pp)->next)
        if (*pp == p) { *pp = p->next; break; }
    pthread_mutex_unlock(&s->mu);
    int status = p->status;
    if (p->done) send_plain(conn, p->status, p->ctype ? p->ctype : "application/json", p->body, p->len, p->headers);
    else { send_json_error(conn, 503, "stopping", "the server stopped before answering"); status = 503; }
    free(p->ctype); free(p->body); free(p->headers); free(p);
    pthread_mutex_lock(&s->mu);
    s->in_flight--;
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->mu);
    return status ? status : 503;
}

/* ---------------------------------------------------------------- WebSocket */

static void new_client_id(char *out, size_t n)
{
    static unsigned long counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(out, n, "%08lx%08lx%08lx", (unsigned long)ts.tv_sec, (unsigned long)ts.tv_nsec,
             __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED));
}

/* Queues a frame for client (NULL: every client); the caller holds mu. Returns the
 * clients it was queued for. */
static int ws_send_locked(server *s, const char *client, int opcode, const char *data, size_t len)
{
    int n = 0;
    unsigned char h[10];
    size_t hl = serve_ws_frame_header(h, opcode, len);
    for (wsconn *w = s->ws; w; w = w->next) {
        if (w->dead || (client && strcmp(client, w->client) != 0)) continue;
        if (w->queued + len > WS_MAX_QUEUED) { /* not reading: dropped */
            w->dead = 1;
            pthread_cond_signal(&w->cv);
            continue;
        }
        frame *f = malloc(sizeof *f + hl + len);
        if (!f) continue;
        f->next = NULL;
        f->len = hl + len;
        memcpy(f->data, h, hl);
        if (len) memcpy(f->data + hl, data, len);
        if (w->tail) w->tail->next = f;
        else w->head = f;
        w->tail = f;
        w->queued += f->len;
        pthread_cond_signal(&w->cv);
        n++;
    }
    return n;
}

/* GET /ws with "Upgrade: websocket": the handshake, then this request thread writes
 * the connection's frames until the client is gone or the server stops. */
static int ws_serve(server *s, struct mg_connection *conn)
{
    const char *key = mg_get_header(conn, "Sec-WebSocket-Key");
    const char *version = mg_get_header(conn, "Sec-WebSocket-Version");
    char accept[29];
    if (!version || strcmp(version, "13") != 0 || !serve_ws_accept_key(key, accept)) {
        send_json_error(conn, 400, "bad_websocket", "a WebSocket handshake needs Sec-WebSocket-Version 13 and a key");
        return 400;
    }
    wsconn *w = calloc(1, sizeof *w);
    event *e = calloc(1, sizeof *e);
    if (!w || !e) {
        free(w); free(e);
        send_json_error(conn, 503, "no_memory", "out of memory");
        return 503;
    }
    pthread_cond_init(&w->cv, NULL);
    const struct mg_request_info *ri = mg_get_request_info(conn);
    if (ri->query_string)
        mg_get_var(ri->query_string, strlen(ri->query_string), "clientId", w->client, sizeof w->client);
    if (!w->client[0]) new_client_id(w->client, sizeof w->client);
    char head[256];
    size_t at = put_text(head, sizeof head, 0,
                         "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         "Sec-WebSocket-Accept: ");
    at = put_text(head, sizeof head, at, accept);
    at = put_text(head, sizeof head, at, "\r\n\r\n");
    mg_write(conn, head, at);
    pthread_mutex_lock(&s->mu);
    if (s->stopping) w->dead = 1;
    s->in_flight++;
    w->next = s->ws;
    s->ws = w;
    e->kind = EV_WS_OPEN;
    snprintf(e->client, sizeof e->client, "%s", w->client);
    push_event(s, e);
    while (!w->dead && !s->stopping) {
        if (!w->head) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += WS_PING_SECONDS;
            int rc = 0;
            while (!w->head && !w->dead && !s->stopping && rc != ETIMEDOUT)
                rc = pthread_cond_timedwait(&w->cv, &s->mu, &ts);
            /* idle: a ping finds a peer that is gone (its write fails) */
            if (!w->head && rc == ETIMEDOUT) ws_send_locked(s, w->client, SERVE_WS_PING, "", 0);
            continue;
        }
        frame *f = w->head;
        w->head = NULL;
        w->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        int ok = 1;
        while (f) {
            frame *nx = f->next;
            if (ok && mg_write(conn, f->data, f->len) != (int)f->len) ok = 0;
            pthread_mutex_lock(&s->mu);
            w->queued -= f->len;
            pthread_mutex_unlock(&s->mu);
            free(f);
            f = nx;
        }
        pthread_mutex_lock(&s->mu);
        if (!ok) w->dead = 1;
    }
    for (wsconn **pw = &s->ws; *pw; pw = &(*pw)->next)
        if (*pw == w) { *pw = w->next; break; }
    while (w->head) { frame *f = w->head; w->head = f->next; free(f); }
    event *c = calloc(1, sizeof *c);
    if (c) {
        c->kind = EV_WS_CLOSE;
        snprintf(c->client, sizeof c->client, "%s", w->client);
        push_event(s, c);
    }
    s->in_flight--;
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
    return 101;
}

/* ---------------------------------------------------------------- previews */

/* kiln_set_preview's callback, on the generation thread: the picture as PNG bytes
 * (the simplified libpng writer, to memory: a preview carries no text chunks), kept as
 * the latest for /sdapi/v1/progress and sent to the running prompt's client as
 * ComfyUI's binary preview frame: u32 BE 1 (preview), u32 BE 2 (PNG), then the PNG. */
static void on_preview(void *user, int step, int total, const kiln_image *im)
{
    server *s = user;
    if (!s->running || im->format != KILN_PIXEL_U8 || im->channels < 1 || im->channels > 4) return;
    png_image pi;
    memset(&pi, 0, sizeof pi);
    pi.version = PNG_IMAGE_VERSION;
    pi.width = (png_uint_32)im->width;
    pi.height = (png_uint_32)im->height;
    pi.format = im->channels == 1 ? PNG_FORMAT_GRAY : im->channels == 2 ? PNG_FORMAT_GA
                : im->channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
    png_int_32 stride = (png_int_32)(im->stride ? im->stride : (size_t)im->width * (size_t)im->channels);
    png_alloc_size_t size = 0;
    if (!png_image_write_to_memory(&pi, NULL, &size, 0, im->data, stride, NULL)) return;
    unsigned char *buf = malloc(8 + size);
    if (!buf) return;
    buf[0] = 0; buf[1] = 0; buf[2] = 0; buf[3] = 1;
    buf[4] = 0; buf[5] = 0; buf[6] = 0; buf[7] = 2;
    if (!png_image_write_to_memory(&pi, buf + 8, &size, 0, im->data, stride, NULL)) {
        free(buf);
        return;
    }
    pthread_mutex_lock(&s->mu);
    free(s->preview);
    s->preview = buf;
    s->preview_len = 8 + size;
    s->preview_step = step;
    s->preview_total = total;
    s->preview_seq++;
    ws_send_locked(s, s->run_client[0] ? s->run_client : NULL, SERVE_WS_BINARY, (const char *)buf,
                   8 + size);
    pthread_mutex_unlock(&s->mu);
}

/* ---------------------------------------------------------------- thread stacks */

/* Debian's civetweb gives its request threads 100 KiB stacks (a compile-time size).
 * glibc refuses a stack smaller than the process's static thread-local storage, which
 * the CUDA libraries linked into a CUDA build make larger than that (pthread_create:
 * EINVAL, "Cannot create first worker thread"), and the sanitizers' frames overflowed
 * it. The kiln program defines pthread_attr_setstacksize, which the dynamic linker
 * binds civetweb's calls to: sizes under glibc's default thread stack are raised to
 * it (address space only; pages are touched as a thread uses them). */
#define SERVE_MIN_THREAD_STACK ((size_t)8 << 20)

__attribute__((visibility("default"))) int pthread_attr_setstacksize(pthread_attr_t *attr, size_t size)
{
    static int (*real)(pthread_attr_t *, size_t);
    if (!real) {
        void *f = dlsym(RTLD_NEXT, "pthread_attr_setstacksize");
        if (!f) return EINVAL;
        memcpy(&real, &f, sizeof real);
    }
    return real(attr, size < SERVE_MIN_THREAD_STACK ? SERVE_MIN_THREAD_STACK : size);
}

/* ---------------------------------------------------------------- signals */

/* SIGTERM and SIGINT while the server runs: the handler (on whatever thread the kernel
 * picks: OpenBLAS's and the CPU pool's threads exist before the server, so a blocked
 * mask cannot route it) writes the signal to a pipe, and this thread turns it into a
 * stop event for the Lua thread, which cancels the run and answers what waits. */
static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    if (sig_pipe[1] >= 0 && write(sig_pipe[1], &b, 1) < 0) { /* full: a stop is already on its way */ }
    errno = saved;
}

static void *signal_thread(void *arg)
{
    server *s = arg;
    unsigned char b;
    for (;;) {
        ssize_t r = read(sig_pipe[0], &b, 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0 || b == 0) break; /* 0: the server closes */
        push_simple(s, EV_STOP, NULL);
    }
    return NULL;
}

/* ---------------------------------------------------------------- Lua */

static kiln_ctx *preload_ctx; /* the kiln program's context (serve_http_preload) */

static server *check_server(lua_State *L)
{
    server **ps = luaL_checkudata(L, 1, SERVER_MT);
    if (!*ps) luaL_error(L, "kiln.serve_http: the server was closed");
    return *ps;
}

static void server_close(server *s)
{
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    s->closed = 1;
    pthread_cond_broadcast(&s->done_cv);
    for (wsconn *w = s->ws; w; w = w->next) pthread_cond_signal(&w->cv);
    /* the answers given go out before civetweb stops (its writes give up once it is
     * stopping); a client that does not read is given a few seconds */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 5;
    while (s->in_flight > 0)
        if (pthread_cond_timedwait(&s->done_cv, &s->mu, &ts) == ETIMEDOUT) break;
    pthread_mutex_unlock(&s->mu);
    if (s->kctx) kiln_set_preview(s->kctx, NULL, NULL, 0);
    if (s->mg) mg_stop(s->mg); /* waits for the request threads, which see `stopping` */
    if (s->have_sigthread) {
        sigaction(SIGTERM, &s->old_term, NULL);
        sigaction(SIGINT, &s->old_int, NULL);
        unsigned char zero = 0;
        if (write(sig_pipe[1], &zero, 1) == 1) pthread_join(s->sigthread, NULL);
        else pthread_detach(s->sigthread);
        close(sig_pipe[0]);
        close(sig_pipe[1]);
        sig_pipe[0] = sig_pipe[1] = -1;
    }
    while (s->head) { event *e = s->head; s->head = e->next; event_free(e); }
    free(s->preview);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->ev_cv);
    pthread_cond_destroy(&s->done_cv);
    free(s);
}

/* srv:close() [-0, +0, -]: idempotent; also __gc and __close. */
static int l_close(lua_State *L)
{
    server **ps = luaL_checkudata(L, 1, SERVER_MT);
    if (*ps) { server_close(*ps); *ps = NULL; }
    return 0;
}

static int opt_int_field(lua_State *L, int idx, const char *k, int dflt)
{
    lua_getfield(L, idx, k);
    int v = lua_isnil(L, -1) ? dflt : (int)luaL_checkinteger(L, -1);
    lua_pop(L, 1);
    return v;
}

/* start{listen = "127.0.0.1", port = 8188, token = nil, max_body = bytes, threads = N,
 * signals = true} -> server [-1, +1, e]: listening once it returns; port 0 takes a
 * free port (srv:port() says which). */
static int l_start(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_getfield(L, 1, "listen");
    const char *host = luaL_optstring(L, -1, "127.0.0.1");
    lua_getfield(L, 1, "token");
    const char *token = luaL_optstring(L, -1, NULL);
    int port = opt_int_field(L, 1, "port", 8188);
    int threads = opt_int_field(L, 1, "threads", 32);
    lua_getfield(L, 1, "max_body");
    lua_Integer max_body = luaL_optinteger(L, -1, 64 << 20);
    lua_getfield(L, 1, "signals");
    int signals = lua_isnil(L, -1) ? 1 : lua_toboolean(L, -1);
    lua_pop(L, 4);
    luaL_argcheck(L, port >= 0 && port <= 65535, 1, "port must be 0..65535");
    luaL_argcheck(L, threads >= 2 && threads <= 1024, 1, "threads must be 2..1024");
    luaL_argcheck(L, max_body > 0, 1, "max_body must be > 0");
    luaL_argcheck(L, !token || strlen(token) < 255, 1, "token longer than 254 bytes");
    luaL_argcheck(L, strlen(host) < 200 && !strpbrk(host, ",: "), 1, "listen: an IPv4 address or host name");

    server **ps = lua_newuserdatauv(L, sizeof *ps, 0);
    *ps = NULL;
    luaL_setmetatable(L, SERVER_MT);
    server *s = calloc(1, sizeof *s);
    if (!s) return luaL_error(L, "kiln.serve_http: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->ev_cv, NULL);
    pthread_cond_init(&s->done_cv, NULL);
    s->max_body = (size_t)max_body;
    if (token) snprintf(s->token, sizeof s->token, "%s", token);
    s->kctx = preload_ctx;
    *ps = s;
    if (signals && sig_pipe[0] < 0 && pipe(sig_pipe) == 0) {
        if (pthread_create(&s->sigthread, NULL, signal_thread, s) == 0) {
            s->have_sigthread = 1;
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = on_signal;
            sigemptyset(&sa.sa_mask);
            sa.sa_flags = SA_RESTART;
            sigaction(SIGTERM, &sa, &s->old_term);
            sigaction(SIGINT, &sa, &s->old_int);
        } else {
            close(sig_pipe[0]);
            close(sig_pipe[1]);
            sig_pipe[0] = sig_pipe[1] = -1;
        }
    }
    char ports[256], nthreads[16];
    snprintf(ports, sizeof ports, "%s:%d", host, port);
    snprintf(nthreads, sizeof nthreads, "%d", threads);
    const char *options[] = {"listening_ports", ports, "num_threads", nthreads, "request_timeout_ms", "30000",
                             "enable_keep_alive", "no", NULL};
    struct mg_callbacks cb;
    memset(&cb, 0, sizeof cb);
    cb.begin_request = on_begin_request;
    struct mg_init_data init = {&cb, s, options};
    struct mg_error_data err;
    char errbuf[256] = "";
    unsigned errcode = 0;
    memset(&err, 0, sizeof err);
    err.code = &errcode;
    err.text = errbuf;
    err.text_buffer_size = sizeof errbuf;
    s->mg = mg_start2(&init, &err);
    if (!s->mg) {
        server_close(s);
        *ps = NULL;
        return luaL_error(L, "kiln serve: cannot listen on %s: %s", ports, errbuf[0] ? errbuf : "unknown error");
    }
    mg_set_request_handler(s->mg, "/", on_request, s);
    struct mg_server_port sp[4];
    int np = mg_get_server_ports(s->mg, 4, sp);
    s->port = np > 0 ? sp[0].port : port;
    if (s->kctx) kiln_set_preview(s->kctx, on_preview, s, 1);
    signal(SIGPIPE, SIG_IGN); /* a client gone mid-answer is a failed write, not the end of the server */
    return 1;
}

/* srv:port() -> the port it listens on */
static int l_port(lua_State *L)
{
    lua_pushinteger(L, check_server(L)->port);
    return 1;
}

static void set_str(lua_State *L, const char *k, const char *v, size_t n)
{
    if (!v) return;
    lua_pushlstring(L, v, n);
    lua_setfield(L, -2, k);
}

/* srv:next([timeout_s = 0]) -> event | nil [-0, +1, m]: {kind = "http", id, method,
 * path, query, content_type, body, arrived (kiln.time() when its body was read)} |
 * {kind = "ws_open" | "ws_close", client} |
 * {kind = "stop"} (SIGTERM / SIGINT). */
static int l_next(lua_State *L)
{
    server *s = check_server(L);
    double timeout = luaL_optnumber(L, 2, 0);
    pthread_mutex_lock(&s->mu);
    if (!s->head && timeout > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double t = (double)ts.tv_nsec / 1e9 + timeout;
        ts.tv_sec += (time_t)t;
        ts.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
        while (!s->head) {
            if (pthread_cond_timedwait(&s->ev_cv, &s->mu, &ts) == ETIMEDOUT) break;
        }
    }
    event *e = s->head;
    if (e) {
        s->head = e->next;
        if (!s->head) s->tail = NULL;
    }
    pthread_mutex_unlock(&s->mu);
    if (!e) return 0;
    lua_createtable(L, 0, 8);
    lua_pushstring(L, event_kinds[e->kind]);
    lua_setfield(L, -2, "kind");
    if (e->kind == EV_HTTP) {
        lua_pushinteger(L, e->id);
        lua_setfield(L, -2, "id");
        set_str(L, "method", e->method, e->method ? strlen(e->method) : 0);
        set_str(L, "path", e->path, e->path ? strlen(e->path) : 0);
        set_str(L, "query", e->query, e->query ? strlen(e->query) : 0);
        set_str(L, "content_type", e->ctype, e->ctype ? strlen(e->ctype) : 0);
        set_str(L, "body", e->body ? e->body : "", e->blen);
        lua_pushnumber(L, e->arrived);
        lua_setfield(L, -2, "arrived");
    } else if (e->client[0]) {
        lua_pushstring(L, e->client);
        lua_setfield(L, -2, "client");
    }
    event_free(e);
    return 1;
}

/* srv:respond(id, status, content_type, body [, headers]) [-0, +0, m]: the answer to
 * request id (false when its client is gone or it was answered). headers: extra
 * header lines, each ending in CRLF. */
static int l_respond(lua_State *L)
{
    server *s = check_server(L);
    long id = (long)luaL_checkinteger(L, 2);
    int status = (int)luaL_checkinteger(L, 3);
    const char *ctype = luaL_checkstring(L, 4);
    size_t len;
    const char *body = luaL_optlstring(L, 5, "", &len);
    const char *headers = luaL_optstring(L, 6, NULL);
    luaL_argcheck(L, status >= 100 && status <= 599, 3, "an HTTP status");
    char *b = dupn(body, len), *c = dups(ctype), *h = dups(headers);
    pthread_mutex_lock(&s->mu);
    pending *p = s->pend;
    while (p && p->id != id) p = p->next;
    if (p && !p->done && b && c) {
        p->status = status; p->ctype = c; p->body = b; p->len = len; p->headers = h;
        p->done = 1;
        b = c = h = NULL;
        pthread_cond_broadcast(&s->done_cv);
    }
    pthread_mutex_unlock(&s->mu);
    lua_pushboolean(L, b == NULL);
    free(b); free(c); free(h);
    return 1;
}

/* srv:ws_send(client | nil, text [, binary]) -> clients reached [-0, +1, -] */
static int l_ws_send(lua_State *L)
{
    server *s = check_server(L);
    const char *client = luaL_optstring(L, 2, NULL);
    size_t len;
    const char *data = luaL_checklstring(L, 3, &len);
    int op = lua_toboolean(L, 4) ? SERVE_WS_BINARY : SERVE_WS_TEXT;
    pthread_mutex_lock(&s->mu);
    int n = ws_send_locked(s, client, op, data, len);
    pthread_mutex_unlock(&s->mu);
    lua_pushinteger(L, n);
    return 1;
}

/* srv:ws_clients() -> list of client ids connected */
static int l_ws_clients(lua_State *L)
{
    server *s = check_server(L);
    lua_newtable(L);
    pthread_mutex_lock(&s->mu);
    int i = 0;
    for (wsconn *w = s->ws; w; w = w->next) {
        if (w->dead) continue;
        lua_pushstring(L, w->client);
        lua_rawseti(L, -2, ++i);
    }
    pthread_mutex_unlock(&s->mu);
    return 1;
}

/* srv:running(on [, client]) [-0, +0, -]: a run starts (its previews go to client, or
 * to every client) or ends (its preview is dropped). */
static int l_running(lua_State *L)
{
    server *s = check_server(L);
    int on = lua_toboolean(L, 2);
    const char *client = luaL_optstring(L, 3, "");
    pthread_mutex_lock(&s->mu);
    s->running = on;
    snprintf(s->run_client, sizeof s->run_client, "%s", on ? client : "");
    free(s->preview); /* a new run's progress starts without a picture; an ended one keeps none */
    s->preview = NULL;
    s->preview_len = 0;
    s->preview_step = s->preview_total = 0;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* srv:preview() -> png, step, total | nil: the latest preview of the run in progress */
static int l_preview(lua_State *L)
{
    server *s = check_server(L);
    pthread_mutex_lock(&s->mu);
    int have = s->preview != NULL;
    if (have) {
        lua_pushlstring(L, (const char *)s->preview + 8, s->preview_len - 8);
        lua_pushinteger(L, s->preview_step);
        lua_pushinteger(L, s->preview_total);
    }
    pthread_mutex_unlock(&s->mu);
    return have ? 3 : 0;
}

/* srv:pending() -> requests waiting for an answer */
static int l_pending(lua_State *L)
{
    server *s = check_server(L);
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (pending *p = s->pend; p; p = p->next) n += !p->done;
    pthread_mutex_unlock(&s->mu);
    lua_pushinteger(L, n);
    return 1;
}

static const luaL_Reg server_methods[] = {
    {"port", l_port}, {"next", l_next}, {"respond", l_respond}, {"ws_send", l_ws_send},
    {"ws_clients", l_ws_clients}, {"running", l_running}, {"preview", l_preview}, {"pending", l_pending},
    {"close", l_close}, {NULL, NULL},
};
#endif /* KILN_CIVETWEB */

static const luaL_Reg module_funcs[] = {
    {"b64encode", l_b64encode}, {"b64decode", l_b64decode}, {"realpath", l_realpath},
#ifdef KILN_CIVETWEB
    {"start", l_start},
#endif
    {NULL, NULL},
};

static int luaopen_serve_http(lua_State *L)
{
#ifdef KILN_CIVETWEB
    if (luaL_newmetatable(L, SERVER_MT)) {
        luaL_newlib(L, server_methods);
        lua_setfield(L, -2, "__index");
        lua_pushcfunction(L, l_close);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, l_close);
        lua_setfield(L, -2, "__close");
    }
    lua_pop(L, 1);
    mg_init_library(0);
#endif
    luaL_newlib(L, module_funcs);
#ifdef KILN_CIVETWEB
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "available");
#else
    lua_pushboolean(L, 0);
    lua_setfield(L, -2, "available");
    lua_pushliteral(L, "this kiln was built without an HTTP server: install libcivetweb-dev (make deps) and rebuild");
    lua_setfield(L, -2, "why");
#endif
    return 1;
}

void serve_http_preload(lua_State *L, kiln_ctx *ctx)
{
#ifdef KILN_CIVETWEB
    preload_ctx = ctx;
#else
    (void)ctx;
#endif
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    lua_pushcfunction(L, luaopen_serve_http);
    lua_setfield(L, -2, "kiln.serve_http");
    lua_pop(L, 1);
}
