// Element types found in safetensors files.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moesrv {

enum class DType { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
bool parse_dtype(std::string_view s, DType& out);  // false for unknown names

}  // namespace moesrv
