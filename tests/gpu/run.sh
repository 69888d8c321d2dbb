#!/usr/bin/env bash
# tests/gpu/run.sh - the CUDA backend on a real GPU, in one go (sized for < 5 minutes):
#   1. build kiln with CUDA=1 for this GPU's architecture (warnings are counted); when
#      the Makefile has no CUDA rules yet, only the parity test is built (build/gpu-direct);
#   2. the cpu-vs-cuda parity test (every op x dtype x shapes, guard bytes, transfers,
#      OOM), then a compute-sanitizer memcheck of the custom kernels when available;
#   3. examples/txt2img.lua on cuda:0 in each memory mode under a small --vram, and
#      the images of the modes compared;
#   4. the demo networks in f16 and bf16 activations against the cpu in f32
#      (tests/gpu/half_networks.lua);
#   5. benchmarks: single ops at SD 1.5 sizes, one SD 1.5 UNet step (random weights,
#      512x512, batch 2) and a VAE decode (512x512) in f32, f16 and bf16: time, it/s
#      and activation peak (tests/gpu/bench_precision.lua).
# Usage (from anywhere): bash tests/gpu/run.sh [--quick]
#   --quick  skips memcheck and the demo.  Logs go to $OUT (default build/gpu-run).
# Exit status: non-zero when the build, the parity test, the demo, the half-precision
# networks or the halved activation peak fail.
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/build/gpu-run}
mkdir -p "$OUT"
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$CUDA_HOME/bin/nvcc}
JOBS=$(nproc 2>/dev/null || echo 4)
failures=()
t_start=$(date +%s)

section() { printf '\n== %s  (%ds)\n' "$*" $(( $(date +%s) - t_start )); }
fail() { failures+=("$1"); echo "FAILED: $1"; }

section "GPU"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
else
  echo "nvidia-smi not found"; CC=""
fi
"$NVCC" --version | tail -2
# build only for the GPU at hand (the full sm_80..sm_90 + PTX build is checked without a GPU)
ARCHS=${CUDA_ARCHS:-${CC:-90}}

# ---------------------------------------------------------------------------- build
section "build (CUDA=1, CUDA_ARCHS=$ARCHS)"
PARITY= KILN=
if grep -q 'nvcc\|NVCC' Makefile 2>/dev/null; then
  if make -j"$JOBS" CUDA=1 CUDA_ARCHS="$ARCHS" all build/tests/test_cuda_parity >"$OUT/build.log" 2>&1; then
    PARITY=build/tests/test_cuda_parity
    KILN=build/kiln
  else
    tail -40 "$OUT/build.log"; fail "make CUDA=1"
  fi
else
  echo "the Makefile has no CUDA rules yet: building the parity test directly into build/gpu-direct/"
  B=$ROOT/build/gpu-direct
  mkdir -p "$B/obj"
  {
    for f in runtime/*.c kernels/*.c $(ls kernels/*/*.c | grep -v '^kernels/cuda/'); do
      echo "gcc -std=c11 -Wall -Wextra -O2 -g -c $f -o $B/obj/$(echo "$f" | tr / _).o"
    done
    for f in cuda_backend cuda_context; do
      echo "gcc -std=c11 -Wall -Wextra -O2 -g -I$CUDA_HOME/include -c kernels/cuda/$f.c -o $B/obj/$f.o"
    done
    for f in kernels/cuda/*.cu; do
      echo "$NVCC -std=c++17 -O2 -g -Xcompiler -Wall,-Wextra -gencode arch=compute_$ARCHS,code=sm_$ARCHS -c $f -o $B/obj/$(basename "$f" .cu).cu.o"
    done
  } >"$B/cmds"
  if xargs -P "$JOBS" -I{} sh -c '{}' <"$B/cmds" >"$OUT/build.log" 2>&1 &&
     gcc -std=c11 -Wall -Wextra -O2 -g -Iruntime -Ikernels/cpu tests/test_cuda_parity.c "$B"/obj/*.o \
       -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudnn -lcublas -lcudart -lstdc++ \
       -lopenblas -lpng -lz -lm -lpthread -o "$B/test_cuda_parity" >>"$OUT/build.log" 2>&1; then
    PARITY=$B/test_cuda_parity
  else
    tail -40 "$OUT/build.log"; fail "direct build"
  fi
fi
nwarn=$(grep -ci 'warning' "$OUT/build.log" || true)
echo "compiler warnings: $nwarn (log: $OUT/build.log)"
[ "$nwarn" = 0 ] || grep -i -m 20 'warning' "$OUT/build.log"

# ---------------------------------------------------------------------------- parity
if [ -n "$PARITY" ]; then
  section "parity: cpu vs cuda:0"
  KILN_TEST_VERBOSE=1 timeout 300 "$PARITY" >"$OUT/parity.log" 2>&1
  rc=$?
  grep -E '^(PASS|FAIL|SKIP|# )' "$OUT/parity.log" | head -60
  grep -E '^ +|^FAIL' "$OUT/parity.log" | head -40
  nfail=$(grep -c '^FAIL' "$OUT/parity.log" || true)
  if grep -q '^SKIP t_no_device' "$OUT/parity.log"; then fail "parity: no CUDA device found"
  elif [ "$rc" != 0 ] || [ "$nfail" != 0 ]; then
    fail "parity ($nfail failed, exit $rc)"
    echo "re-running the failed tests with KILN_CUDA_SYNC=1 (errors attributed to their op):"
    for t in $(grep '^FAIL' "$OUT/parity.log" | sed 's/^FAIL \(t_[a-z0-9_]*\).*/\1/' | sort -u); do
      KILN_CUDA_SYNC=1 timeout 60 "$PARITY" "$t" 2>&1 | grep -v '^#   ' | head -20
    done
  fi
  echo "worst nmse per op (full list in $OUT/parity.log):"
  grep '^#   ' "$OUT/parity.log" | awk '{ op=$2; v=$(NF-2); if (!(op in m) || v+0 > m[op]+0) m[op]=v } END { for (o in m) printf "  %-14s %s\n", o, m[o] }' | sort

  SAN=$(command -v compute-sanitizer || ls "$CUDA_HOME"/bin/compute-sanitizer 2>/dev/null || true)
  if [ "$QUICK" = 0 ] && [ -n "$SAN" ]; then
    section "compute-sanitizer memcheck (custom kernels)"
    timeout 150 "$SAN" --tool memcheck --leak-check no --error-exitcode 3 "$PARITY" \
      t_copy t_binary t_reduce t_group_norm t_softmax t_attention t_resample t_pad2d \
      >"$OUT/memcheck.log" 2>&1
    rc=$?
    tail -5 "$OUT/memcheck.log"
    if [ "$rc" = 124 ]; then echo "memcheck: timed out (not counted)";
    elif [ "$rc" != 0 ]; then grep -m 20 -E 'Invalid|ERROR|FAIL' "$OUT/memcheck.log"; fail "memcheck (exit $rc)"; fi
  elif [ "$QUICK" = 0 ]; then
    echo "(compute-sanitizer not found: memcheck skipped)"
  fi
fi

# ---------------------------------------------------------------------------- demo workflow
section "demo: examples/txt2img.lua on cuda:0 in each memory mode"
if [ "$QUICK" = 1 ]; then
  echo "skipped (--quick)"
elif [ -z "$KILN" ]; then
  echo "skipped: no kiln binary (the Makefile has no CUDA rules yet)"
elif [ ! -f examples/txt2img.lua ]; then
  echo "skipped: examples/txt2img.lua does not exist yet"
elif [ ! -f "${TXT2IMG_MODEL:=examples/models/kiln-shapes.safetensors}" ]; then
  echo "skipped: no model at $TXT2IMG_MODEL (set TXT2IMG_MODEL to a checkpoint)"
else
  for mode in high normal low; do
    vram=2G
    [ "$mode" = low ] && vram=1G
    t0=$(date +%s.%N)
    if timeout 120 "$KILN" examples/txt2img.lua --device cuda --mode "$mode" --vram "$vram" --seed 42 --steps 8 \
         --model "$TXT2IMG_MODEL" --prompt "a red circle on a blue background" --out "$OUT/txt2img-$mode.png" >"$OUT/txt2img-$mode.log" 2>&1; then
      printf '  %-7s --vram %-3s %6.1f s\n' "$mode" "$vram" "$(awk -v s="$t0" -v e="$(date +%s.%N)" 'BEGIN { print e - s }')"
      tail -12 "$OUT/txt2img-$mode.log" | sed 's/^/      /'
    else
      tail -20 "$OUT/txt2img-$mode.log"; fail "txt2img --mode $mode"
    fi
  done
  # the memory mode changes where weights live, not the arithmetic: the images must agree
  # (cuDNN may pick another algorithm when less memory is free: allow 2/255)
  if [ -f "$OUT/txt2img-high.png" ]; then
    for mode in normal low; do
      [ -f "$OUT/txt2img-$mode.png" ] || continue
      if cmp -s "$OUT/txt2img-high.png" "$OUT/txt2img-$mode.png"; then echo "  high vs $mode: identical"; continue; fi
      "$KILN" -e "
        local a, b = kiln.load_png('$OUT/txt2img-high.png'), kiln.load_png('$OUT/txt2img-$mode.png')
        local d = (a - b):abs():reshape({ -1 }):table()
        local m = 0
        for _, v in ipairs(d) do if v > m then m = v end end
        print(('  high vs $mode: max difference %.4f'):format(m))
        if m > 2 / 255 + 1e-6 then os.exit(1) end" || fail "txt2img: mode $mode differs from high"
    done
  fi
fi

section "the demo networks in half precision (f16, bf16) against the cpu in f32"
if [ -z "$KILN" ] || [ ! -f examples/models/kiln-shapes.safetensors ]; then
  echo "skipped: no kiln binary or no demo model"
elif timeout 150 "$KILN" tests/gpu/half_networks.lua cuda:0 >"$OUT/half_networks.log" 2>&1; then
  grep -E '^(PASS|SKIP|# )' "$OUT/half_networks.log" | sed 's/^/  /'
else
  sed 's/^/  /' "$OUT/half_networks.log" | tail -40; fail "half-precision networks"
fi

section "tiled VAE on cuda:0 against the untiled decode (lockstep GroupNorm)"
if [ -z "$KILN" ] || [ ! -f examples/models/kiln-shapes.safetensors ]; then
  echo "skipped: no kiln binary or no demo model"
elif KILN_TEST_DEVICE=cuda:0 timeout 300 "$KILN" tests/lua/test_vae_tiled.lua >"$OUT/vae_tiled.log" 2>&1; then
  sed 's/^/  /' "$OUT/vae_tiled.log"
else
  sed 's/^/  /' "$OUT/vae_tiled.log"; fail "tiled VAE on cuda:0"
fi

# ---------------------------------------------------------------------------- benchmarks
section "benchmarks"
if [ -n "$PARITY" ]; then
  timeout 120 "$PARITY" --bench 2>&1 | tee "$OUT/bench_ops.log"
fi
if [ -z "$KILN" ]; then
  echo "UNet/VAE benchmark skipped: no kiln binary"
elif [ ! -f scripts/kiln/unet.lua ] || [ ! -f scripts/kiln/vae.lua ]; then
  echo "UNet/VAE benchmark skipped: scripts/kiln/unet.lua or vae.lua does not exist yet"
else
  # f32, f16, bf16: time, it/s and activation peak (halved in half precision)
  timeout 150 "$KILN" tests/gpu/bench_precision.lua cuda:0 2>&1 | tee "$OUT/bench_precision.log"
  grep -q '^FAIL' "$OUT/bench_precision.log" && fail "half precision does not halve the activation peak"
fi

# ---------------------------------------------------------------------------- summary
section "done"
if [ ${#failures[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failures[@]}"
  exit 1
fi
echo "all GPU checks passed"
