# kiln - build, test, bench, demo, install.
# `make demo` and `make test` are the README's two commands; both first check the
# Debian packages kiln needs (`make deps` installs them with apt-get when run as root).

CC      ?= cc
PREFIX  ?= /usr/local
# One compile job per core unless -j was given (`make test` from a fresh clone spends
# most of its build in nvcc); the tests themselves run one after another (tests/run.sh).
ifeq ($(filter -j%,$(MAKEFLAGS)),)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif
SAN     ?= 0
# TSAN=1: ThreadSanitizer build in build-tsan; `make test TSAN=1` runs the tests that
# use threads (contexts in two threads, cancels from another thread, copy threads)
TSAN    ?= 0
# CUDA backend (kernels/cuda): built when nvcc is found; CUDA=0 turns it off. SAN=1
# builds leave it off unless CUDA=1 is given (the CUDA runtime under ASan needs
# ASAN_OPTIONS=protect_shadow_gap=0).
CUDA_HOME  ?= /usr/local/cuda
NVCC       ?= $(or $(wildcard $(CUDA_HOME)/bin/nvcc),$(shell command -v nvcc 2>/dev/null))
CUDA       ?= $(if $(filter 1,$(SAN) $(TSAN)),0,$(if $(NVCC),1,0))
CUDA_ARCHS ?= 80 86 89 90
PYTHON  ?= /usr/bin/python3

# the version is kiln.h's KILN_VERSION_MAJOR / MINOR / PATCH (in that order there)
KILN_VERSION := $(shell sed -n 's/^\#define KILN_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$$/\2/p' bindings/kiln.h | paste -sd.)
LIBDIR   ?= $(PREFIX)/lib
INCDIR   ?= $(PREFIX)/include
MANDIR   ?= $(PREFIX)/share/man
DATADIR  ?= $(PREFIX)/share/kiln
# Lua 5.4's C module folder: Debian's own for PREFIX=/usr, else PREFIX/lib/lua/5.4
# (/usr/local/lib/lua/5.4 is on lua5.4's default package.cpath)
LUA_CMOD ?= $(if $(filter /usr,$(PREFIX)),$(shell pkg-config --variable=INSTALL_CMOD lua5.4 2>/dev/null),$(PREFIX)/lib/lua/5.4)

ifeq ($(SAN),1)
BUILD   := build-san
OPT     := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
else ifeq ($(TSAN),1)
BUILD   := build-tsan
OPT     := -O1 -g -fsanitize=thread -fno-omit-frame-pointer
else
BUILD   := build
OPT     := -O2 -g
endif

# Flags that depend on the Debian packages (LUA_CFLAGS, LUA_LIBS, PNG_CFLAGS, PNG_LIBS,
# READLINE, HIREDIS_FOUND, HIREDIS_CFLAGS, HIREDIS_PC_LIBS, CIVETWEB_FOUND) come from $(BUILD)/flags.mk,
# which the rule under "dependencies" writes after the deps check has installed them:
# on a fresh machine there is no lua5.4.pc yet when make first reads this file. GNU make
# remakes an included makefile before anything else and then reads everything again, so
# the first `make demo` compiles with the flags of the packages it has just installed.
# Goals that compile nothing do not include it (`make clean` installs nothing).
PKG_CONFIG ?= pkg-config
FLAGS_MK   := $(BUILD)/flags.mk
ifneq ($(filter-out clean deps uninstall,$(or $(MAKECMDGOALS),all)),)
include $(FLAGS_MK)
endif

CFLAGS  += -std=c11 -Wall -Wextra -fPIC -fvisibility=hidden $(OPT) $(LUA_CFLAGS) $(PNG_CFLAGS)
LDFLAGS += $(filter -fsanitize%,$(OPT))
# libraries of the core (runtime + kernels); the Lua module gets its Lua symbols from the host
CORE_LIBS := $(PNG_LIBS) -lz -lopenblas -lpthread -lm
LIBS    := $(CORE_LIBS) $(LUA_LIBS)
# hiredis, the Redis client under `kiln batch` (runtime/queue.c): used when its
# package or header is found; HIREDIS=0 builds without it (batch then says what to install)
HIREDIS ?= $(HIREDIS_FOUND)
ifeq ($(HIREDIS),1)
HIREDIS_LIBS := $(HIREDIS_PC_LIBS)
CORE_LIBS    += $(HIREDIS_LIBS)
LIBS         += $(HIREDIS_LIBS)
endif
ifeq ($(READLINE),1)
CLI_DEFS := -DKILN_READLINE
CLI_LIBS := -lreadline
endif
# civetweb, the HTTP + WebSocket server of `kiln serve` (bindings/serve_http.c, in the
# kiln program only: the library takes on no web server): used when its header is
# found; CIVETWEB=0 builds without it (kiln serve then says what to install)
CIVETWEB ?= $(CIVETWEB_FOUND)
ifeq ($(CIVETWEB),1)
CLI_DEFS += -DKILN_CIVETWEB
CLI_LIBS += -lcivetweb
endif

RUNTIME_SRC  := $(wildcard runtime/*.c)
KERNEL_SRC   := $(wildcard kernels/*.c kernels/cpu/*.c kernels/meta/*.c) kernels/cuda/cuda_none.c
ifeq ($(CUDA),1)
KERNEL_SRC   := $(wildcard kernels/*.c kernels/cpu/*.c kernels/meta/*.c) kernels/cuda/cuda_backend.c kernels/cuda/cuda_context.c
CU_OBJ       := $(patsubst %.cu,$(BUILD)/obj/%.o,$(wildcard kernels/cuda/*.cu))
NVCCFLAGS    := -std=c++17 -O2 -g -Xcompiler -Wall,-Wextra,-fPIC,-fvisibility=hidden \
                $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
                -gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))
CUDA_LIBS    := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudnn -lcublas -lcudart -lstdc++
CORE_LIBS    += $(CUDA_LIBS)
LIBS         += $(CUDA_LIBS)
endif
# the kiln program's own files (kiln_main.c, repl_*.c) are not in the library
CLI_SRC      := bindings/kiln_main.c $(wildcard bindings/repl_*.c bindings/serve_*.c)
BINDING_SRC  := $(filter-out $(CLI_SRC),$(wildcard bindings/*.c))
SCRIPTS      := $(shell find scripts -name '*.lua' | sort)
GEN_SCRIPTS  := $(BUILD)/gen/scripts_data.c
# CLIP's vocabulary, compiled in as the built-in tokenizer (runtime/data/LICENSE-CLIP)
CLIP_VOCAB   := runtime/data/bpe_simple_vocab_16e6.txt.gz
GEN_VOCAB    := $(BUILD)/gen/clip_vocab.c
# T5 v1.1's SentencePiece model in kiln's compact form (runtime/data/gen_t5_vocab.py made
# it; runtime/data/LICENSE-T5), compiled in as the T5 tokenizer's vocabulary
T5_VOCAB     := runtime/data/t5_spiece.bin.gz
GEN_T5_VOCAB := $(BUILD)/gen/t5_vocab.c

LIB_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(RUNTIME_SRC) $(KERNEL_SRC) $(BINDING_SRC)) $(BUILD)/obj/gen/scripts_data.o $(BUILD)/obj/gen/clip_vocab.o $(BUILD)/obj/gen/t5_vocab.o $(CU_OBJ)
C_TESTS := $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c))
# every fuzz harness tests/fuzz/fuzz_<name>.c also replays its corpus and its kept
# crashes as the test program test_fuzz_<name> (see `make fuzz` below)
FUZZ_SRC    := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_REPLAY := $(patsubst tests/fuzz/fuzz_%.c,$(BUILD)/tests/test_fuzz_%,$(FUZZ_SRC))
DEPS_OK := build/.deps-ok

.PHONY: all deps test bench demo clean install uninstall check-deps
all: $(BUILD)/libkiln.a $(BUILD)/libkiln.so $(BUILD)/kiln $(BUILD)/lua/kiln.so $(BUILD)/examples/art_tool

# ---- dependencies -------------------------------------------------------------
# Debian packages: build (gcc make pkg-config), Lua, libpng, OpenBLAS, readline,
# LuaFileSystem (the scripts' files and folders), hiredis and redis-server (`kiln batch`
# and its tests), civetweb (the HTTP and WebSocket server of `kiln serve`), chromium
# (the headless browser that tests kiln serve's status page).
DEB_PKGS := gcc make pkg-config liblua5.4-dev lua5.4 libpng-dev zlib1g-dev libopenblas-dev libreadline-dev lua-filesystem libhiredis-dev redis-server libcivetweb-dev chromium
# The check, for `make deps` and for a missing $(DEPS_OK); run in this make, not in a
# sub-make, which would warn about -j when started while make remakes build/flags.mk.
define deps_check
@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
if [ -z "$$missing" ]; then echo "deps: all present"; \
elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
else echo "deps: missing Debian packages; run:  sudo apt-get install -y $$missing"; exit 1; fi
@mkdir -p $(dir $(DEPS_OK)) && touch $(DEPS_OK)
endef
deps:
	$(deps_check)

$(DEPS_OK):
	$(deps_check)

# The package-dependent flags (see the top), asked of pkg-config once the deps check
# has passed; rewritten when the Makefile changes or the check runs again. Under
# `make -n` too: make runs the rules of the makefiles it reads even when dry-running.
$(FLAGS_MK): $(firstword $(MAKEFILE_LIST)) $(DEPS_OK)
	@mkdir -p $(dir $@)
	@pc() { $(PKG_CONFIG) "$$@" 2>/dev/null; }; \
	hiredis_cflags=$$(pc --cflags hiredis); hiredis_libs=$$(pc --libs hiredis); \
	{ echo "# written by the Makefile after the deps check (see its top)"; \
	  echo "LUA_CFLAGS := $$(pc --cflags lua5.4)"; \
	  echo "LUA_LIBS := $$(pc --libs lua5.4)"; \
	  echo "PNG_CFLAGS := $$(pc --cflags libpng)"; \
	  echo "PNG_LIBS := $$(pc --libs libpng)"; \
	  echo "READLINE := $$(test -f /usr/include/readline/readline.h && echo 1)"; \
	  echo "HIREDIS_FOUND := $$(pc --exists hiredis || test -f /usr/include/hiredis/hiredis.h && echo 1 || echo 0)"; \
	  echo "HIREDIS_CFLAGS := $${hiredis_cflags:--I/usr/include/hiredis}"; \
	  echo "HIREDIS_PC_LIBS := $${hiredis_libs:--lhiredis}"; \
	  echo "CIVETWEB_FOUND := $$(test -f /usr/include/civetweb.h && echo 1 || echo 0)"; \
	} > $@.tmp && mv $@.tmp $@

# ---- library, CLI, Lua module ----------------------------------------------------
$(BUILD)/obj/%.o: %.c $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

# CUDA sources: nvcc for the .cu files; the C registration file needs the CUDA headers
$(BUILD)/obj/%.o: %.cu $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/kernels/cuda/cuda_backend.o $(BUILD)/obj/kernels/cuda/cuda_context.o: CFLAGS += -I$(CUDA_HOME)/include
# kiln.h includes kiln_status.h, which is the core's (runtime/) and is installed beside it
$(BUILD)/obj/bindings/%.o: CFLAGS += -iquote runtime
ifeq ($(HIREDIS),1)
$(BUILD)/obj/runtime/queue.o: CFLAGS += -DKILN_HIREDIS $(HIREDIS_CFLAGS)
endif

$(GEN_SCRIPTS): bindings/gen_scripts.lua $(SCRIPTS) $(DEPS_OK)
	@mkdir -p $(dir $@)
	lua5.4 bindings/gen_scripts.lua $@ $(SCRIPTS)

$(BUILD)/obj/gen/scripts_data.o: $(GEN_SCRIPTS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Ibindings -c $< -o $@

$(GEN_VOCAB): runtime/data/gen_blob.lua $(CLIP_VOCAB) $(DEPS_OK)
	@mkdir -p $(dir $@)
	lua5.4 runtime/data/gen_blob.lua $@ kiln_clip_vocab_gz $(CLIP_VOCAB)

$(BUILD)/obj/gen/clip_vocab.o: $(GEN_VOCAB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(GEN_T5_VOCAB): runtime/data/gen_blob.lua $(T5_VOCAB) $(DEPS_OK)
	@mkdir -p $(dir $@)
	lua5.4 runtime/data/gen_blob.lua $@ kiln_t5_vocab_gz $(T5_VOCAB)

$(BUILD)/obj/gen/t5_vocab.o: $(GEN_T5_VOCAB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libkiln.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# The shared library: libkiln.so.MAJOR.MINOR.PATCH with the SONAME libkiln.so.MAJOR
# (what a host built with -lkiln records and loads; kiln_open checks the minor while
# MAJOR is 0), and the libkiln.so.MAJOR and libkiln.so links, as ldconfig and the
# linker look for them.
KILN_SOMAJOR := $(firstword $(subst ., ,$(KILN_VERSION)))
KILN_SONAME  := libkiln.so.$(KILN_SOMAJOR)
KILN_SOFILE  := libkiln.so.$(KILN_VERSION)

$(BUILD)/$(KILN_SOFILE): $(LIB_OBJ)
	$(CC) -shared -Wl,-soname,$(KILN_SONAME) -o $@ $^ $(LDFLAGS) $(LIBS)

$(BUILD)/$(KILN_SONAME): $(BUILD)/$(KILN_SOFILE)
	ln -sf $(KILN_SOFILE) $@

$(BUILD)/libkiln.so: $(BUILD)/$(KILN_SONAME)
	ln -sf $(KILN_SONAME) $@

# the kiln program is a host of kiln.h alone (bindings/kiln.h and runtime/kiln_status.h)
$(BUILD)/kiln: $(CLI_SRC) $(wildcard bindings/repl_*.h bindings/serve_*.h) bindings/kiln.h runtime/kiln_status.h $(BUILD)/libkiln.a
	$(CC) $(CFLAGS) -iquote runtime $(CLI_DEFS) -o $@ $(CLI_SRC) $(BUILD)/libkiln.a $(LDFLAGS) $(LIBS) $(CLI_LIBS)

$(BUILD)/lua/kiln.so: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) -shared -o $@ $^ $(LDFLAGS) $(CORE_LIBS)

# The embedding example includes <kiln.h> as an installed host would, hence -Ibindings
# and -Iruntime (where kiln_status.h lives until installed beside kiln.h).
$(BUILD)/examples/art_tool: examples/embed/art_tool.c bindings/kiln.h runtime/kiln_status.h $(BUILD)/libkiln.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Ibindings -Iruntime -o $@ $< $(BUILD)/libkiln.a $(LDFLAGS) $(LIBS)

# ---- tests ---------------------------------------------------------------------
$(BUILD)/tests/%: tests/%.c $(BUILD)/libkiln.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -MF $@.d -Iruntime -Ikernels/cpu -o $@ $< $(BUILD)/libkiln.a $(LDFLAGS) $(LIBS)

$(BUILD)/tests/test_fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/replay.c $(wildcard tests/fuzz/*.h) $(BUILD)/libkiln.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DFUZZ_NAME='"$*"' -Iruntime -Ibindings -o $@ tests/fuzz/replay.c $< $(BUILD)/libkiln.a $(LDFLAGS) $(LIBS)

# the HTTP + WebSocket client of tests/lua/test_serve.lua (no kiln code in it)
$(BUILD)/tests/serve_client: tests/serve_client.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -pthread -o $@ $<

# T=PATTERN runs only the tests whose name contains PATTERN (make test T=png)
test: all $(C_TESTS) $(FUZZ_REPLAY) $(BUILD)/tests/serve_client
	@BUILD=$(BUILD) SAN=$(SAN) TSAN=$(TSAN) T='$(T)' bash tests/run.sh

# ---- ComfyUI's own API examples against kiln serve (not part of `make test`: they need
# Python's websocket-client, Debian's python3-websocket, and a ComfyUI source tree):
# make comfy-examples COMFYUI=/path/to/ComfyUI
.PHONY: comfy-examples
comfy-examples: all
	@COMFYUI='$(COMFYUI)' PYTHON=$(PYTHON) bash tests/comfy_examples.sh $(BUILD)/kiln

# ---- fuzzing (libFuzzer; not part of `make test`) ----------------------------------
# `make fuzz FUZZ_SECONDS=N` builds the library and every tests/fuzz/fuzz_*.c harness
# with clang (-fsanitize=fuzzer,address,undefined) in FUZZ_BUILD, runs each N seconds
# on one core and prints the executions per harness and in total (tests/fuzz/run.sh;
# FUZZ_ONLY=json,png picks harnesses; FUZZ_RUNS=N runs each until N executions).
# Crashing inputs land in FUZZ_BUILD/crashes/.
FUZZ_BUILD   ?= build-fuzz
FUZZ_SECONDS ?=
FUZZ_RUNS    ?=
FUZZ_CC      ?= clang
FUZZ_OPT     := -O1 -g -fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
FUZZ_BINS    := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(FUZZ_SRC))

.PHONY: fuzz fuzz-bins
fuzz:
	@$(MAKE) --no-print-directory BUILD=$(FUZZ_BUILD) CC=$(FUZZ_CC) CUDA=0 OPT='$(FUZZ_OPT)' fuzz-bins
	@FUZZ_BUILD=$(FUZZ_BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_RUNS=$(FUZZ_RUNS) bash tests/fuzz/run.sh

# (called by `make fuzz` with BUILD=$(FUZZ_BUILD) and the fuzzing flags)
fuzz-bins: $(FUZZ_BINS)

$(BUILD)/fuzz/%: tests/fuzz/%.c $(wildcard tests/fuzz/*.h) $(BUILD)/libkiln.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fsanitize=fuzzer -Iruntime -Ibindings -o $@ $< $(BUILD)/libkiln.a $(LDFLAGS) $(LIBS)

# ---- soak: test_soak's long versions (1000 txt2img runs in one context, 1000 contexts
# opened and closed, 200 cancels from another thread, two threads), RSS figures printed
.PHONY: soak
soak: all $(BUILD)/tests/test_soak
	KILN_SOAK=full $(BUILD)/tests/test_soak

# ---- fault injection: every allocation index of the demo txt2img fails once (make
# test tries a spread of them); with SAN=1 under AddressSanitizer
.PHONY: faults
faults: all
	KILN_FAULTS=all $(BUILD)/kiln tests/lua/test_faults.lua

# ---- benchmarks, demo ------------------------------------------------------------
bench: all
	@BUILD=$(BUILD) bash tests/bench/run.sh

# text to image with the bundled demo model: writes $(BUILD)/kiln-demo.png (build output stays under the build folder) and prints the memory summary
DEMO_PROMPT ?= a red circle on a blue background
demo: all
	$(BUILD)/kiln examples/txt2img.lua --prompt "$(DEMO_PROMPT)" --seed 1 --out $(BUILD)/kiln-demo.png

clean:
	rm -rf build build-san

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCDIR) \
	  $(DESTDIR)$(LUA_CMOD) $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(DATADIR)
	install -m 755 $(BUILD)/kiln $(DESTDIR)$(PREFIX)/bin/kiln
	install -m 644 $(BUILD)/libkiln.a $(DESTDIR)$(LIBDIR)/libkiln.a
	install -m 755 $(BUILD)/$(KILN_SOFILE) $(DESTDIR)$(LIBDIR)/$(KILN_SOFILE)
	ln -sf $(KILN_SOFILE) $(DESTDIR)$(LIBDIR)/$(KILN_SONAME)
	ln -sf $(KILN_SONAME) $(DESTDIR)$(LIBDIR)/libkiln.so
	install -m 644 bindings/kiln.h $(DESTDIR)$(INCDIR)/kiln.h
	install -m 644 runtime/kiln_status.h $(DESTDIR)$(INCDIR)/kiln_status.h
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(KILN_VERSION)|g' -e 's|@CUDA_LIBS@|$(CUDA_LIBS)|g' \
	  -e 's|@HIREDIS_LIBS@|$(HIREDIS_LIBS)|g' bindings/kiln.pc.in \
	  > $(DESTDIR)$(LIBDIR)/pkgconfig/kiln.pc
	chmod 644 $(DESTDIR)$(LIBDIR)/pkgconfig/kiln.pc
	install -m 755 $(BUILD)/lua/kiln.so $(DESTDIR)$(LUA_CMOD)/kiln.so
	install -m 644 bindings/kiln.1 $(DESTDIR)$(MANDIR)/man1/kiln.1
	install -m 644 bindings/kiln.meta.lua $(DESTDIR)$(DATADIR)/kiln.meta.lua
	install -m 644 runtime/data/LICENSE-CLIP $(DESTDIR)$(DATADIR)/LICENSE-CLIP
	install -m 644 runtime/data/LICENSE-T5 $(DESTDIR)$(DATADIR)/LICENSE-T5

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/kiln $(DESTDIR)$(LIBDIR)/libkiln.a $(DESTDIR)$(LIBDIR)/libkiln.so \
	  $(DESTDIR)$(LIBDIR)/$(KILN_SONAME) $(DESTDIR)$(LIBDIR)/$(KILN_SOFILE) \
	  $(DESTDIR)$(INCDIR)/kiln.h $(DESTDIR)$(INCDIR)/kiln_status.h $(DESTDIR)$(LIBDIR)/pkgconfig/kiln.pc $(DESTDIR)$(LUA_CMOD)/kiln.so \
	  $(DESTDIR)$(MANDIR)/man1/kiln.1 $(DESTDIR)$(DATADIR)/kiln.meta.lua $(DESTDIR)$(DATADIR)/LICENSE-CLIP \
	  $(DESTDIR)$(DATADIR)/LICENSE-T5
	-rmdir $(DESTDIR)$(DATADIR) 2>/dev/null || true

# header dependencies written by -MMD (none before the first build)
-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
