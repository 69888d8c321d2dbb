/* queue.h - kiln's client of a Redis server for job queues on Redis Streams
 * (hiredis underneath when kiln is built with it): connect with timeouts, the stream
 * commands a batch farm needs, and reconnect with backoff when the server goes away. */
#ifndef KILN_QUEUE_H
#define KILN_QUEUE_H

#include "status.h"

#include <stddef.h>

typedef struct kiln_queue kiln_queue;

/* ORDER QUEUE_REPLY: as Redis's reply types */
typedef enum {
    KILN_QUEUE_NIL,
    KILN_QUEUE_INT,
    KILN_QUEUE_STRING,
    KILN_QUEUE_STATUS, /* a simple string such as "OK" */
    KILN_QUEUE_ERROR,  /* the server refused the command: str is its message */
    KILN_QUEUE_ARRAY,
} kiln_queue_reply_kind;

/* A reply, copied out of the client so it outlives the next command. */
typedef struct kiln_queue_reply {
    kiln_queue_reply_kind kind;
    long long integer;
    char *str; /* NUL-terminated; len bytes (may hold NULs) */
    size_t len;
    size_t n;  /* array elements */
    struct kiln_queue_reply *items;
} kiln_queue_reply;

/* Zero values take the defaults (connect 2000 ms, I/O 5000 ms, retry 30000 ms). */
typedef struct {
    int connect_timeout_ms;
    int io_timeout_ms;
    /* how long a command keeps reconnecting (backoff from 50 ms doubling to 2 s)
       when the server is unreachable before it fails with KILN_ERR_IO; -1: no retry */
    int retry_ms;
} kiln_queue_config;

/* 1 when this build talks to Redis; 0 when built without hiredis (every other
 * function then fails with KILN_ERR_UNSUPPORTED saying what to install). */
int kiln_queue_available(void);

/* Connects (the first connection is not retried: a wrong address is reported at
 * once). cfg may be NULL. *out is the caller's, freed with kiln_queue_free. */
kiln_status kiln_queue_new(kiln_queue **out, const char *host, int port, const kiln_queue_config *cfg);
void kiln_queue_free(kiln_queue *q);
/* "major.minor.patch" of the server as read at connect. */
const char *kiln_queue_server_version(const kiln_queue *q);
/* Times the client reconnected since it was opened. */
int kiln_queue_reconnects(const kiln_queue *q);

/* Runs one command (argv with lengths; lens NULL: strlen). wait_ms is time the
 * server may legitimately take on top of the I/O timeout (a BLOCK). A connection lost
 * mid-command is reopened and the command sent again, so a command may run twice
 * (at-least-once: callers make their commands idempotent or tolerate it). A server
 * error is a reply of kind KILN_QUEUE_ERROR, not a failure. *out: free with
 * kiln_queue_reply_free. */
kiln_status kiln_queue_command(kiln_queue *q, int argc, const char **argv, const size_t *lens, int wait_ms,
                               kiln_queue_reply **out);
void kiln_queue_reply_free(kiln_queue_reply *r);

/* Stream helpers over kiln_queue_command; replies as Redis gives them, except that
 * xautoclaim on a server older than 6.2 is emulated with XPENDING + XCLAIM (then the
 * reply's cursor is always "0-0" and there is no third element). */
kiln_status kiln_queue_xadd(kiln_queue *q, const char *stream, int nfields, const char **fields,
                            const size_t *lens, kiln_queue_reply **out);
kiln_status kiln_queue_xreadgroup(kiln_queue *q, const char *group, const char *consumer, int count,
                                  int block_ms, int nstreams, const char **streams, const char **ids,
                                  kiln_queue_reply **out);
kiln_status kiln_queue_xack(kiln_queue *q, const char *stream, const char *group, int nids, const char **ids,
                            kiln_queue_reply **out);
kiln_status kiln_queue_xautoclaim(kiln_queue *q, const char *stream, const char *group, const char *consumer,
                                  long long min_idle_ms, const char *start, int count, kiln_queue_reply **out);
/* Extended form when count > 0 (one row per entry: id, consumer, idle ms,
 * deliveries), the summary form when count <= 0. consumer may be NULL. */
kiln_status kiln_queue_xpending(kiln_queue *q, const char *stream, const char *group, const char *start,
                                const char *end, int count, const char *consumer, kiln_queue_reply **out);

#endif
