#!/usr/bin/env bash
# Builds the CUDA binaries here and packs them, with their non-system shared libraries and the hf-tiny test
# models, into .gpu/ for a GPU machine that has the CUDA runtime but no build dependencies. On that machine:
#   mkdir -p /work/shared && cp -r .gpu/testdata /work/shared/ && export LD_LIBRARY_PATH=$PWD/.gpu/lib
#   .gpu/test_cuda_engine && .gpu/moesrv generate --backend cuda --model /work/shared/testdata/hf-tiny/glm_moe_dsa ...
# (the tests look for the models at the absolute path compiled in: <repo>/../shared/testdata).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMOESRV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DMOESRV_NATIVE=OFF -DCMAKE_CXX_FLAGS="-march=x86-64-v3" >/dev/null
cmake --build build-gpu -j"$(nproc)" --target moesrv test_cuda_engine bench
rm -rf .gpu && mkdir -p .gpu/lib .gpu/testdata/hf-tiny
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
cp build-gpu/moesrv build-gpu/test_cuda_engine build-gpu/bench .gpu/
ldd build-gpu/moesrv | awk '$3 ~ /^\// {print $3}' \
  | grep -vE '/(libc|libm|libgcc_s|libstdc\+\+|libdl|libpthread|librt|libresolv)\.so|/cuda' \
  | xargs -I{} cp -L {} .gpu/lib/
for m in deepseek_v3 deepseek_v3_yarn glm4_moe glm4_moe_lite glm_moe_dsa; do
  cp -r ../shared/testdata/hf-tiny/$m .gpu/testdata/hf-tiny/
done
du -sh .gpu
