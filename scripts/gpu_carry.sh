#!/usr/bin/env bash
# Builds the CUDA binaries here and packs them, with their non-system shared libraries, the hf-tiny test models
# and their EXL3 conversions (made here: test encoder), into .gpu/ for a GPU machine that has the CUDA runtime but
# no build dependencies. On that machine:
#   mkdir -p /work/shared && cp -r .gpu/testdata /work/shared/ && export LD_LIBRARY_PATH=$PWD/.gpu/lib
#   .gpu/test_cuda_engine && MOESRV_EXL3_CACHE=.gpu/testdata/exl3 .gpu/test_cuda_exl3_engine
#   .gpu/moesrv generate --backend cuda --model /work/shared/testdata/hf-tiny/glm_moe_dsa ...
# (the tests look for the models at the absolute path compiled in: <repo>/../shared/testdata).
# JOBS=N limits the build's parallelism (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOESRV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
      -DMOESRV_NATIVE=OFF -DCMAKE_CXX_FLAGS="-march=x86-64-v3 -Wno-psabi" >/dev/null
cmake --build build-gpu -j"${JOBS:-$(nproc)}" --target moesrv test_cuda_engine test_cuda_exl3_engine test_cuda_exl3_synthetic \
      test_cuda_glm5_next_kernels test_cuda_pipeline test_cuda_mtp test_cuda_batch bench exl3_cuda_bench \
      cuda_kernel_bench exl3_strip_bench exl3_expert_bench
rm -rf .gpu && mkdir -p .gpu/lib .gpu/testdata/hf-tiny
mkdir -p .git/info && (grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude)
cp build-gpu/moesrv build-gpu/test_cuda_engine build-gpu/test_cuda_exl3_engine build-gpu/test_cuda_exl3_synthetic \
   build-gpu/test_cuda_glm5_next_kernels build-gpu/test_cuda_pipeline build-gpu/test_cuda_mtp build-gpu/test_cuda_batch \
   build-gpu/bench build-gpu/exl3_cuda_bench \
   build-gpu/cuda_kernel_bench build-gpu/exl3_strip_bench build-gpu/exl3_expert_bench .gpu/
ldd build-gpu/moesrv | awk '$3 ~ /^\// {print $3}' \
  | grep -vE '/(libc|libm|libgcc_s|libstdc\+\+|libdl|libpthread|librt|libresolv)\.so|/cuda' \
  | xargs -I{} cp -L {} .gpu/lib/
for m in deepseek_v3 deepseek_v3_yarn glm4_moe glm4_moe_lite glm_moe_dsa glm_moe_dsa_h16 glm5_next glm5_next_clamp \
         qwen3_next; do
  cp -r ../shared/testdata/hf-tiny/$m .gpu/testdata/hf-tiny/
done
MOESRV_EXL3_CACHE=build-gpu/exl3 build-gpu/test_cuda_exl3_engine --gtest_filter='CudaExl3Prepare.*' >/dev/null
cp -r build-gpu/exl3 .gpu/testdata/exl3
du -sh .gpu
