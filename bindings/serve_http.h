/* serve_http.h - the HTTP + WebSocket server of `kiln serve`, part of the kiln program
 * (not of libkiln: a host embedding the library does not take on a web server). */
#ifndef KILN_SERVE_HTTP_H
#define KILN_SERVE_HTTP_H

#include "lua.h"

#include "kiln.h"

/* Makes require "kiln.serve_http" give the server's Lua module in L (package.preload);
 * its previews come from ctx's preview callback while a server runs. */
void serve_http_preload(lua_State *L, kiln_ctx *ctx);

#endif
