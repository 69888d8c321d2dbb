/* serve_ws.c - what kiln serve's WebSocket needs of RFC 6455 besides the socket: the
 * handshake's accept key (SHA-1, FIPS 180-4, written here for these 60 bytes rather
 * than pulling in a crypto library) and the header of a server frame. Server frames
 * are never masked; kiln reads nothing a client sends after the handshake. */
#include "serve_ws.h"

#include <stdint.h>
#include <string.h>

static uint32_t rol(uint32_t x, int n) { return x << n | x >> (32 - n); }

/* SHA-1 of a message of at most 119 bytes (two blocks): enough for key + GUID. */
static void sha1_short(const unsigned char *msg, size_t len, unsigned char out[20])
{
    unsigned char m[128];
    size_t total = len + 9 <= 64 ? 64 : 128;
    memset(m, 0, sizeof m);
    memcpy(m, msg, len);
    m[len] = 0x80;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) m[total - 1 - i] = (unsigned char)(bits >> (8 * i));
    uint32_t h[5] = {0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0};
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
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 4; j++) out[4 * i + j] = (unsigned char)(h[i] >> (24 - 8 * j));
}

int serve_ws_accept_key(const char *key, char out[29])
{
    static const char guid[] = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t n = key ? strlen(key) : 0;
    if (n != 24) return 0;
    for (size_t i = 0; i < n; i++)
        if (!strchr(b64, key[i]) && key[i] != '=') return 0;
    unsigned char msg[64], d[20];
    memcpy(msg, key, 24);
    memcpy(msg + 24, guid, 36);
    sha1_short(msg, 60, d);
    size_t o = 0;
    for (size_t i = 0; i < 20; i += 3) {
        uint32_t v = (uint32_t)d[i] << 16 | (i + 1 < 20 ? (uint32_t)d[i + 1] << 8 : 0) | (i + 2 < 20 ? d[i + 2] : 0);
        out[o++] = b64[v >> 18 & 63];
        out[o++] = b64[v >> 12 & 63];
        out[o++] = i + 1 < 20 ? b64[v >> 6 & 63] : '=';
        out[o++] = i + 2 < 20 ? b64[v & 63] : '=';
    }
    out[o] = 0;
    return 1;
}

size_t serve_ws_frame_header(unsigned char out[10], int opcode, size_t n)
{
    out[0] = (unsigned char)(0x80 | (opcode & 15));
    if (n < 126) {
        out[1] = (unsigned char)n;
        return 2;
    }
    if (n <= 0xFFFF) {
        out[1] = 126;
        out[2] = (unsigned char)(n >> 8);
        out[3] = (unsigned char)n;
        return 4;
    }
    out[1] = 127;
    for (int i = 0; i < 8; i++) out[2 + i] = (unsigned char)((uint64_t)n >> (8 * (7 - i)));
    return 10;
}
