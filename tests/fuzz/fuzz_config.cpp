// libFuzzer target: config.json -> ModelSpec (model/registry.cpp and the arch/ descriptions), then what every
// command derives from a spec before loading weights: the tensor manifest and the per-sequence state bytes. A
// malformed config must end in a moesrv::Error naming the problem; anything else (a crash, a huge allocation, a
// hang) is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "model/manifest.h"
#include "model/spec.h"
#include "model/state.h"
#include "util/error.h"

using namespace moesrv;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto j = nlohmann::json::parse(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size,
                                 nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    const ModelSpec s = ModelSpec::from_json(j);
    (void)manifest(s, "model.");
    (void)state_bytes(s, 4096, 2, 4, 0, -1, 2);
  } catch (const Error&) {
  }
  return 0;
}
