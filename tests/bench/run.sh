#!/usr/bin/env bash
# tests/bench/run.sh - `make bench`: builds the benchmark programs and runs them.
# Each prints its own table with ratios against a reference measured in the same
# run (OpenBLAS, PyTorch CPU through /usr/bin/python3 when Debian's python3-torch is
# installed, or the unbounded run). BENCH_QUICK=1 shrinks the SD benchmark.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
CC=${CC:-cc}
CFLAGS="-std=c11 -O2 -g $(pkg-config --cflags lua5.4 libpng) -Iruntime -Ikernels/cpu"
LIBS="$BUILD/libkiln.a $(pkg-config --libs libpng lua5.4) -lz -lopenblas -lpthread -lm"
mkdir -p "$BUILD/bench"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), threads ${KILN_THREADS:-$(nproc)}"
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "note: /usr/bin/python3 with torch not found (apt-get install python3-torch): PyTorch columns are empty"
fi
status=0
for b in bench_gemm_conv bench_nn; do
  $CC $CFLAGS -o "$BUILD/bench/$b" "tests/bench/$b.c" $LIBS || { status=1; continue; }
  echo; echo "== $b"
  "$BUILD/bench/$b" || status=1
done
echo; echo "== bench_modes (demo workflow: memory modes and tiling on sim)"
"$BUILD/kiln" tests/bench/bench_modes.lua || status=1
echo; echo "== bench_sd (SD 1.5 architecture, random f16 weights)"
"$BUILD/kiln" tests/bench/bench_sd.lua ${BENCH_QUICK:+--quick} || status=1
echo; echo "== bench_sdxl (SDXL architecture, random f16 weights, 2 GiB sim budget)"
"$BUILD/kiln" tests/bench/bench_sdxl.lua ${BENCH_QUICK:+--size 512} || status=1
echo; echo "== bench_batch (kiln batch on a local redis-server, demo model)"
bash tests/bench/bench_batch.sh "$BUILD/kiln" || status=1
exit $status
