/* serve_client.c - the test client of `kiln serve` (tests/lua/test_serve.lua): plain
 * HTTP/1.1 requests and an RFC 6455 WebSocket client (handshake with the accept key
 * checked by our own SHA-1, masked client frames, server frames of any length), so
 * that `make test` needs neither Python nor curl. Independent of kiln's code.
 *
 *   serve_client http METHOD URL [-H HEADER]... [-d BODY | -f FILE] [-o OUT]
 *       prints "STATUS n" on stdout (and the body, unless -o writes it to OUT)
 *   serve_client ws URL [-H HEADER]... [--post URL FILE] [--until TEXT] [--close-after TEXT]
 *                [--preview OUT] [--timeout S]
 *       prints each message: "TEXT {...}" or "BINARY n type fmt"; --post sends a
 *       request once the socket is open (its answer printed as "POSTED n BODY");
 *       stops after a text message containing --until, or closes the socket at once
 *       after one containing --close-after; --preview writes the first binary
 *       frame's image bytes.
 *   serve_client load METHOD URL CLIENTS REQUESTS [-H HEADER]... [-d BODY | -f FILE] [--timeout S]
 *       CLIENTS threads at once, each sending REQUESTS requests one after the other;
 *       prints "REQ client n status latency_ms server-timing" per request (the latency
 *       from connecting to the answer's last byte, the answer's Server-Timing header)
 *       and "WALL s" at the end.
 * Exit status 0, or 1 with a message on stderr. */
#define _GNU_SOURCE /* strcasestr */

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_HEADERS 16

static void die(const char *what)
{
    fprintf(stderr, "serve_client: %s\n", what);
    exit(1);
}

/* ---------------------------------------------------------------- SHA-1, base64 */

static uint32_t rol(uint32_t x, int n) { return x << n | x >> (32 - n); }

static void sha1(const unsigned char *msg, size_t len, unsigned char out[20])
{
    uint32_t h[5] = {0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0};
    size_t total = ((len + 8) / 64 + 1) * 64;
    unsigned char *m = calloc(total, 1);
    if (!m) die("out of memory");
    memcpy(m, msg, len);
    m[len] = 0x80;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) m[total - 1 - i] = (unsigned char)(bits >> (8 * i));
    for (size_t off = 0; off < total; off += 64) {
        uint32_t w[80];
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)m[off + 4 * i] << 24 | (uint32_t)m[off + 4 * i + 1] << 16 |
                   (uint32_t)m[off + 4 * i + 2] << 8 | m[off + 4 * i + 3];
        for (int i = 16; i < 80; i++) w[i] = rol(w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16], 1);
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4];
        for (int i = 0; i < 80; i++) {
            uint32_t f, k;
            if (i < 20) { f = (b & c) | (~b & d); k = 0x5A827999; }
            else if (i < 40) { f = b ^ c ^ d; k = 0x6ED9EBA1; }
            else if (i < 60) { f = (b & c) | (b & d) | (c & d); k = 0x8F1BBCDC; }
            else { f = b ^ c ^ d; k = 0xCA62C1D6; }
            uint32_t t = rol(a, 5) + f + e + k + w[i];
            e = d; d = c; c = rol(b, 30); b = a; a = t;
        }
        h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e;
    }
    free(m);
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 4; j++) out[4 * i + j] = (unsigned char)(h[i] >> (24 - 8 * j));
}

static void base64(const unsigned char *s, size_t n, char *out)
{
    static const char t[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0) | (i + 2 < n ? s[i + 2] : 0);
        out[o++] = t[v >> 18 & 63];
        out[o++] = t[v >> 12 & 63];
        out[o++] = i + 1 < n ? t[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? t[v & 63] : '=';
    }
    out[o] = 0;
}

/* ---------------------------------------------------------------- sockets */

typedef struct { char host[256], port[16], path[2048]; } url;

static void parse_url(const char *s, url *u)
{
    const char *p = strstr(s, "://");
    p = p ? p + 3 : s;
    const char *slash = strchr(p, '/');
    size_t hl = slash ? (size_t)(slash - p) : strlen(p);
    char hostport[256];
    if (hl >= sizeof hostport) die("URL too long");
    memcpy(hostport, p, hl);
    hostport[hl] = 0;
    char *colon = strrchr(hostport, ':');
    if (colon) { *colon = 0; snprintf(u->port, sizeof u->port, "%s", colon + 1); }
    else snprintf(u->port, sizeof u->port, "80");
    snprintf(u->host, sizeof u->host, "%s", hostport);
    snprintf(u->path, sizeof u->path, "%s", slash ? slash : "/");
}

static int dial(const url *u)
{
    struct addrinfo hints, *res;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(u->host, u->port, &hints, &res) != 0) die("cannot resolve the host");
    int fd = -1;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) die("cannot connect");
    return fd;
}

static void send_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("send failed");
        p += w;
        n -= (size_t)w;
    }
}

static double deadline;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Reads exactly n bytes (0: the peer closed first). */
static int recv_all(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n) {
        int left = (int)((deadline - now_s()) * 1000);
        if (left <= 0) die("timed out");
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, left) <= 0) continue;
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return 0;
        p += r;
        n -= (size_t)r;
    }
    return 1;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open the body file");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) die("cannot read the body file");
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* One request; returns the status, the body in *body (malloc'd). The server closes
 * the connection after the answer (Connection: close), so the body is read to EOF
 * when no Content-Length is given. */
static int http_request(const char *method, const char *target, const char **headers, int nh, const char *body,
                        size_t blen, char **out, size_t *outlen, char *timing, size_t tcap)
{
    url u;
    parse_url(target, &u);
    int fd = dial(&u);
    char head[8192];
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\nContent-Length: %zu\r\n",
                     method, u.path, u.host, u.port, blen);
    for (int i = 0; i < nh; i++) n += snprintf(head + n, sizeof head - (size_t)n, "%s\r\n", headers[i]);
    n += snprintf(head + n, sizeof head - (size_t)n, "\r\n");
    send_all(fd, head, (size_t)n);
    if (blen) send_all(fd, body, blen);
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len == cap) { cap *= 2; buf = realloc(buf, cap); if (!buf) die("out of memory"); }
        int left = (int)((deadline - now_s()) * 1000);
        if (left <= 0) die("timed out waiting for the answer");
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, left) <= 0) continue;
        ssize_t r = recv(fd, buf + len, cap - len, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        len += (size_t)r;
    }
    close(fd);
    char *end = NULL;
    for (size_t i = 0; i + 3 < len; i++)
        if (memcmp(buf + i, "\r\n\r\n", 4) == 0) { end = buf + i; break; }
    if (!end || len < 12 || strncmp(buf, "HTTP/1.", 7) != 0) die("not an HTTP answer");
    int status = atoi(buf + 9);
    size_t hl = (size_t)(end - buf) + 4;
    if (timing && tcap) { /* the Server-Timing header's value, if any */
        timing[0] = 0;
        *end = 0;
        const char *t = strcasestr(buf, "\r\nServer-Timing:");
        if (t) {
            t += 16;
            while (*t == ' ') t++;
            snprintf(timing, tcap, "%.*s", (int)strcspn(t, "\r\n"), t);
        }
    }
    *outlen = len - hl;
    *out = malloc(*outlen + 1);
    memcpy(*out, buf + hl, *outlen);
    (*out)[*outlen] = 0;
    free(buf);
    return status;
}

/* ---------------------------------------------------------------- WebSocket */

static void ws_send_frame(int fd, int opcode, const unsigned char *data, size_t n)
{
    unsigned char h[14];
    size_t hl = 0;
    h[hl++] = (unsigned char)(0x80 | opcode);
    if (n < 126) h[hl++] = (unsigned char)(0x80 | n);
    else if (n < 65536) { h[hl++] = 0x80 | 126; h[hl++] = (unsigned char)(n >> 8); h[hl++] = (unsigned char)n; }
    else {
        h[hl++] = 0x80 | 127;
        for (int i = 7; i >= 0; i--) h[hl++] = (unsigned char)((uint64_t)n >> (8 * i));
    }
    unsigned char mask[4] = {0x12, 0x34, 0x56, 0x78};
    memcpy(h + hl, mask, 4);
    hl += 4;
    send_all(fd, h, hl);
    unsigned char *m = malloc(n + 1);
    for (size_t i = 0; i < n; i++) m[i] = data[i] ^ mask[i & 3];
    if (n) send_all(fd, m, n);
    free(m);
}

/* ---------------------------------------------------------------- load */

typedef struct loader {
    pthread_t th;
    int index, requests;
    const char *method, *url, *body;
    const char **headers;
    int nh;
    size_t blen;
    char *lines; /* the REQ lines, printed once every thread is done */
    size_t len, cap;
} loader;

static void *load_thread(void *arg)
{
    loader *l = arg;
    for (int i = 0; i < l->requests; i++) {
        char timing[512], line[700];
        char *out;
        size_t olen;
        double t0 = now_s();
        int st = http_request(l->method, l->url, l->headers, l->nh, l->body, l->blen, &out, &olen, timing, sizeof timing);
        double ms = (now_s() - t0) * 1e3;
        free(out);
        int n = snprintf(line, sizeof line, "REQ %d %d %d %.3f %s\n", l->index, i + 1, st, ms, timing[0] ? timing : "-");
        if (l->len + (size_t)n + 1 > l->cap) {
            l->cap = (l->cap + (size_t)n + 1) * 2;
            l->lines = realloc(l->lines, l->cap);
            if (!l->lines) die("out of memory");
        }
        memcpy(l->lines + l->len, line, (size_t)n + 1);
        l->len += (size_t)n;
    }
    return NULL;
}

static int load(const char *method, const char *url, int clients, int requests, const char **headers, int nh,
                const char *body, size_t blen)
{
    if (clients < 1 || requests < 1) die("load: CLIENTS and REQUESTS must be at least 1");
    loader *ls = calloc((size_t)clients, sizeof *ls);
    if (!ls) die("out of memory");
    double t0 = now_s();
    for (int c = 0; c < clients; c++) {
        ls[c] = (loader){.index = c + 1, .requests = requests, .method = method, .url = url, .body = body,
                         .headers = headers, .nh = nh, .blen = blen};
        if (pthread_create(&ls[c].th, NULL, load_thread, &ls[c]) != 0) die("load: cannot start a thread");
    }
    for (int c = 0; c < clients; c++) pthread_join(ls[c].th, NULL);
    double wall = now_s() - t0;
    for (int c = 0; c < clients; c++) {
        if (ls[c].lines) fputs(ls[c].lines, stdout);
        free(ls[c].lines);
    }
    printf("WALL %.6f\n", wall);
    free(ls);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) die("usage: serve_client http METHOD URL ... | ws URL ...");
    const char *headers[MAX_HEADERS];
    int nh = 0;
    const char *body = NULL, *body_file = NULL, *outpath = NULL, *post_url = NULL, *post_file = NULL;
    const char *until = NULL, *close_after = NULL, *preview = NULL;
    double timeout = 60;
    int is_http = strcmp(argv[1], "http") == 0, is_load = strcmp(argv[1], "load") == 0;
    if (!is_http && !is_load && strcmp(argv[1], "ws") != 0) die("the first argument is http, ws or load");
    int pos = is_load ? 6 : is_http ? 4 : 3;
    if (argc < pos) die("missing arguments");
    for (int i = pos; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) die("an option without its value");
        if (strcmp(a, "-H") == 0) { if (nh < MAX_HEADERS) headers[nh++] = v; }
        else if (strcmp(a, "-d") == 0) body = v;
        else if (strcmp(a, "-f") == 0) body_file = v;
        else if (strcmp(a, "-o") == 0) outpath = v;
        else if (strcmp(a, "--until") == 0) until = v;
        else if (strcmp(a, "--close-after") == 0) close_after = v;
        else if (strcmp(a, "--preview") == 0) preview = v;
        else if (strcmp(a, "--timeout") == 0) timeout = atof(v);
        else if (strcmp(a, "--post") == 0) {
            if (i + 2 >= argc) die("--post URL FILE");
            post_url = v;
            post_file = argv[i + 2];
            i++;
        } else die("unknown option");
        i++;
    }
    deadline = now_s() + timeout;
    if (is_load) {
        size_t blen = body ? strlen(body) : 0;
        char *fbody = NULL;
        if (body_file) { fbody = read_file(body_file, &blen); body = fbody; }
        int rc = load(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]), headers, nh, body, blen);
        free(fbody);
        return rc;
    }
    if (is_http) {
        size_t blen = body ? strlen(body) : 0;
        char *fbody = NULL;
        if (body_file) { fbody = read_file(body_file, &blen); body = fbody; }
        char *out;
        size_t olen;
        int st = http_request(argv[2], argv[3], headers, nh, body, blen, &out, &olen, NULL, 0);
        printf("STATUS %d\n", st);
        if (outpath) {
            FILE *f = fopen(outpath, "wb");
            if (!f || fwrite(out, 1, olen, f) != olen) die("cannot write -o");
            fclose(f);
        } else {
            fwrite(out, 1, olen, stdout);
            printf("\n");
        }
        free(out);
        free(fbody);
        return 0;
    }

    /* the handshake */
    url u;
    parse_url(argv[2], &u);
    int fd = dial(&u);
    unsigned char keybytes[16];
    srand((unsigned)time(NULL) ^ (unsigned)getpid());
    for (int i = 0; i < 16; i++) keybytes[i] = (unsigned char)(rand() & 255);
    char key[32];
    base64(keybytes, 16, key);
    char req[4096];
    int n = snprintf(req, sizeof req,
                     "GET %s HTTP/1.1\r\nHost: %s:%s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n",
                     u.path, u.host, u.port, key);
    for (int i = 0; i < nh; i++) n += snprintf(req + n, sizeof req - (size_t)n, "%s\r\n", headers[i]);
    n += snprintf(req + n, sizeof req - (size_t)n, "\r\n");
    send_all(fd, req, (size_t)n);
    char resp[4096];
    size_t rl = 0;
    while (rl < sizeof resp - 1) {
        if (!recv_all(fd, resp + rl, 1)) die("the server closed during the handshake");
        rl++;
        if (rl >= 4 && memcmp(resp + rl - 4, "\r\n\r\n", 4) == 0) break;
    }
    resp[rl] = 0;
    if (strncmp(resp, "HTTP/1.1 101", 12) != 0) {
        printf("HANDSHAKE %.*s\n", (int)strcspn(resp, "\r\n"), resp);
        return 1;
    }
    char concat[128];
    snprintf(concat, sizeof concat, "%s258EAFA5-E914-47DA-95CA-C5AB0DC85B11", key);
    unsigned char digest[20];
    sha1((unsigned char *)concat, strlen(concat), digest);
    char want[40];
    base64(digest, 20, want);
    char *acc = strcasestr(resp, "Sec-WebSocket-Accept:");
    if (!acc) die("no Sec-WebSocket-Accept in the handshake");
    acc += 21;
    while (*acc == ' ') acc++;
    if (strncmp(acc, want, strlen(want)) != 0) die("wrong Sec-WebSocket-Accept");
    printf("OPEN\n");
    fflush(stdout);

    if (post_url) {
        size_t blen;
        char *b = read_file(post_file, &blen), *out;
        size_t olen;
        int st = http_request("POST", post_url, headers, nh, b, blen, &out, &olen, NULL, 0);
        printf("POSTED %d %s\n", st, out);
        fflush(stdout);
        free(b);
        free(out);
    }

    int previews = 0;
    for (;;) {
        unsigned char h[2];
        if (!recv_all(fd, h, 2)) die("the server closed the socket");
        int opcode = h[0] & 15, masked = h[1] & 0x80;
        uint64_t len = h[1] & 127;
        if (len == 126) {
            unsigned char e[2];
            if (!recv_all(fd, e, 2)) die("closed");
            len = (uint64_t)e[0] << 8 | e[1];
        } else if (len == 127) {
            unsigned char e[8];
            if (!recv_all(fd, e, 8)) die("closed");
            len = 0;
            for (int i = 0; i < 8; i++) len = len << 8 | e[i];
        }
        if (masked) die("a server frame must not be masked (RFC 6455 5.1)");
        if (len > (64u << 20)) die("frame too large");
        unsigned char *p = malloc((size_t)len + 1);
        if (len && !recv_all(fd, p, (size_t)len)) die("closed in a frame");
        p[len] = 0;
        if (!(h[0] & 0x80)) die("fragmented frames are not expected from kiln");
        if (opcode == 1) {
            printf("TEXT %s\n", (char *)p);
            fflush(stdout);
            int stop = until && strstr((char *)p, until);
            if (close_after && strstr((char *)p, close_after)) {
                close(fd); /* gone without a close frame, as a crashed client */
                free(p);
                printf("DISCONNECTED\n");
                fflush(stdout);
                return 0;
            }
            if (stop) { free(p); break; }
        } else if (opcode == 2) {
            unsigned type = len >= 8 ? (unsigned)p[0] << 24 | (unsigned)p[1] << 16 | (unsigned)p[2] << 8 | p[3] : 0;
            unsigned fmt = len >= 8 ? (unsigned)p[4] << 24 | (unsigned)p[5] << 16 | (unsigned)p[6] << 8 | p[7] : 0;
            printf("BINARY %llu %u %u\n", (unsigned long long)len, type, fmt);
            fflush(stdout);
            if (preview && previews++ == 0 && len > 8) {
                FILE *f = fopen(preview, "wb");
                if (!f || fwrite(p + 8, 1, (size_t)len - 8, f) != len - 8) die("cannot write --preview");
                fclose(f);
            }
        } else if (opcode == 8) {
            printf("CLOSED\n");
            free(p);
            return 0;
        } else if (opcode == 9) {
            ws_send_frame(fd, 10, p, (size_t)len);
        }
        free(p);
    }
    ws_send_frame(fd, 8, (const unsigned char *)"\x03\xe8", 2);
    close(fd);
    return 0;
}
