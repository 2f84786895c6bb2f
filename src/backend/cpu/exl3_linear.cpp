#include "backend/cpu/exl3_linear.h"

#include "util/error.h"

namespace moesrv {

// Placeholder until the EXL3 decoder lands (issue 4).
std::unique_ptr<Linear> make_exl3_linear(const ModelPackage& pkg, const std::string& prefix) {
  fail("{}: EXL3 tensor {} found, but EXL3 decoding is not built yet", pkg.dir(), prefix);
}

}  // namespace moesrv
