/* kiln_main.c - the `kiln` program: Lua 5.4's standalone interpreter (lua.c) as a
 * host of kiln.h alone (no private header): one kiln_open whose config carries the
 * runtime options, then -e, -l, the script and the REPL on kiln_lua_state (line input:
 * repl_input.c; results: kiln.repl). */
#define _POSIX_C_SOURCE 200809L

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lauxlib.h"
#include "lua.h"

#include "kiln.h"
#include "repl_input.h"
#include "serve_http.h"

#define PROGNAME "kiln" /* prefix of error messages, whatever argv[0] is */
#define PROMPT "kiln> "
#define PROMPT2 ">> "
#define EXIT_USAGE 2    /* a mistake in the command line, as getopt-style programs exit */

static const char *progname = PROGNAME; /* NULL in the REPL: no prefix on errors */
static int usage_failed;                /* a usage error was reported: exit EXIT_USAGE */
static int log_failed;                  /* the library logged an error (a trace not written) */
/* --device meta[:NAME]: the script runs as a dry run modelling NAME ("" the default
 * target) under the --vram budget (0: the device's own) */
static const char *dry_target;
static int repl_ran; /* the REPL ran: its globals are the user's, not left by a script */
static uint64_t dry_budget;

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
    uint64_t vram_bytes; /* --vram SIZE */
    const char *trace;  /* --trace FILE */
    const char *memory_plot; /* --memory-plot FILE.png */
    const char *precision; /* --precision NAME */
    int threads;        /* --threads N; 0: one per core */
    char error[200];    /* usage error, "" if none */
} cli_options;

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
            "  --device NAME  default device for new tensors (cpu, sim, cuda:0, ...); meta or\n"
            "                 meta:NAME: a dry run of the script modelling NAME (the first GPU,\n"
            "                 else sim), its peak per stage printed (kiln.dry_run)\n"
            "  --mode MODE    memory mode: high, normal, low, none\n"
            "  --vram SIZE    memory budget of the device, e.g. 6G, 512M, 1.5GiB\n"
            "  --threads N    CPU threads (0: one per core)\n"
            "  --precision P  arithmetic of the networks: f32, bf16, f16 (default: the device's)\n"
            "  --trace FILE   write a trace (chrome://tracing, Perfetto) until exit\n"
            "  --memory-plot FILE.png  draw the device's memory over the run at exit\n"
            "                 (also after an error); its stage table goes to stderr\n"
            "  --quiet        no banner, less chatter\n"
            "  -h, --help     show this help\n"
            "  --             stop handling options\n"
            "  -              stop handling options and execute stdin\n"
            "Subcommands (in place of the script):\n"
            "  batch enqueue|worker|status ...   batch generation on Redis (kiln batch --help)\n"
            "  serve --models DIR --output DIR   ComfyUI's and AUTOMATIC1111's HTTP APIs (kiln serve --help)\n"
            "Environment:\n"
            "  KILN_PATH      directories (';'-separated) holding kiln/*.lua, searched\n"
            "                 before the embedded scripts; empty: embedded only. Unset, and\n"
            "                 run in kiln's source tree, scripts/ is searched first\n"
            "  KILN_HISTORY   REPL history file (default ~/.kiln_history; empty: none)\n"
            "Exit status: 0 done, 1 an error in the script, 2 a usage error (reported on one line)\n",
            PROGNAME);
}

static void print_version(void)
{
    printf("%s %s (%s)\n", PROGNAME, kiln_version(), LUA_VERSION);
    fflush(stdout);
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
    static const char *const valued[] = {"device", "mode", "vram", "threads", "trace", "memory-plot", "precision"};
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
            if (kiln_parse_size(v, &opt->vram_bytes) != KILN_OK)
                return bad_option(opt, "--vram %s: not a size (expected bytes or a size such as 6G, 512M, 1.5GiB)", v);
            break;
        case 3: {
            char *end;
            long t = strtol(v, &end, 10);
            /* the range is kiln.configure's to check; here only that it is a count */
            if (end == v || *end != '\0' || t < 0 || t > 1 << 20)
                return bad_option(opt, "--threads %s: not a thread count (0 = one per core)", v);
            opt->threads = (int)t;
            break;
        }
        case 4: opt->trace = v; break;
        case 5: opt->memory_plot = v; break;
        default:
            if (strcmp(v, "f32") && strcmp(v, "bf16") && strcmp(v, "f16") && strcmp(v, "auto"))
                return bad_option(opt, "--precision %s: expected f32, bf16, f16 or auto", v);
            opt->precision = v;
            break;
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
    repl_set_signal(sig, SIG_DFL);
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

/* A usage error: a table with kind == "usage" (util.usage_error, kiln.configure),
 * read without metamethods. Its message is the table's own. */
static const char *usage_message(lua_State *L, int idx)
{
    if (lua_type(L, idx) != LUA_TTABLE) return NULL;
    idx = lua_absindex(L, idx);
    lua_pushliteral(L, "kind");
    lua_rawget(L, idx);
    int usage = lua_type(L, -1) == LUA_TSTRING && strcmp(lua_tostring(L, -1), "usage") == 0;
    lua_pop(L, 1);
    if (!usage) return NULL;
    lua_pushliteral(L, "message");
    lua_rawget(L, idx);
    const char *msg = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "usage error";
    lua_pop(L, 1); /* the string stays referenced by the table */
    return msg;
}

/* Prints the error on top of the stack (if status is not OK) and pops it. A usage
 * error is one line, and the program's status becomes EXIT_USAGE (not in the REPL,
 * which goes on). */
static int report(lua_State *L, int status)
{
    if (status != LUA_OK) {
        int top = lua_gettop(L);
        const char *usage = usage_message(L, -1);
        l_message(progname, usage ? usage : error_text(L));
        if (usage && progname) usage_failed = 1;
        lua_settop(L, top - 1);
    }
    return status;
}

/* Traceback handler. Unlike lua.c, error objects with __tostring (kiln's typed
 * out-of-memory errors) get a traceback too; usage errors get none: they are the
 * command line's mistake, not the script's. */
static int msghandler(lua_State *L)
{
    if (usage_message(L, 1)) return 1;
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
    repl_set_signal(SIGINT, laction);
    int status = lua_pcall(L, narg, nres, base);
    repl_set_signal(SIGINT, SIG_DFL);
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

/* Subcommands: `kiln NAME args...` runs main(args...) of the shipped script module
 * kiln.NAME, unless a file of that name is in the current folder (a script wins). */
static const char *const subcommands[] = {"batch", "comfy", "serve", NULL};

static int load_subcommand(lua_State *L, const char *name)
{
    for (int i = 0; subcommands[i] != NULL; i++) {
        if (strcmp(name, subcommands[i]) != 0) continue;
        FILE *f = fopen(name, "r");
        if (f != NULL) { fclose(f); break; }
        char code[96], chunk[64];
        snprintf(code, sizeof code, "return require('kiln.%s').main(...)", name);
        snprintf(chunk, sizeof chunk, "=kiln %s", name);
        return luaL_loadbuffer(L, code, strlen(code), chunk);
    }
    return -1;
}

static int handle_script(lua_State *L, char **argv)
{
    const char *fname = argv[0];
    if (strcmp(fname, "-") == 0 && strcmp(argv[-1], "--") != 0) fname = NULL; /* stdin */
    int status = fname ? load_subcommand(L, fname) : -1;
    if (status < 0) status = luaL_loadfile(L, fname);
    if (status == LUA_ERRFILE) usage_failed = 1; /* a missing script: a usage error */
    if (status == LUA_OK) {
        int n = pushargs(L);
        if (dry_target) { /* kiln.dry_run's main(target, budget, chunk, args...) below the chunk */
            lua_getglobal(L, "require");
            lua_pushstring(L, "kiln.dry_run");
            lua_call(L, 1, 1);
            lua_getfield(L, -1, "main");
            lua_remove(L, -2);
            lua_pushstring(L, dry_target);
            lua_pushinteger(L, (lua_Integer)dry_budget);
            lua_rotate(L, -(n + 4), 3);
            n += 3;
        }
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
            static const char *const valued[] = {"--device", "--mode", "--vram", "--threads", "--trace",
                                                 "--memory-plot", "--precision"};
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
    char *b = repl_input_read(prompt);
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
        repl_input_save(line);
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
            repl_input_save(line);
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

/* Pushes the REPL's result printer, kiln.repl's print. [-0, +1, e] */
static int push_printer(lua_State *L)
{
    lua_getglobal(L, "require");
    lua_pushliteral(L, "kiln.repl");
    lua_call(L, 1, 1);
    lua_getfield(L, -1, "print");
    return 1;
}

/* Prints the results with kiln.repl.print (values shown for people: a tensor's
 * numbers, a table's contents), or with the global print if that module fails. */
static void l_print(lua_State *L)
{
    int n = lua_gettop(L);
    if (n > 0) {
        luaL_checkstack(L, LUA_MINSTACK, "too many results to print");
        lua_pushcfunction(L, push_printer);
        if (lua_pcall(L, 0, 1, 0) != LUA_OK || !lua_isfunction(L, -1)) {
            lua_pop(L, 1);
            lua_getglobal(L, "print");
        }
        lua_insert(L, 1);
        if (lua_pcall(L, n, 0, 0) != LUA_OK)
            l_message(progname, lua_pushfstring(L, "error calling 'print' (%s)", lua_tostring(L, -1)));
    }
}

static void doREPL(lua_State *L, const cli_options *opt)
{
    repl_ran = 1;
    int status;
    const char *oldprogname = progname;
    progname = NULL;
    if (repl_input_is_tty() && !opt->quiet) print_version();
    repl_input_init(L);
    while ((status = loadline(L)) != -1) {
        if (status == LUA_OK) status = docall(L, 0, LUA_MULTRET);
        if (status == LUA_OK) l_print(L);
        else report(L, status);
        fflush(stdout);
    }
    lua_settop(L, 0);
    repl_input_done();
    if (repl_input_is_tty()) {
        fputs("\n", stdout);
        fflush(stdout);
    }
    progname = oldprogname;
}


/* ---------------------------------------------------------------- the context */

/* A refused config field (kiln_last_config_field) said as the command line said it:
 * "--OPTION: detail", a usage error. */
static void report_open_failure(kiln_status st)
{
    static const char *const options[][2] = {
        {"device", "--device"}, {"mode", "--mode"}, {"memory_budget", "--vram"},
        {"threads", "--threads"}, {"trace", "--trace"}, {"precision", "--precision"},
    };
    const char *detail;
    const char *field = kiln_last_config_field(NULL, &detail);
    for (size_t i = 0; field && i < sizeof options / sizeof options[0]; i++)
        if (strcmp(field, options[i][0]) == 0) {
            fprintf(stderr, "%s: %s: %s\n", PROGNAME, options[i][1], detail);
            usage_failed = 1;
            return;
        }
    fprintf(stderr, "%s: %s\n", PROGNAME, kiln_last_message(NULL));
    if (st == KILN_ERR_ARG) usage_failed = 1;
}

/* The library's own messages (a trace it could not write): stderr, as kiln's. */
static void on_log(void *user, kiln_log_level level, const char *message)
{
    (void)user;
    if (level == KILN_LOG_ERROR) log_failed = 1;
    fprintf(stderr, "%s: %s%s\n", PROGNAME, level == KILN_LOG_ERROR ? "error: " : level == KILN_LOG_WARN ? "warning: " : "",
            message);
    fflush(stderr);
}

static kiln_ctx *open_context(const cli_options *opt)
{
    kiln_config cfg = KILN_CONFIG_INIT;
    cfg.device = opt->device;
    cfg.mode = opt->mode;
    cfg.memory_budget = opt->vram_bytes;
    cfg.threads = opt->threads;
    cfg.trace = opt->trace;
    cfg.precision = opt->precision;
    cfg.ignore_env = (opt->flags & HAS_NOENV) != 0;
    cfg.log = on_log;
    /* a terminal program: stock Lua's print, os.exit and warnings, progress on stderr */
    cfg.verbose = !opt->quiet;
    cfg.print_stdout = 1;
    cfg.real_exit = 1;
    cfg.lua_warnings = 1;
    cfg.source_tree = 1;
    kiln_ctx *ctx = NULL;
    kiln_status st = kiln_open(&cfg, &ctx);
    if (st != KILN_OK) report_open_failure(st);
    return ctx;
}

/* ---------------------------------------------------------------- main */

static int pmain(lua_State *L)
{
    int argc = (int)lua_tointeger(L, 1);
    char **argv = (char **)lua_touserdata(L, 2);
    const cli_options *opt = lua_touserdata(L, 3);
    luaL_checkversion(L);
    createargtable(L, argv, argc, opt->script);
    if (!runargs(L, argv, opt->optlim)) return 0;
    if (opt->script > 0 && handle_script(L, argv + opt->script) != LUA_OK) return 0;
    if (opt->flags & HAS_I) {
        doREPL(L, opt);
    } else if (opt->script == 0 && !(opt->flags & (HAS_E | HAS_V))) {
        if (repl_input_is_tty()) doREPL(L, opt);
        else if (dofile(L, NULL) != LUA_OK) return 0; /* stdin is the script */
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* --memory-plot: kiln.mem.plot(path) once the script has ended, whether it finished
 * or raised (the picture of a failed run shows where it failed); the stage table
 * goes to stderr, as the other reports about the run. Returns 0 when it failed. */
static int write_memory_plot(lua_State *L, const char *path, const char *device)
{
    lua_getfield(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    int ok = lua_getfield(L, -1, "kiln") == LUA_TTABLE && lua_getfield(L, -1, "mem") == LUA_TTABLE &&
             lua_getfield(L, -1, "plot") == LUA_TFUNCTION;
    if (!ok) {
        fprintf(stderr, "%s: --memory-plot %s: kiln.mem.plot is not available\n", PROGNAME, path);
        return 0;
    }
    lua_pushstring(L, path);
    lua_createtable(L, 0, 1);
    if (device) { /* --device NAME; meta for a dry run: the predicted picture */
        lua_pushstring(L, device);
        lua_setfield(L, -2, "device");
    }
    if (lua_pcall(L, 2, 1, 0) != LUA_OK) {
        const char *msg = luaL_tolstring(L, -1, NULL);
        fprintf(stderr, "%s: --memory-plot %s: %s\n", PROGNAME, path, msg);
        return 0;
    }
    const char *table = lua_tostring(L, -1);
    if (table) fputs(table, stderr);
    fflush(stderr);
    return 1;
}

/* KILN_CHECK_LEAKS (set by the test runner): the invariants after a script. Once its
 * chunk has ended (its <close> variables closed) and a full collection has run, nothing
 * it made may still be alive: no more tensors than before it ran and no open model (a
 * global or a module holds them; the models by name, the tensors by their storages'
 * owners; not after the REPL, whose globals are the user's). Once the context is closed, every device has no bytes allocated and reserves
 * no more than its budget. Each broken one is a FAIL line in the runner's format and a
 * failed exit. */
static const char live_check[] =
    "local base = ...\n"
    "collectgarbage() collectgarbage()\n"
    "local live = require('kiln').mem.live()\n"
    "if not base then return live.tensors end\n"
    "local msgs = {}\n"
    "if live.tensors > base then\n"
    "  msgs[#msgs + 1] = ('%d tensor(s) still alive after the script ended (held by a global or a module; '\n"
    "    .. 'live storages: %s)'):format(live.tensors - base, #live.storages > 0 and table.concat(live.storages, ', ') or 'none')\n"
    "end\n"
    "if #live.models > 0 then msgs[#msgs + 1] = 'models still open after the script ended: ' .. table.concat(live.models, ', ') end\n"
    "return table.concat(msgs, '; ')\n";

/* Runs live_check with base (< 0: none); returns its result, the tensors alive (base
 * < 0) or 0 / 1 for what it reported. */
static long check_alive(lua_State *L, long base)
{
    int top = lua_gettop(L);
    long r = 0;
    if (luaL_loadstring(L, live_check) != LUA_OK) {
        printf("FAIL leak check: %s\n", lua_tostring(L, -1));
        r = 1;
    } else {
        if (base < 0) lua_pushnil(L);
        else lua_pushinteger(L, (lua_Integer)base);
        if (lua_pcall(L, 1, 1, 0) != LUA_OK) {
            printf("FAIL leak check: %s\n", lua_tostring(L, -1));
            r = 1;
        } else if (base < 0) {
            r = (long)lua_tointeger(L, -1);
        } else if (lua_tostring(L, -1)[0]) {
            printf("FAIL leak check: %s\n", lua_tostring(L, -1));
            r = 1;
        }
    }
    lua_settop(L, top);
    return r;
}

static int check_leaks(void)
{
    int leaked = 0;
    for (int i = 0; kiln_device_name_at(i); i++) {
        kiln_memory_info m;
        if (kiln_memory_stats(NULL, kiln_device_name_at(i), &m) != KILN_OK) continue;
        if (m.allocated != 0) {
            printf("FAIL leak check: %llu bytes still allocated on %s after the script's context closed\n",
                   (unsigned long long)m.allocated, m.device);
            leaked = 1;
        }
        if (m.budget != 0 && m.reserved > m.budget) {
            printf("FAIL leak check: %s reserves %llu bytes, over its budget of %llu, after the script's context closed\n",
                   m.device, (unsigned long long)m.reserved, (unsigned long long)m.budget);
            leaked = 1;
        }
    }
    return leaked;
}

int main(int argc, char **argv)
{
    cli_options opt;
    memset(&opt, 0, sizeof opt);
    if (!collect_args(argv, &opt)) {
        fprintf(stderr, "%s: %s (%s --help lists the options)\n", PROGNAME, opt.error, PROGNAME);
        return EXIT_USAGE;
    }
    if (opt.flags & HAS_HELP) {
        print_usage(stdout);
        return EXIT_SUCCESS;
    }
    if (opt.flags & HAS_V) print_version();
    if (opt.device && strncmp(opt.device, "meta", 4) == 0 && (opt.device[4] == 0 || opt.device[4] == ':')) {
        /* the context opens on the host; the script's run models the device named */
        dry_target = opt.device[4] ? opt.device + 5 : "";
        dry_budget = opt.vram_bytes;
        opt.device = NULL;
        opt.vram_bytes = 0;
    }
    kiln_ctx *ctx = open_context(&opt);
    if (ctx == NULL) return usage_failed ? EXIT_USAGE : EXIT_FAILURE;
    lua_State *L = kiln_lua_state(ctx);
    serve_http_preload(L, ctx); /* require "kiln.serve_http": kiln serve's sockets */
    int checking = getenv("KILN_CHECK_LEAKS") != NULL;
    long base_tensors = checking ? check_alive(L, -1) : 0;
    lua_pushcfunction(L, pmain);
    lua_pushinteger(L, argc);
    lua_pushlightuserdata(L, argv);
    lua_pushlightuserdata(L, &opt);
    int status = lua_pcall(L, 3, 1, 0);
    int result = lua_toboolean(L, -1);
    report(L, status);
    lua_settop(L, 0);
    int plot_failed = opt.memory_plot && !write_memory_plot(L, opt.memory_plot, dry_target ? "meta" : opt.device);
    lua_settop(L, 0);
    int leaked = checking && status == LUA_OK && result && !repl_ran ? (int)check_alive(L, base_tensors) : 0;
    kiln_close(ctx); /* stops --trace, whatever happened */
    leaked |= checking ? check_leaks() : 0;
    if (usage_failed) return EXIT_USAGE;
    return (result && status == LUA_OK && !log_failed && !leaked && !plot_failed) ? EXIT_SUCCESS : EXIT_FAILURE;
}
