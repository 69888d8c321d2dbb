/* kiln_main.c - the `kiln` program: Lua 5.4's standalone interpreter (lua.c) with the
 * kiln module preloaded as the global `kiln`, kiln's runtime options (--device,
 * --mode, --vram, --threads, --trace, --quiet) and a REPL with name completion.
 * Readline is optional: compile with -DKILN_READLINE and link -lreadline. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

#include "l_scripts.h"

/* from bindings/l_kiln.c */
int luaopen_kiln(lua_State *L);
const char *kiln_version_string(void);

#define PROGNAME "kiln" /* prefix of error messages, whatever argv[0] is */
#define PROMPT "kiln> "
#define PROMPT2 ">> "
#define HISTORY_LINES 1000

static const char *progname = PROGNAME; /* NULL in the REPL: no prefix on errors */

/* ---------------------------------------------------------------- options */

/* ORDER FLAGS: bits of cli_options.flags */
enum { HAS_I = 1, HAS_V = 2, HAS_E = 4, HAS_NOENV = 8, HAS_HELP = 16 };

typedef struct {
    int script;         /* argv index of the script ("-" = stdin), 0 if none */
    int optlim;         /* first argv index that is not an option */
    int flags;          /* HAS_* */
    int quiet;
    const char *device; /* --device NAME */
    const char *mode;   /* --mode MODE */
    const char *vram;   /* --vram SIZE as written, for messages */
    lua_Integer vram_bytes;
    const char *trace;  /* --trace FILE */
    int threads_set;
    lua_Integer threads;
    char error[160];    /* usage error, "" if none */
} cli_options;

static int trace_started; /* --trace: stop it at exit, whatever happened */

static void print_usage(FILE *f)
{
    fprintf(f,
            "usage: %s [options] [script [args]]\n"
            "Runs a Lua 5.4 script with the kiln runtime loaded as the global 'kiln'.\n"
            "With no script: an interactive prompt if stdin is a terminal, else stdin is run.\n"
            "Options (before the script; what follows the script goes to its 'arg'):\n"
            "  -e stat        execute string 'stat'\n"
            "  -i             enter interactive mode after executing 'script'\n"
            "  -l mod         require library 'mod' into global 'mod'\n"
            "  -l g=mod       require library 'mod' into global 'g'\n"
            "  -v, --version  show version information\n"
            "  -E             ignore environment variables (LUA_PATH, LUA_CPATH, KILN_PATH)\n"
            "  -W             turn warnings on\n"
            "  --device NAME  default device for new tensors (cpu, sim, cuda:0, ...)\n"
            "  --mode MODE    memory mode: high, normal, low, none\n"
            "  --vram SIZE    memory budget of the device, e.g. 6G, 512M, 1.5GiB\n"
            "  --threads N    CPU threads (0: one per core)\n"
            "  --trace FILE   write a trace (chrome://tracing, Perfetto) until exit\n"
            "  --quiet        no banner, less chatter\n"
            "  -h, --help     show this help\n"
            "  --             stop handling options\n"
            "  -              stop handling options and execute stdin\n"
            "Environment:\n"
            "  KILN_PATH      directories (';'-separated) holding kiln/*.lua, searched\n"
            "                 before the embedded scripts; empty: embedded only. Unset, and\n"
            "                 run in kiln's source tree, scripts/ is searched first\n"
            "  KILN_HISTORY   REPL history file (default ~/.kiln_history; empty: none)\n",
            PROGNAME);
}

static void print_version(void)
{
    printf("%s %s (%s)\n", PROGNAME, kiln_version_string(), LUA_VERSION);
    fflush(stdout);
}

/* "6G", "512M", "1.5GiB", "100000" -> bytes (binary units: K = 1024). */
static int parse_size(const char *s, lua_Integer *out)
{
    static const char units[] = "KMGT";
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno != 0 || !(v >= 0) || isinf(v)) return 0;
    while (*end == ' ') end++;
    double mult = 1;
    if (*end != '\0' && *end != 'b' && *end != 'B') {
        const char *u = strchr(units, *end >= 'a' && *end <= 'z' ? *end - 'a' + 'A' : *end);
        if (u == NULL) return 0;
        mult = ldexp(1.0, 10 * (int)(u - units + 1));
        end++;
        if (*end == 'i') end++; /* KiB */
    }
    if (*end == 'b' || *end == 'B') end++;
    if (*end != '\0') return 0;
    v = floor(v * mult + 0.5);
    if (v >= 9.2e18) return 0;
    *out = (lua_Integer)v;
    return 1;
}

/* Sets opt->error from a format and returns 0. */
static int bad_option(cli_options *opt, const char *fmt, const char *what)
{
    snprintf(opt->error, sizeof opt->error, fmt, what);
    return 0;
}

/* Long options with a value: "--name VALUE" or "--name=VALUE". */
static int long_option(cli_options *opt, char **argv, int *i)
{
    const char *a = argv[*i] + 2;
    const char *eq = strchr(a, '=');
    size_t n = eq ? (size_t)(eq - a) : strlen(a);
    static const char *const flags[] = {"version", "help", "quiet"};
    static const char *const valued[] = {"device", "mode", "vram", "threads", "trace"};
    for (size_t k = 0; k < sizeof flags / sizeof flags[0]; k++) {
        if (strlen(flags[k]) == n && strncmp(a, flags[k], n) == 0) {
            if (eq) return bad_option(opt, "option '%s' takes no value", argv[*i]);
            if (k == 0) opt->flags |= HAS_V;
            else if (k == 1) opt->flags |= HAS_HELP;
            else opt->quiet = 1;
            return 1;
        }
    }
    for (size_t k = 0; k < sizeof valued / sizeof valued[0]; k++) {
        if (strlen(valued[k]) != n || strncmp(a, valued[k], n) != 0) continue;
        const char *v = eq ? eq + 1 : argv[*i + 1];
        if (v == NULL || *v == '\0') return bad_option(opt, "'%s' needs an argument", argv[*i]);
        if (!eq) (*i)++;
        switch (k) {
        case 0: opt->device = v; break;
        case 1: opt->mode = v; break;
        case 2:
            opt->vram = v;
            if (!parse_size(v, &opt->vram_bytes))
                return bad_option(opt, "bad --vram size '%s' (expected bytes or a size like 6G, 512M, 1.5GiB)", v);
            break;
        case 3: {
            char *end;
            errno = 0;
            long t = strtol(v, &end, 10);
            if (end == v || *end != '\0' || errno != 0 || t < 0 || t > 4096)
                return bad_option(opt, "bad --threads count '%s' (expected 0..4096)", v);
            opt->threads = t;
            opt->threads_set = 1;
            break;
        }
        default: opt->trace = v; break;
        }
        return 1;
    }
    return bad_option(opt, "unrecognized option '%s'", argv[*i]);
}

/* lua.c's collectargs: reads the options up to the script name. Returns 0 with
 * opt->error set on a bad option. */
static int collect_args(char **argv, cli_options *opt)
{
    int i;
    if (argv[0] == NULL) return 1; /* argc == 0: no options, no script */
    for (i = 1; argv[i] != NULL; i++) {
        const char *a = argv[i];
        if (a[0] != '-') break; /* the script */
        switch (a[1]) {
        case '\0': /* "-": stdin is the script */
            opt->optlim = i;
            opt->script = i;
            return 1;
        case '-':
            if (a[2] == '\0') { /* "--" */
                opt->optlim = i + 1;
                opt->script = argv[i + 1] != NULL ? i + 1 : 0;
                return 1;
            }
            if (!long_option(opt, argv, &i)) return 0;
            break;
        case 'E': case 'W': case 'i': case 'v': case 'h':
            if (a[2] != '\0') return bad_option(opt, "unrecognized option '%s'", a);
            if (a[1] == 'E') opt->flags |= HAS_NOENV;
            else if (a[1] == 'i') opt->flags |= HAS_I;
            else if (a[1] == 'v') opt->flags |= HAS_V;
            else if (a[1] == 'h') opt->flags |= HAS_HELP;
            break;
        case 'e': case 'l':
            if (a[1] == 'e') opt->flags |= HAS_E;
            if (a[2] == '\0') { /* argument in the next argv */
                i++;
                if (argv[i] == NULL || argv[i][0] == '-')
                    return bad_option(opt, "'%s' needs argument", a);
            }
            break;
        default:
            return bad_option(opt, "unrecognized option '%s'", a);
        }
    }
    opt->optlim = i;
    opt->script = argv[i] != NULL ? i : 0;
    return 1;
}

/* ---------------------------------------------------------------- running code */

static lua_State *globalL; /* for laction */

static void setsignal(int sig, void (*handler)(int))
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
}

/* Runs in Lua context after a Ctrl-C: stop the script with an error. */
static void lstop(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    luaL_error(L, "interrupted!");
}

/* SIGINT during a call: only set a hook (lua_sethook is signal-safe); the script
 * stops at its next Lua instruction. A long C op finishes first; a second Ctrl-C
 * kills the process (the handler is reset to the default). */
static void laction(int sig)
{
    int flag = LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT;
    setsignal(sig, SIG_DFL);
    lua_sethook(globalL, lstop, flag, 1);
}

static void l_message(const char *pname, const char *msg)
{
    if (pname) fprintf(stderr, "%s: ", pname);
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
}

/* The error message on top of the stack; never raises (usable outside a pcall). */
static const char *error_text(lua_State *L)
{
    const char *msg = lua_tostring(L, -1);
    return msg ? msg : lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, -1));
}

/* Prints the error on top of the stack (if status is not OK) and pops it. */
static int report(lua_State *L, int status)
{
    if (status != LUA_OK) {
        int top = lua_gettop(L);
        l_message(progname, error_text(L));
        lua_settop(L, top - 1);
    }
    return status;
}

/* Traceback handler. Unlike lua.c, error objects with __tostring (kiln's typed
 * out-of-memory errors) get a traceback too. */
static int msghandler(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    if (msg == NULL) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
            msg = lua_tostring(L, -1);
        else
            msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    return 1;
}

/* lua_pcall with the traceback handler and Ctrl-C armed. */
static int docall(lua_State *L, int narg, int nres)
{
    int base = lua_gettop(L) - narg;
    lua_pushcfunction(L, msghandler);
    lua_insert(L, base);
    globalL = L;
    setsignal(SIGINT, laction);
    int status = lua_pcall(L, narg, nres, base);
    setsignal(SIGINT, SIG_DFL);
    if (lua_gethook(L) == lstop) lua_sethook(L, NULL, 0, 0); /* Ctrl-C after the last instruction */
    lua_remove(L, base);
    return status;
}

static int dochunk(lua_State *L, int status)
{
    if (status == LUA_OK) status = docall(L, 0, 0);
    return report(L, status);
}

static int dofile(lua_State *L, const char *name)
{
    return dochunk(L, luaL_loadfile(L, name));
}

static int dostring(lua_State *L, const char *s, const char *name)
{
    return dochunk(L, luaL_loadbuffer(L, s, strlen(s), name));
}

/* -l [g=]mod: g = require(mod); without '=', g is mod up to a '-' (lua.c 5.4.6). */
static int dolibrary(lua_State *L, const char *spec)
{
    const char *eq = strchr(spec, '=');
    const char *modname = eq ? eq + 1 : spec;
    size_t glen = eq ? (size_t)(eq - spec) : strcspn(spec, "-");
    lua_getglobal(L, "require");
    lua_pushstring(L, modname);
    int status = docall(L, 1, 1);
    if (status == LUA_OK) {
        lua_pushlstring(L, spec, glen);
        lua_insert(L, -2);
        lua_setglobal(L, lua_tostring(L, -2));
        lua_pop(L, 1);
    }
    return report(L, status);
}

/* arg[0] = script, negative indices = program and options, positive = script args;
 * with no script, arg[0] is the program (as lua.c). */
static void createargtable(lua_State *L, char **argv, int argc, int script)
{
    int narg = argc - (script + 1);
    lua_createtable(L, narg > 0 ? narg : 0, script + 1);
    for (int i = 0; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i - script);
    }
    lua_setglobal(L, "arg");
}

static int pushargs(lua_State *L)
{
    if (lua_getglobal(L, "arg") != LUA_TTABLE) luaL_error(L, "'arg' is not a table");
    int n = (int)luaL_len(L, -1);
    luaL_checkstack(L, n + 3, "too many arguments to script");
    int i;
    for (i = 1; i <= n; i++) lua_rawgeti(L, -i, i);
    lua_remove(L, -i);
    return n;
}

static int handle_script(lua_State *L, char **argv)
{
    const char *fname = argv[0];
    if (strcmp(fname, "-") == 0 && strcmp(argv[-1], "--") != 0) fname = NULL; /* stdin */
    int status = luaL_loadfile(L, fname);
    if (status == LUA_OK) {
        int n = pushargs(L);
        status = docall(L, n, LUA_MULTRET);
    }
    return report(L, status);
}

/* -e, -l and -W in command-line order; long options and their values are skipped. */
static int runargs(lua_State *L, char **argv, int n)
{
    for (int i = 1; i < n; i++) {
        const char *a = argv[i];
        if (a[1] == '-') { /* --name[=value]: skip a separate value */
            static const char *const valued[] = {"--device", "--mode", "--vram", "--threads", "--trace"};
            for (size_t k = 0; k < sizeof valued / sizeof valued[0]; k++)
                if (strcmp(a, valued[k]) == 0) i++;
            continue;
        }
        if (a[1] == 'e' || a[1] == 'l') {
            const char *extra = a[2] != '\0' ? a + 2 : argv[++i];
            int status = a[1] == 'e' ? dostring(L, extra, "=(command line)") : dolibrary(L, extra);
            if (status != LUA_OK) return 0;
        } else if (a[1] == 'W') {
            lua_warning(L, "@on", 0);
        }
    }
    return 1;
}

/* ---------------------------------------------------------------- kiln options */

/* Pushes kiln.<path> ("mem.set_budget") and returns 1 if it is a function;
 * otherwise pushes nothing and returns 0. */
static int push_kiln_function(lua_State *L, const char *path)
{
    int top = lua_gettop(L);
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    lua_getfield(L, -1, "kiln");
    while (lua_istable(L, -1)) {
        size_t n = strcspn(path, ".");
        lua_pushlstring(L, path, n);
        lua_gettable(L, -2);
        if (path[n] == '\0') {
            if (lua_isfunction(L, -1)) {
                lua_replace(L, top + 1);
                lua_settop(L, top + 1);
                return 1;
            }
            break;
        }
        path += n + 1;
    }
    lua_settop(L, top);
    return 0;
}

/* Calls the function under its nargs arguments; reports "kiln: OPTION: message". */
static int call_option(lua_State *L, const char *option, int nargs, int nres)
{
    if (lua_pcall(L, nargs, nres, 0) == LUA_OK) return 1;
    const char *msg = luaL_tolstring(L, -1, NULL);
    fprintf(stderr, "%s: %s: %s\n", PROGNAME, option, msg);
    lua_pop(L, 2);
    return 0;
}

static void warn_missing(const cli_options *opt, const char *option, const char *fn)
{
    if (!opt->quiet) fprintf(stderr, "%s: warning: %s ignored (kiln.%s is not available)\n", PROGNAME, option, fn);
}

/* Applies --quiet, --trace, --threads, --device, --mode, --vram (in this order) through
 * the kiln module's own functions; a missing function is a warning, not an error. */
static int apply_kiln_options(lua_State *L, const cli_options *opt)
{
    if (opt->quiet && push_kiln_function(L, "set_quiet")) {
        lua_pushboolean(L, 1);
        if (!call_option(L, "--quiet", 1, 0)) return 0;
    }
    if (opt->trace) {
        if (!push_kiln_function(L, "trace.start")) {
            warn_missing(opt, "--trace", "trace.start");
        } else {
            lua_pushstring(L, opt->trace);
            if (!call_option(L, "--trace", 1, 0)) return 0;
            trace_started = 1;
        }
    }
    if (opt->threads_set) {
        if (!push_kiln_function(L, "set_threads")) {
            warn_missing(opt, "--threads", "set_threads");
        } else {
            lua_pushinteger(L, opt->threads);
            if (!call_option(L, "--threads", 1, 0)) return 0;
        }
    }
    if (opt->device) {
        if (!push_kiln_function(L, "set_default_device")) {
            warn_missing(opt, "--device", "set_default_device");
        } else {
            lua_pushstring(L, opt->device);
            if (!call_option(L, "--device", 1, 0)) return 0;
        }
    }
    if (opt->mode) {
        if (!push_kiln_function(L, "memory_mode")) {
            warn_missing(opt, "--mode", "memory_mode");
        } else {
            lua_pushstring(L, opt->mode);
            if (!call_option(L, "--mode", 1, 0)) return 0;
        }
    }
    if (opt->vram) {
        if (!push_kiln_function(L, "mem.set_budget")) {
            warn_missing(opt, "--vram", "mem.set_budget");
        } else {
            /* the budget is for --device, else the runtime's default device */
            if (opt->device) lua_pushstring(L, opt->device);
            else if (push_kiln_function(L, "default_device")) {
                if (!call_option(L, "--vram", 0, 1)) return 0;
            } else lua_pushnil(L);
            lua_pushinteger(L, opt->vram_bytes);
            if (!call_option(L, "--vram", 2, 0)) return 0;
        }
    }
    return 1;
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
    for (size_t i = 0; i < kiln_embedded_script_count; i++) {
        const char *name = kiln_embedded_scripts[i].name;
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

static int stdin_tty;

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

static void input_init(lua_State *L)
{
    static char word_breaks[] = " \t\n\"\\'`@$><=;|&{}()[]+-*/%^#~,";
    if (!stdin_tty) return;
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
    if (!stdin_tty) return NULL;
    setsignal(SIGINT, rl_sigint);
    char *line = readline(prompt);
    setsignal(SIGINT, SIG_DFL);
    return line;
}

static void input_save(const char *line)
{
    if (!stdin_tty || line[0] == '\0') return;
    add_history(line);
    history_new++;
}

static void input_done(void)
{
    if (!stdin_tty || history_path[0] == '\0' || history_new == 0) return;
    /* append this session's lines (other sessions may have written meanwhile) */
    int n = history_new < history_length ? history_new : history_length;
    if (append_history(n, history_path) != 0) write_history(history_path);
    history_truncate_file(history_path, HISTORY_LINES);
}

#define HAVE_INPUT_READ 1
#else
static void input_init(lua_State *L) { (void)L; }
static void input_save(const char *line) { (void)line; }
static void input_done(void) {}
#define HAVE_INPUT_READ 0
static char *input_read(const char *prompt) { (void)prompt; return NULL; }
#endif

/* One line without its newline (malloc'd), or NULL at the end of input. Without a
 * terminal (a pipe, a file) nothing is prompted: output is only results and errors. */
static char *read_line(const char *prompt)
{
    if (HAVE_INPUT_READ && stdin_tty) return input_read(prompt);
    if (stdin_tty) {
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

/* ---------------------------------------------------------------- REPL (lua.c) */

static const char *get_prompt(lua_State *L, int firstline)
{
    if (lua_getglobal(L, firstline ? "_PROMPT" : "_PROMPT2") == LUA_TNIL) return firstline ? PROMPT : PROMPT2;
    const char *p = luaL_tolstring(L, -1, NULL);
    lua_remove(L, -2);
    return p;
}

/* A syntax error that ends at <eof>: the statement continues on the next line. */
static int incomplete(lua_State *L, int status)
{
    static const char mark[] = "<eof>";
    size_t lmsg;
    if (status != LUA_ERRSYNTAX) return 0;
    const char *msg = lua_tolstring(L, -1, &lmsg);
    return lmsg >= sizeof mark - 1 && strcmp(msg + lmsg - (sizeof mark - 1), mark) == 0;
}

static int pushline(lua_State *L, int firstline)
{
    const char *prompt = get_prompt(L, firstline);
    char *b = read_line(prompt);
    lua_pop(L, 1); /* prompt */
    if (b == NULL) return 0;
    if (firstline && b[0] == '=') lua_pushfstring(L, "return %s", b + 1); /* 5.2 compatibility */
    else lua_pushstring(L, b);
    free(b);
    return 1;
}

static int addreturn(lua_State *L)
{
    const char *line = lua_tostring(L, -1);
    const char *retline = lua_pushfstring(L, "return %s;", line);
    int status = luaL_loadbuffer(L, retline, strlen(retline), "=stdin");
    if (status == LUA_OK) {
        lua_remove(L, -2);
        input_save(line);
    } else {
        lua_pop(L, 2);
    }
    return status;
}

static int multiline(lua_State *L)
{
    for (;;) {
        size_t len;
        const char *line = lua_tolstring(L, 1, &len);
        int status = luaL_loadbuffer(L, line, len, "=stdin");
        /* at the end of input the syntax error stays on the stack to be reported */
        if (!incomplete(L, status) || !pushline(L, 0)) {
            input_save(line);
            return status;
        }
        lua_remove(L, -2); /* the "<eof>" error of the incomplete part */
        lua_pushliteral(L, "\n");
        lua_insert(L, -2);
        lua_concat(L, 3);
    }
}

/* Reads a statement: first as "return <line>", else as a statement, continued on
 * the next lines while incomplete. Returns -1 at the end of input. */
static int loadline(lua_State *L)
{
    lua_settop(L, 0);
    if (!pushline(L, 1)) return -1;
    int status = addreturn(L);
    if (status != LUA_OK) status = multiline(L);
    lua_remove(L, 1);
    return status;
}

/* Prints the results with the global print (tensors print their summary line). */
static void l_print(lua_State *L)
{
    int n = lua_gettop(L);
    if (n > 0) {
        luaL_checkstack(L, LUA_MINSTACK, "too many results to print");
        lua_getglobal(L, "print");
        lua_insert(L, 1);
        if (lua_pcall(L, n, 0, 0) != LUA_OK)
            l_message(progname, lua_pushfstring(L, "error calling 'print' (%s)", lua_tostring(L, -1)));
    }
}

static void doREPL(lua_State *L, const cli_options *opt)
{
    int status;
    const char *oldprogname = progname;
    progname = NULL;
    if (stdin_tty && !opt->quiet) print_version();
    input_init(L);
    while ((status = loadline(L)) != -1) {
        if (status == LUA_OK) status = docall(L, 0, LUA_MULTRET);
        if (status == LUA_OK) l_print(L);
        else report(L, status);
        fflush(stdout);
    }
    lua_settop(L, 0);
    input_done();
    if (stdin_tty) {
        fputs("\n", stdout);
        fflush(stdout);
    }
    progname = oldprogname;
}

/* ---------------------------------------------------------------- main */

/* package.loaded.kiln and the global kiln, before any user code runs. */
static int open_kiln(lua_State *L)
{
    luaL_requiref(L, "kiln", luaopen_kiln, 1);
    return 0;
}

static int pmain(lua_State *L)
{
    int argc = (int)lua_tointeger(L, 1);
    char **argv = (char **)lua_touserdata(L, 2);
    cli_options opt;
    memset(&opt, 0, sizeof opt);
    luaL_checkversion(L);
    if (!collect_args(argv, &opt)) {
        l_message(PROGNAME, opt.error);
        fprintf(stderr, "usage: %s [options] [script [args]]  (%s --help lists the options)\n", PROGNAME, PROGNAME);
        return 0;
    }
    if (opt.flags & HAS_HELP) {
        print_usage(stdout);
        lua_pushboolean(L, 1);
        return 1;
    }
    if (opt.flags & HAS_V) print_version();
    if (opt.flags & HAS_NOENV) { /* libraries ignore LUA_PATH etc. */
        lua_pushboolean(L, 1);
        lua_setfield(L, LUA_REGISTRYINDEX, "LUA_NOENV");
    }
    luaL_openlibs(L);
    kiln_scripts_install(L);
    kiln_scripts_prefer_source_tree(L);
    createargtable(L, argv, argc, opt.script);
    /* GC stays incremental (lua.c 5.4 switches to generational): tensors are few,
     * large and long-lived, and the binding runs full collections under pressure. */
    lua_gc(L, LUA_GCRESTART);
    lua_pushcfunction(L, open_kiln);
    if (report(L, docall(L, 0, 0)) != LUA_OK) return 0;
    if (!apply_kiln_options(L, &opt)) return 0;
    if (!runargs(L, argv, opt.optlim)) return 0;
    if (opt.script > 0 && handle_script(L, argv + opt.script) != LUA_OK) return 0;
    if (opt.flags & HAS_I) {
        doREPL(L, &opt);
    } else if (opt.script == 0 && !(opt.flags & (HAS_E | HAS_V))) {
        if (stdin_tty) doREPL(L, &opt);
        else if (dofile(L, NULL) != LUA_OK) return 0; /* stdin is the script */
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* kiln.trace.stop() after --trace, even when the script failed. */
static int stop_trace(lua_State *L)
{
    if (push_kiln_function(L, "trace.stop")) lua_call(L, 0, 0);
    return 0;
}

int main(int argc, char **argv)
{
    stdin_tty = isatty(STDIN_FILENO);
    lua_State *L = luaL_newstate();
    if (L == NULL) {
        l_message(PROGNAME, "cannot create state: not enough memory");
        return EXIT_FAILURE;
    }
    lua_gc(L, LUA_GCSTOP); /* while building the state */
    lua_pushcfunction(L, pmain);
    lua_pushinteger(L, argc);
    lua_pushlightuserdata(L, argv);
    int status = lua_pcall(L, 2, 1, 0);
    int result = lua_toboolean(L, -1);
    report(L, status);
    if (trace_started) {
        lua_settop(L, 0);
        lua_pushcfunction(L, stop_trace);
        if (lua_pcall(L, 0, 0, 0) != LUA_OK) {
            fprintf(stderr, "%s: --trace: %s\n", PROGNAME, error_text(L));
            result = 0;
        }
    }
    lua_close(L);
    return (result && status == LUA_OK) ? EXIT_SUCCESS : EXIT_FAILURE;
}
