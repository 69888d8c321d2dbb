/* repl_input.c - the kiln REPL's line input: readline with history and completion
 * of Lua names (globals, fields, methods, the kiln modules not loaded yet) when built
 * with KILN_READLINE and stdin is a terminal; plain lines from stdin otherwise. */
#define _POSIX_C_SOURCE 200809L
#include "repl_input.h"
#include "kiln.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lauxlib.h"

#define HISTORY_LINES 1000

void repl_set_signal(int sig, void (*handler)(int))
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
}

/* ---------------------------------------------------------------- completion
 * Plain Lua API; used by the readline section below. */
#if defined(KILN_READLINE)

static const char *const lua_keywords[] = {
    "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if", "in",
    "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while", NULL};

static int is_keyword(const char *s, size_t n)
{
    for (const char *const *k = lua_keywords; *k; k++)
        if (strlen(*k) == n && memcmp(*k, s, n) == 0) return 1;
    return 0;
}

static int is_identifier(const char *s, size_t n)
{
    if (n == 0 || (s[0] >= '0' && s[0] <= '9')) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!(c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')))
            return 0;
    }
    return !is_keyword(s, n);
}

/* Replaces the value on top with the table its metatable lists members in: __index
 * when that is a table, else __methods (kiln.Tensor's __index is a function that
 * reads __methods), else nil. */
static void to_members(lua_State *L)
{
    if (!lua_getmetatable(L, -1)) {
        lua_pop(L, 1);
        lua_pushnil(L);
        return;
    }
    if (lua_getfield(L, -1, "__index") != LUA_TTABLE) {
        lua_pop(L, 1);
        lua_getfield(L, -1, "__methods");
    }
    lua_remove(L, -2); /* metatable */
    lua_remove(L, -2); /* value */
}

/* Adds prefix..key to the set at setidx for each identifier key of the table on top
 * that starts with partial (methods_only: function values only); then goes on with
 * its members table (to_members) while there is one. Pops the table. */
static void add_fields(lua_State *L, int setidx, const char *prefix, const char *partial, int methods_only)
{
    size_t plen = strlen(partial);
    for (int depth = 0; depth < 8 && lua_istable(L, -1); depth++) {
        lua_pushnil(L);
        while (lua_next(L, -2) != 0) {
            size_t klen;
            if (lua_type(L, -2) == LUA_TSTRING && (!methods_only || lua_isfunction(L, -1))) {
                const char *k = lua_tolstring(L, -2, &klen);
                if (klen >= plen && memcmp(k, partial, plen) == 0 && is_identifier(k, klen)) {
                    lua_pushfstring(L, "%s%s", prefix, k);
                    lua_pushboolean(L, 1);
                    lua_rawset(L, setidx);
                }
            }
            lua_pop(L, 1);
        }
        lua_pushvalue(L, -1);
        to_members(L);
        lua_remove(L, -2);
    }
    lua_pop(L, 1);
}

/* Pushes the value of the dotted path text[0, sep) ("kiln.mem") read from the
 * globals; returns 0 (and pushes junk) when it is not a plain path of fields. */
static int push_path(lua_State *L, const char *text, const char *sep)
{
    lua_pushglobaltable(L);
    for (const char *p = text; p < sep;) {
        size_t n = strcspn(p, ".:");
        if ((p[n] == ':' && p + n != sep) || !is_identifier(p, n)) return 0;
        int t = lua_type(L, -1);
        if (t != LUA_TTABLE && t != LUA_TUSERDATA) return 0;
        lua_pushlstring(L, p, n);
        lua_gettable(L, -2);
        lua_remove(L, -2);
        p += n + 1;
    }
    return 1;
}

/* Adds the embedded modules one level below the path text[0, sep) ("kiln." ->
 * "kiln.sample"): the kiln table loads them on first use, so they are not fields yet. */
static void add_embedded(lua_State *L, int setidx, const char *text, const char *sep)
{
    size_t plen = (size_t)(sep - text) + 1; /* with the '.' */
    const char *name;
    for (int i = 0; (name = kiln_script_name_at(i)) != NULL; i++) {
        if (strncmp(name, text, strlen(text)) == 0 && strlen(name) > plen && strchr(name + plen, '.') == NULL) {
            lua_pushstring(L, name);
            lua_pushboolean(L, 1);
            lua_rawset(L, setidx);
        }
    }
}

/* complete(text) -> sorted list of completions of the expression before the cursor:
 * "pri" -> globals and keywords, "kiln.me" -> fields, "t:na" -> methods of t (its own
 * functions and those of its metatable's __index tables; userdata included). Field
 * reads may run __index, so call it protected.                      [-1, +1, e] */
static int l_complete(lua_State *L)
{
    const char *text = luaL_checkstring(L, 1);
    const char *sep = NULL;
    for (const char *p = text; *p; p++)
        if (*p == '.' || *p == ':') sep = p;
    lua_settop(L, 1);
    lua_newtable(L); /* 2: set of candidates */
    if (sep == NULL) {
        lua_pushglobaltable(L);
        add_fields(L, 2, "", text, 0);
        for (const char *const *k = lua_keywords; *k; k++)
            if (strncmp(*k, text, strlen(text)) == 0) {
                lua_pushboolean(L, 1);
                lua_setfield(L, 2, *k);
            }
    } else {
        if (sep > text && push_path(L, text, sep)) {
            if (!lua_istable(L, -1)) to_members(L); /* userdata, string */
            lua_pushlstring(L, text, (size_t)(sep - text) + 1);
            lua_insert(L, -2);
            add_fields(L, 2, lua_tostring(L, -2), sep + 1, *sep == ':');
            if (*sep == '.') add_embedded(L, 2, text, sep);
        }
        lua_settop(L, 2);
    }
    /* set -> sorted list */
    lua_newtable(L);
    lua_Integer n = 0;
    lua_pushnil(L);
    while (lua_next(L, 2) != 0) {
        lua_pop(L, 1);
        lua_pushvalue(L, -1);
        lua_rawseti(L, -3, ++n);
    }
    lua_getglobal(L, "table");
    if (lua_istable(L, -1) && lua_getfield(L, -1, "sort") == LUA_TFUNCTION) {
        lua_pushvalue(L, -3);
        lua_call(L, 1, 0);
    }
    lua_settop(L, 3);
    return 1;
}

#endif /* KILN_READLINE */

/* ---------------------------------------------------------------- line input
 * The only readline-specific code is in this section. */

static int stdin_tty = -1; /* -1: not asked yet */

int repl_input_is_tty(void)
{
    if (stdin_tty < 0) stdin_tty = isatty(STDIN_FILENO);
    return stdin_tty;
}

#if defined(KILN_READLINE)
#include <readline/history.h>
#include <readline/readline.h>

#define COMPLETIONS_KEY "kiln.repl.completions"

static lua_State *rl_L;
static char history_path[4096];
static int history_new; /* lines added this session */
static volatile sig_atomic_t rl_got_sigint;

static char *completion_entry(const char *text, int state)
{
    static lua_Integer next;
    (void)text;
    if (state == 0) next = 1;
    lua_State *L = rl_L;
    int top = lua_gettop(L);
    char *r = NULL;
    if (lua_getfield(L, LUA_REGISTRYINDEX, COMPLETIONS_KEY) == LUA_TTABLE &&
        lua_rawgeti(L, -1, next++) == LUA_TSTRING)
        r = strdup(lua_tostring(L, -1)); /* readline frees it */
    lua_settop(L, top);
    return r;
}

static char **attempted_completion(const char *text, int start, int end)
{
    (void)start;
    (void)end;
    lua_State *L = rl_L;
    int top = lua_gettop(L);
    char **matches = NULL;
    rl_attempted_completion_over = 1; /* never complete file names */
    rl_completion_append_character = '\0';
    lua_pushcfunction(L, l_complete);
    lua_pushstring(L, text);
    if (lua_pcall(L, 1, 1, 0) == LUA_OK) {
        lua_setfield(L, LUA_REGISTRYINDEX, COMPLETIONS_KEY);
        matches = rl_completion_matches(text, completion_entry);
        lua_pushnil(L);
        lua_setfield(L, LUA_REGISTRYINDEX, COMPLETIONS_KEY);
    }
    lua_settop(L, top);
    return matches;
}

/* Ctrl-C at the prompt clears the line (as a shell does) instead of killing kiln. */
static void rl_sigint(int sig)
{
    (void)sig;
    rl_got_sigint = 1;
}

static int rl_signal_hook(void)
{
    if (rl_got_sigint) {
        rl_got_sigint = 0;
        rl_replace_line("", 0);
        fputs("^C", rl_outstream);
        rl_crlf();
        rl_on_new_line();
        rl_redisplay();
    }
    return 0;
}

void repl_input_init(lua_State *L)
{
    static char word_breaks[] = " \t\n\"\\'`@$><=;|&{}()[]+-*/%^#~,";
    if (!repl_input_is_tty()) return;
    rl_L = L;
    rl_readline_name = "kiln";
    rl_completer_word_break_characters = word_breaks;
    rl_attempted_completion_function = attempted_completion;
    rl_catch_signals = 0;
    rl_signal_event_hook = rl_signal_hook;
    using_history();
    stifle_history(HISTORY_LINES);
    const char *env = getenv("KILN_HISTORY");
    const char *home = getenv("HOME");
    if (env != NULL) snprintf(history_path, sizeof history_path, "%s", env);
    else if (home != NULL && *home != '\0') snprintf(history_path, sizeof history_path, "%s/.kiln_history", home);
    if (history_path[0] != '\0') read_history(history_path);
}

static char *input_read(const char *prompt)
{
    repl_set_signal(SIGINT, rl_sigint);
    char *line = readline(prompt);
    repl_set_signal(SIGINT, SIG_DFL);
    return line;
}

void repl_input_save(const char *line)
{
    if (!repl_input_is_tty() || line[0] == '\0') return;
    add_history(line);
    history_new++;
}

void repl_input_done(void)
{
    if (!repl_input_is_tty() || history_path[0] == '\0' || history_new == 0) return;
    /* append this session's lines (other sessions may have written meanwhile) */
    int n = history_new < history_length ? history_new : history_length;
    if (append_history(n, history_path) != 0) write_history(history_path);
    history_truncate_file(history_path, HISTORY_LINES);
}

#define HAVE_INPUT_READ 1
#else
void repl_input_init(lua_State *L) { (void)L; }
void repl_input_save(const char *line) { (void)line; }
void repl_input_done(void) {}
#define HAVE_INPUT_READ 0
static char *input_read(const char *prompt) { (void)prompt; return NULL; }
#endif

/* One line without its newline (malloc'd), or NULL at the end of input. Without a
 * terminal (a pipe, a file) nothing is prompted: output is only results and errors. */
char *repl_input_read(const char *prompt)
{
    if (HAVE_INPUT_READ && repl_input_is_tty()) return input_read(prompt);
    if (repl_input_is_tty()) {
        fputs(prompt, stdout);
        fflush(stdout);
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0) {
        free(line);
        return NULL;
    }
    if (n > 0 && line[n - 1] == '\n') line[n - 1] = '\0';
    return line;
}
