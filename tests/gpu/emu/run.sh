#!/usr/bin/env bash
# tests/gpu/emu/run.sh - runs the CUDA backend's parity test on the CPU, against an
# emulation of CUDA (tests/gpu/emu/emu_runtime.cpp): the real cuda_backend.c, cuda_context.c and the
# real kernels of kernels/cuda/*.cu, compiled as host C++ (g++) with threads as
# coroutines. It catches indexing, launch-shape, barrier, shuffle, dtype and
# cuBLAS/cuDNN-argument mistakes on a machine without a GPU (about a minute);
# stream ordering, real numerics and speed need tests/gpu/run.sh on a GPU.
# Usage: bash tests/gpu/emu/run.sh [test names...]      (x86-64, g++, CUDA headers)
#   B=FOLDER puts the objects and the test program elsewhere (default build/gpu-emu).
#   KILN_LIB=FOLDER (a CUDA=0 build: make BUILD=FOLDER CUDA=0 all) also links the kiln
#   program over the emulation ($B/kiln, whose cuda:0 is emulated) and runs the demo
#   networks on it in half precision against the cpu (tests/gpu/half_networks.lua,
#   a smaller run than on a GPU); EMU_ONLY=lua runs only that.
set -eu
cd "$(dirname "$0")/../../.."
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
B=${B:-build/gpu-emu}
E=tests/gpu/emu
mkdir -p "$B/obj"
pids=()
# every host backend (kernels/*/ but cuda's), so kernels/backends.c finds its registrars
for f in runtime/*.c kernels/*.c $(ls kernels/*/*.c | grep -v '^kernels/cuda/'); do
  gcc -std=c11 -O1 -g -c "$f" -o "$B/obj/$(echo "$f" | tr / _).o" & pids+=($!)
done
# the runtime's compiled-in data (the built-in CLIP and T5 vocabularies), made as the Makefile makes it
if [ -f runtime/data/gen_blob.lua ]; then
  lua5.4 runtime/data/gen_blob.lua "$B/clip_vocab.c" kiln_clip_vocab_gz runtime/data/bpe_simple_vocab_16e6.txt.gz
  gcc -std=c11 -O1 -c "$B/clip_vocab.c" -o "$B/obj/clip_vocab.o" & pids+=($!)
  lua5.4 runtime/data/gen_blob.lua "$B/t5_vocab.c" kiln_t5_vocab_gz runtime/data/t5_spiece.bin.gz
  gcc -std=c11 -O1 -c "$B/t5_vocab.c" -o "$B/obj/t5_vocab.o" & pids+=($!)
fi
for f in cuda_backend cuda_context; do
  gcc -std=c11 -Wall -Wextra -O1 -g -I"$CUDA_HOME/include" -c kernels/cuda/$f.c -o "$B/obj/$f.o" & pids+=($!)
done
g++ -std=c++17 -O1 -g -ffp-contract=off -I"$CUDA_HOME/include" -c "$E/emu_runtime.cpp" -o "$B/obj/emu_runtime.o" & pids+=($!)
for f in kernels/cuda/*.cu; do
  b=$(basename "$f" .cu)
  lua5.4 "$E/translate.lua" "$f" "$B/$b.cpp"
  g++ -std=c++17 -O1 -g -ffp-contract=off -w -I"$CUDA_HOME/include" -Ikernels/cuda -include "$E/emu_prelude.h" \
    -c "$B/$b.cpp" -o "$B/obj/$b.cu.o" & pids+=($!)
done
gcc -std=c11 -Wall -Wextra -O1 -g -Iruntime -Ikernels/cpu -c tests/test_cuda_parity.c -o "$B/obj/test_cuda_parity.o" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
g++ -o "$B/test_cuda_parity_emu" "$B"/obj/*.o -lopenblas -lpng -lz -lm -lpthread
rc=0
if [ "${EMU_ONLY:-}" != lua ]; then "$B/test_cuda_parity_emu" "$@" || rc=$?; fi
if [ -n "${KILN_LIB:-}" ]; then
  # the CUDA objects come first, so the archive's cuda_none.o (the CUDA=0 registrar)
  # is never pulled in
  defs=""; rl=""; redis=""
  [ -f /usr/include/readline/readline.h ] && { defs="-DKILN_READLINE"; rl="-lreadline"; }
  nm "$KILN_LIB/libkiln.a" 2>/dev/null | grep -q ' U redisConnect' && redis="-lhiredis"
  gcc -std=c11 -O1 -g $defs $(pkg-config --cflags lua5.4) -c bindings/kiln_main.c -o "$B/kiln_main.o"
  for f in bindings/repl_*.c; do gcc -std=c11 -O1 -g $defs $(pkg-config --cflags lua5.4) -c "$f" -o "$B/$(basename "$f" .c).o"; done
  g++ -o "$B/kiln" "$B/kiln_main.o" "$B"/repl_*.o "$B/obj/cuda_backend.o" "$B/obj/cuda_context.o" "$B"/obj/*.cu.o "$B/obj/emu_runtime.o" \
    "$KILN_LIB/libkiln.a" $(pkg-config --libs lua5.4) -lopenblas -lpng -lz -lm -lpthread $redis $rl
  KILN_EMU=1 "$B/kiln" tests/gpu/half_networks.lua cuda:0 || rc=1
fi
exit $rc
