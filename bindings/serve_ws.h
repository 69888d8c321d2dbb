/* serve_ws.h - RFC 6455 pieces of kiln serve's WebSocket: the handshake's accept key
 * and server frame headers (the connection loop is serve_http.c's). */
#ifndef KILN_SERVE_WS_H
#define KILN_SERVE_WS_H

#include <stddef.h>

/* ORDER WS_OPCODE (RFC 6455 section 5.2) */
enum { SERVE_WS_TEXT = 1, SERVE_WS_BINARY = 2, SERVE_WS_CLOSE = 8, SERVE_WS_PING = 9 };

/* Sec-WebSocket-Accept for a client's Sec-WebSocket-Key: base64(SHA-1(key + GUID)),
 * 28 characters and a NUL. Returns 0 for a key that is not 24 base64 characters. */
int serve_ws_accept_key(const char *key, char out[29]);

/* The header of an unmasked final server frame of n payload bytes; returns its length
 * (2, 4 or 10). */
size_t serve_ws_frame_header(unsigned char out[10], int opcode, size_t n);

#endif
