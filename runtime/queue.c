/* queue.c - the Redis client behind kiln.queue (queue.h): hiredis's blocking API
 * under kiln's status values, replies copied into kiln_queue_reply trees, and one
 * reconnect loop with backoff so a farm rides out a Redis restart. Built without
 * hiredis (no KILN_HIREDIS) every entry says what to install. */
#define _POSIX_C_SOURCE 200809L

#include "queue.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NO_HIREDIS "kiln was built without hiredis: apt-get install libhiredis-dev and rebuild"

static void free_contents(kiln_queue_reply *r)
{
    for (size_t i = 0; i < r->n; i++) free_contents(&r->items[i]);
    free(r->items);
    free(r->str);
}

void kiln_queue_reply_free(kiln_queue_reply *r)
{
    if (r == NULL) return;
    free_contents(r);
    free(r);
}

#ifndef KILN_HIREDIS

struct kiln_queue { int unused; };

int kiln_queue_available(void) { return 0; }
kiln_status kiln_queue_new(kiln_queue **out, const char *host, int port, const kiln_queue_config *cfg)
{
    (void)host; (void)port; (void)cfg;
    *out = NULL;
    return kiln_error(KILN_ERR_UNSUPPORTED, NO_HIREDIS);
}
void kiln_queue_free(kiln_queue *q) { (void)q; }
const char *kiln_queue_server_version(const kiln_queue *q) { (void)q; return ""; }
int kiln_queue_reconnects(const kiln_queue *q) { (void)q; return 0; }
kiln_status kiln_queue_command(kiln_queue *q, int argc, const char **argv, const size_t *lens, int wait_ms,
                               kiln_queue_reply **out)
{
    (void)q; (void)argc; (void)argv; (void)lens; (void)wait_ms;
    *out = NULL;
    return kiln_error(KILN_ERR_UNSUPPORTED, NO_HIREDIS);
}

#else

#include <errno.h>
#include <time.h>

#include <hiredis.h>

struct kiln_queue {
    redisContext *c; /* NULL while disconnected */
    char *host;
    int port;
    kiln_queue_config cfg;
    char version[32];
    int reconnects;
};

int kiln_queue_available(void) { return 1; }

static struct timeval tv_of(int ms)
{
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    return tv;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static kiln_status copy_reply(kiln_queue_reply *dst, const redisReply *src)
{
    memset(dst, 0, sizeof *dst);
    switch (src->type) {
    case REDIS_REPLY_INTEGER: dst->kind = KILN_QUEUE_INT; dst->integer = src->integer; return KILN_OK;
    case REDIS_REPLY_NIL: dst->kind = KILN_QUEUE_NIL; return KILN_OK;
    case REDIS_REPLY_ARRAY:
        dst->kind = KILN_QUEUE_ARRAY;
        if (src->elements == 0) return KILN_OK;
        dst->items = calloc(src->elements, sizeof *dst->items);
        if (dst->items == NULL) return kiln_error(KILN_ERR_OOM, "queue: out of host memory for a reply");
        dst->n = src->elements;
        for (size_t i = 0; i < src->elements; i++)
            if (copy_reply(&dst->items[i], src->element[i]) != KILN_OK) return KILN_ERR_OOM;
        return KILN_OK;
    default:
        dst->kind = src->type == REDIS_REPLY_ERROR ? KILN_QUEUE_ERROR
                  : src->type == REDIS_REPLY_STATUS ? KILN_QUEUE_STATUS : KILN_QUEUE_STRING;
        dst->str = malloc(src->len + 1);
        if (dst->str == NULL) return kiln_error(KILN_ERR_OOM, "queue: out of host memory for a reply");
        memcpy(dst->str, src->str, src->len);
        dst->str[src->len] = '\0';
        dst->len = src->len;
        return KILN_OK;
    }
}

/* Opens a connection and reads the server's version; 0 with msg set on failure. */
static int dial(kiln_queue *q, char *msg, size_t n)
{
    redisContext *c = redisConnectWithTimeout(q->host, q->port, tv_of(q->cfg.connect_timeout_ms));
    if (c == NULL || c->err) {
        snprintf(msg, n, "%s", c ? c->errstr : "out of memory");
        if (c) redisFree(c);
        return 0;
    }
    redisSetTimeout(c, tv_of(q->cfg.io_timeout_ms));
    redisEnableKeepAlive(c);
    redisReply *r = redisCommand(c, "INFO server");
    if (r == NULL) {
        snprintf(msg, n, "%s", c->errstr);
        redisFree(c);
        return 0;
    }
    if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS) {
        const char *v = strstr(r->str, "redis_version:");
        if (v) sscanf(v + 14, "%31[0-9.]", q->version);
    }
    freeReplyObject(r);
    q->c = c;
    return 1;
}

kiln_status kiln_queue_new(kiln_queue **out, const char *host, int port, const kiln_queue_config *cfg)
{
    *out = NULL;
    kiln_queue *q = calloc(1, sizeof *q);
    if (q == NULL || (q->host = strdup(host)) == NULL) {
        free(q);
        return kiln_error(KILN_ERR_OOM, "queue: out of host memory");
    }
    q->port = port;
    if (cfg) q->cfg = *cfg;
    if (q->cfg.connect_timeout_ms <= 0) q->cfg.connect_timeout_ms = 2000;
    if (q->cfg.io_timeout_ms <= 0) q->cfg.io_timeout_ms = 5000;
    if (q->cfg.retry_ms == 0) q->cfg.retry_ms = 30000;
    char msg[200];
    if (!dial(q, msg, sizeof msg)) {
        kiln_queue_free(q);
        return kiln_error(KILN_ERR_IO, "queue: cannot connect to Redis at %s:%d: %s", host, port, msg);
    }
    *out = q;
    return KILN_OK;
}

void kiln_queue_free(kiln_queue *q)
{
    if (q == NULL) return;
    if (q->c) redisFree(q->c);
    free(q->host);
    free(q);
}

const char *kiln_queue_server_version(const kiln_queue *q) { return q->version; }
int kiln_queue_reconnects(const kiln_queue *q) { return q->reconnects; }

kiln_status kiln_queue_command(kiln_queue *q, int argc, const char **argv, const size_t *lens, int wait_ms,
                               kiln_queue_reply **out)
{
    *out = NULL;
    size_t stack_lens[32], *owned = NULL;
    if (lens == NULL) {
        size_t *l = argc <= 32 ? stack_lens : (owned = malloc(argc * sizeof *owned));
        if (l == NULL) return kiln_error(KILN_ERR_OOM, "queue: out of host memory");
        for (int i = 0; i < argc; i++) l[i] = strlen(argv[i]);
        lens = l;
    }
    double deadline = now_ms() + (q->cfg.retry_ms > 0 ? q->cfg.retry_ms : 0);
    int backoff = 50;
    char why[200] = "";
    for (;;) {
        if (q->c == NULL && dial(q, why, sizeof why)) q->reconnects++;
        if (q->c) {
            redisSetTimeout(q->c, tv_of(q->cfg.io_timeout_ms + (wait_ms > 0 ? wait_ms : 0)));
            redisReply *r = redisCommandArgv(q->c, argc, argv, lens);
            if (r) {
                kiln_queue_reply *res = calloc(1, sizeof *res);
                kiln_status st = res ? copy_reply(res, r) : kiln_error(KILN_ERR_OOM, "queue: out of host memory");
                freeReplyObject(r);
                free(owned);
                if (st != KILN_OK) { kiln_queue_reply_free(res); return st; }
                *out = res;
                return KILN_OK;
            }
            /* the connection is unusable after any client-side error: drop it */
            snprintf(why, sizeof why, "%s", q->c->errstr);
            redisFree(q->c);
            q->c = NULL;
        }
        if (q->cfg.retry_ms < 0 || now_ms() + backoff > deadline) break;
        sleep_ms(backoff);
        backoff = backoff * 2 > 2000 ? 2000 : backoff * 2;
    }
    free(owned);
    return kiln_error(KILN_ERR_IO, "queue: Redis at %s:%d: %s (%s)", q->host, q->port, why,
                      q->cfg.retry_ms < 0 ? "not retried" : "gave up reconnecting");
}

#endif /* KILN_HIREDIS */

/* ---- stream helpers (plain argv builders, the same with or without hiredis) ---- */

static int version_at_least(const kiln_queue *q, int major, int minor)
{
    int ma = 0, mi = 0;
    if (sscanf(kiln_queue_server_version(q), "%d.%d", &ma, &mi) < 1) return 1; /* unknown: assume new */
    return ma > major || (ma == major && mi >= minor);
}

kiln_status kiln_queue_xadd(kiln_queue *q, const char *stream, int nfields, const char **fields,
                            const size_t *lens, kiln_queue_reply **out)
{
    int argc = 3 + nfields * 2;
    const char **argv = malloc(argc * sizeof *argv);
    size_t *l = malloc(argc * sizeof *l);
    if (argv == NULL || l == NULL) {
        free(argv); free(l);
        return kiln_error(KILN_ERR_OOM, "queue: out of host memory");
    }
    argv[0] = "XADD"; argv[1] = stream; argv[2] = "*";
    for (int i = 0; i < 3; i++) l[i] = strlen(argv[i]);
    for (int i = 0; i < nfields * 2; i++) {
        argv[3 + i] = fields[i];
        l[3 + i] = lens ? lens[i] : strlen(fields[i]);
    }
    kiln_status st = kiln_queue_command(q, argc, argv, l, 0, out);
    free(argv); free(l);
    return st;
}

kiln_status kiln_queue_xreadgroup(kiln_queue *q, const char *group, const char *consumer, int count,
                                  int block_ms, int nstreams, const char **streams, const char **ids,
                                  kiln_queue_reply **out)
{
    int argc = 0;
    const char **argv = malloc((9 + 2 * nstreams) * sizeof *argv);
    if (argv == NULL) return kiln_error(KILN_ERR_OOM, "queue: out of host memory");
    char cnt[24], blk[24];
    argv[argc++] = "XREADGROUP"; argv[argc++] = "GROUP"; argv[argc++] = group; argv[argc++] = consumer;
    if (count > 0) { snprintf(cnt, sizeof cnt, "%d", count); argv[argc++] = "COUNT"; argv[argc++] = cnt; }
    if (block_ms >= 0) { snprintf(blk, sizeof blk, "%d", block_ms); argv[argc++] = "BLOCK"; argv[argc++] = blk; }
    argv[argc++] = "STREAMS";
    for (int i = 0; i < nstreams; i++) argv[argc++] = streams[i];
    for (int i = 0; i < nstreams; i++) argv[argc++] = ids[i];
    kiln_status st = kiln_queue_command(q, argc, argv, NULL, block_ms > 0 ? block_ms : 0, out);
    free(argv);
    return st;
}

kiln_status kiln_queue_xack(kiln_queue *q, const char *stream, const char *group, int nids, const char **ids,
                            kiln_queue_reply **out)
{
    const char **argv = malloc((3 + nids) * sizeof *argv);
    if (argv == NULL) return kiln_error(KILN_ERR_OOM, "queue: out of host memory");
    argv[0] = "XACK"; argv[1] = stream; argv[2] = group;
    for (int i = 0; i < nids; i++) argv[3 + i] = ids[i];
    kiln_status st = kiln_queue_command(q, 3 + nids, argv, NULL, 0, out);
    free(argv);
    return st;
}

kiln_status kiln_queue_xpending(kiln_queue *q, const char *stream, const char *group, const char *start,
                                const char *end, int count, const char *consumer, kiln_queue_reply **out)
{
    char cnt[24];
    snprintf(cnt, sizeof cnt, "%d", count);
    const char *argv[7] = {"XPENDING", stream, group, start, end, cnt, consumer};
    int argc = count > 0 ? (consumer ? 7 : 6) : 3;
    return kiln_queue_command(q, argc, argv, NULL, 0, out);
}

/* XPENDING (the oldest count entries idle at least min_idle_ms) then XCLAIM of
 * those: what XAUTOCLAIM does in one step on Redis >= 6.2. */
static kiln_status emulate_autoclaim(kiln_queue *q, const char *stream, const char *group, const char *consumer,
                                     long long min_idle_ms, const char *start, int count, kiln_queue_reply **out)
{
    char cnt[24], idle[24];
    snprintf(cnt, sizeof cnt, "%d", count > 0 ? count : 100);
    snprintf(idle, sizeof idle, "%lld", min_idle_ms);
    const char *pargv[6] = {"XPENDING", stream, group, start, "+", cnt};
    kiln_queue_reply *p;
    kiln_status st = kiln_queue_command(q, 6, pargv, NULL, 0, &p);
    if (st != KILN_OK) return st;
    if (p->kind != KILN_QUEUE_ARRAY) { *out = p; return KILN_OK; }
    const char **argv = malloc((5 + p->n) * sizeof *argv);
    if (argv == NULL) { kiln_queue_reply_free(p); return kiln_error(KILN_ERR_OOM, "queue: out of host memory"); }
    int argc = 0;
    argv[argc++] = "XCLAIM"; argv[argc++] = stream; argv[argc++] = group; argv[argc++] = consumer;
    argv[argc++] = idle;
    for (size_t i = 0; i < p->n; i++) {
        const kiln_queue_reply *row = &p->items[i];
        if (row->kind == KILN_QUEUE_ARRAY && row->n >= 3 && row->items[2].integer >= min_idle_ms)
            argv[argc++] = row->items[0].str;
    }
    kiln_queue_reply *claimed = NULL;
    if (argc > 5) st = kiln_queue_command(q, argc, argv, NULL, 0, &claimed);
    free(argv);
    kiln_queue_reply_free(p);
    if (st != KILN_OK) return st;
    kiln_queue_reply *res = calloc(1, sizeof *res);
    kiln_queue_reply *items = calloc(2, sizeof *items);
    char *zero = strdup("0-0");
    if (res == NULL || items == NULL || zero == NULL) {
        free(res); free(items); free(zero); kiln_queue_reply_free(claimed);
        return kiln_error(KILN_ERR_OOM, "queue: out of host memory");
    }
    res->kind = KILN_QUEUE_ARRAY; res->n = 2; res->items = items;
    items[0].kind = KILN_QUEUE_STRING; items[0].str = zero; items[0].len = 3;
    if (claimed) { items[1] = *claimed; free(claimed); }
    else items[1].kind = KILN_QUEUE_ARRAY;
    *out = res;
    return KILN_OK;
}

kiln_status kiln_queue_xautoclaim(kiln_queue *q, const char *stream, const char *group, const char *consumer,
                                  long long min_idle_ms, const char *start, int count, kiln_queue_reply **out)
{
    if (!version_at_least(q, 6, 2))
        return emulate_autoclaim(q, stream, group, consumer, min_idle_ms, start, count, out);
    char cnt[24], idle[24];
    snprintf(cnt, sizeof cnt, "%d", count > 0 ? count : 100);
    snprintf(idle, sizeof idle, "%lld", min_idle_ms);
    const char *argv[8] = {"XAUTOCLAIM", stream, group, consumer, idle, start, "COUNT", cnt};
    return kiln_queue_command(q, 8, argv, NULL, 0, out);
}
