# Compiler flags for moesrv's own targets (included from CMakeLists.txt before any target is defined).
#
#   MOESRV_WERROR    (ON)   -Wall -Wextra (minus the exceptions below) and -Werror on moesrv targets only.
#                           Third-party headers come from system include dirs (/usr/include, the CUDA toolkit), so
#                           their warnings are not reported; keep it that way (SYSTEM) when adding a dependency.
#   MOESRV_SANITIZE  (OFF)  AddressSanitizer + UndefinedBehaviorSanitizer on every C++ object and link
#                           (scripts/ci_asan.sh). Any UB report aborts the test (-fno-sanitize-recover).
#
# moesrv_project_target(<target>) applies the warning flags to one target; CMakeLists.txt calls it for every
# library, executable, tool and test it defines.

option(MOESRV_WERROR "Treat compiler warnings in moesrv code as errors" ON)
option(MOESRV_SANITIZE "Build with -fsanitize=address,undefined (tests and tools included)" OFF)

# -Wno-missing-field-initializers: options structs are filled with C++20 designated initializers
# (`{.queue_max = 1}`), and omitting the members that keep their defaults is the point (GCC 12 warns even
# for members of class type such as std::string).
set(MOESRV_CXX_WARNINGS -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC's -Wmaybe-uninitialized is flow-sensitive and changes with the optimizer (and -fsanitize): noise.
  list(APPEND MOESRV_CXX_WARNINGS -Wno-maybe-uninitialized)
  if(CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    # GCC 12 -O3 reports impossible memcpy overlaps inside libstdc++ for `"literal" + std::string`
    # (GCC bug 105329/105651, fixed in 13).
    list(APPEND MOESRV_CXX_WARNINGS -Wno-restrict)
  endif()
endif()
if(MOESRV_WERROR)
  list(APPEND MOESRV_CXX_WARNINGS -Werror)
endif()

function(moesrv_project_target target)
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${MOESRV_CXX_WARNINGS}>")
  # .cu files: nvcc's own diagnostics become errors under MOESRV_WERROR (host-compiler warnings are not
  # forwarded: nvcc's generated host code is not -Wall clean).
  if(MOESRV_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings>)
  endif()
endfunction()

if(MOESRV_SANITIZE)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    message(FATAL_ERROR "MOESRV_SANITIZE needs GCC or Clang")
  endif()
  set(MOESRV_SANITIZE_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${MOESRV_SANITIZE_FLAGS}>")
  add_link_options(-fsanitize=address,undefined)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 12.3)
    # GCC < 12.3 at -O1: AVX-512 intrinsics (_mm512_srli_epi32 in format/exl3_tile.cpp) report their own
    # _mm512_undefined_epi32() as "used uninitialized" (GCC bug 105593). Release builds keep the warning.
    list(APPEND MOESRV_CXX_WARNINGS -Wno-uninitialized)
  endif()
  message(STATUS "moesrv: ASan + UBSan build")
endif()
