/* l_parts.h - the openers of the kiln module's parts (one per binding file, each
 * adding its functions to the kiln table; luaopen_kiln itself is kiln.h's), and the
 * progress host an embedding context installs. The shared helpers are l_aux.h's. */
#ifndef KILN_L_PARTS_H
#define KILN_L_PARTS_H

#include "l_aux.h"
#include "kiln.h" /* luaopen_kiln, the Lua module entry point, is public */

/* Sub-module openers: each adds its functions to the kiln table at -1. */
void l_open_runtime(lua_State *L); /* version, devices, threads, time, isatty, quiet, format_bytes */
void l_open_tensor(lua_State *L);
void l_open_nn(lua_State *L);
void l_open_io(lua_State *L);
void l_open_mem(lua_State *L);
void l_open_progress(lua_State *L); /* kiln.progress, on_progress, cancel, cancelled, preview_* */
void l_open_model(lua_State *L);
void l_open_trace(lua_State *L); /* after l_open_mem: adds to kiln.mem */
void l_open_mem_plot(lua_State *L); /* after l_open_mem: kiln.mem.plot, timeline, stage_table */
void l_open_tile(lua_State *L);  /* kiln.tile; adds kiln.mem.estimate */
void l_open_tokenizer(lua_State *L); /* kiln.tokenizer */
void l_open_t5(lua_State *L);        /* kiln._t5_tokenize (kiln.t5.tokenize is t5.lua's) */
void l_open_json(lua_State *L);      /* kiln.json */
void l_open_fault(lua_State *L);     /* kiln.fault: the tests' fault injection */
void l_open_config(lua_State *L);    /* kiln.configure, parse_size; the pressure hook (l_config.h) */
void l_open_queue(lua_State *L);     /* kiln.queue: the Redis client of `kiln batch` */
void l_open_meta(lua_State *L);      /* after l_open_mem: kiln.mem.meta_begin/meta_end (dry runs) */
void l_open_suspend(lua_State *L);   /* after l_open_mem: kiln.suspend_point, suspend_stats;
                                        adds kiln.mem.budget_watch, evict */
/* The gate a host parks a run through (kiln_suspend) and its cancel test, for
 * kiln.suspend_point (gate NULL: none). */
struct kiln_gate;
void l_suspend_set_gate(lua_State *L, struct kiln_gate *gate, int (*stop)(void *ud), void *ud);

/* An embedding host's progress and cancel (bindings/embed.c): kiln.progress reports
 * to it and kiln.cancelled() asks it. The struct outlives the host's use of L. */
typedef struct {
    void (*progress)(void *ud, int step, int total, const char *message);
    int (*cancelled)(void *ud);
    void (*cancel)(void *ud, int on); /* kiln.cancel(on) from a script */
    void *ud;
    /* kiln.preview_image(step, total, img): planar f32 [channels, height, width] of the
       batch's first image, valid during the call; NULL: no preview callback */
    void (*preview)(void *ud, int step, int total, const float *planar, int channels, int height, int width);
    int (*preview_every)(void *ud); /* N of "every N steps"; 0: no preview callback */
} l_progress_host;
void l_progress_set_host(lua_State *L, const l_progress_host *host); /* NULL: none */

#endif
