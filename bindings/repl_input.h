/* repl_input.h - line input of the kiln program's REPL: readline (history, name
 * completion) on a terminal when built with KILN_READLINE, plain lines otherwise. */
#ifndef KILN_REPL_INPUT_H
#define KILN_REPL_INPUT_H

#include "lua.h"

/* Whether stdin is a terminal (asked once). */
int repl_input_is_tty(void);
/* Loads the history ($KILN_HISTORY, else ~/.kiln_history; empty: none) and completes
 * names from L's globals. */
void repl_input_init(lua_State *L);
/* One line without its newline (malloc'd), or NULL at the end of input. Without a
 * terminal (a pipe, a file) nothing is prompted. Ctrl-C at a readline prompt clears
 * the line. */
char *repl_input_read(const char *prompt);
/* Adds a statement to the history (terminal only). */
void repl_input_save(const char *line);
/* Appends this session's lines to the history file. */
void repl_input_done(void);

/* sigaction with an empty mask and no flags (signal()'s semantics vary). */
void repl_set_signal(int sig, void (*handler)(int));

#endif
