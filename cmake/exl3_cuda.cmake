# EXL3 CUDA check + benchmark program; included from CMakeLists.txt inside if(MOESRV_CUDA).
# (bench/exl3_cuda_build.sh builds the same program without CMake, for machines lacking the other deps.)
add_executable(exl3_cuda_bench ${CMAKE_SOURCE_DIR}/bench/exl3_cuda_bench.cu)
moesrv_project_target(exl3_cuda_bench)
target_link_libraries(exl3_cuda_bench PRIVATE moesrv_core moesrv_cuda CUDA::cublas CUDA::cudart)
target_compile_options(exl3_cuda_bench PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
# Every kernel of a glm5_next decode step at the real shapes, replayed from CUDA graphs (docs/perf-cuda.md).
add_executable(cuda_kernel_bench ${CMAKE_SOURCE_DIR}/bench/cuda_kernel_bench.cu)
moesrv_project_target(cuda_kernel_bench)
target_link_libraries(cuda_kernel_bench PRIVATE moesrv_core moesrv_cuda CUDA::cublas CUDA::cudart)
target_compile_options(cuda_kernel_bench PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
