#!/usr/bin/env bash
# Builds bench/exl3_cuda_bench without CMake or system fmt/json libraries beyond headers (used here and on
# the GPU machine). Usage: bench/exl3_cuda_build.sh <out_dir> [arch list, default "90"]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build-exl3-cuda}; ARCHS=${2:-90}
mkdir -p "$OUT/obj"
GENCODE=""; for a in $ARCHS; do GENCODE="$GENCODE -gencode=arch=compute_$a,code=sm_$a"; done
INC="-Isrc ${EXL3_EXTRA_INC:-}"
CPU_SRCS="src/format/exl3_codebook.cpp src/format/exl3_tile.cpp src/format/exl3_hadamard.cpp src/format/exl3_weights.cpp
  src/backend/cpu/exl3_linear.cpp src/util/thread_pool.cpp src/format/tensor_view.cpp src/format/dtype.cpp
  src/format/safetensors.cpp src/format/package.cpp"
pids=()
for f in $CPU_SRCS; do
  g++ -std=c++20 -O2 -mavx2 -mfma $INC -c "$f" -o "$OUT/obj/$(basename "$f" .cpp).o" & pids+=($!)
done
for f in exl3_gemv exl3_linear_cuda; do
  nvcc -std=c++20 -O3 $GENCODE --expt-relaxed-constexpr -lineinfo $INC -c src/backend/cuda/$f.cu -o "$OUT/obj/$f.o" & pids+=($!)
done
nvcc -std=c++20 -O3 $GENCODE --expt-relaxed-constexpr $INC -c bench/exl3_cuda_bench.cu -o "$OUT/obj/exl3_cuda_bench.o" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
CUDA_LIB=$(dirname "$(command -v nvcc)")/../lib64
# libfmt: the system one, else a copy carried next to the binary (the GPU image has no libfmt)
FMT_LIB=${EXL3_FMT_LIB:-$(ls /usr/lib/x86_64-linux-gnu/libfmt.so.* 2>/dev/null | head -1)}
cp -f "$FMT_LIB" "$OUT/"
g++ -o "$OUT/exl3_cuda_bench" "$OUT"/obj/*.o -L"$CUDA_LIB" "$OUT/$(basename "$FMT_LIB")" -lcudart_static -lcublas \
  -lpthread -ldl -lrt -static-libstdc++ -static-libgcc -Wl,-rpath,"\$ORIGIN:$CUDA_LIB"
echo "built $OUT/exl3_cuda_bench"
