// EXL3 (ExLlamaV3 trellis) linear layers: see src/format/exl3*.h for the format.
#pragma once
#include <memory>
#include <string>

#include "backend/cpu/linear.h"

namespace moesrv {

// Builds an EXL3 linear from `<prefix>.trellis`, `.suh`, `.svh` (or legacy `.su`/`.sv`), optional `.mcg`/`.mul1`
// and `.bias`. Throws a clear error when pieces are missing or shapes disagree.
std::unique_ptr<Linear> make_exl3_linear(const ModelPackage& pkg, const std::string& prefix);

}  // namespace moesrv
