// libFuzzer target: safetensors header validation (format/safetensors.cpp) over arbitrary bytes. Anything but a
// moesrv::Error naming the problem is a bug; an accepted file's tensors must lie inside the input (ASan checks the
// reads of each tensor's first and last byte and element).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "format/safetensors.h"
#include "util/error.h"

using namespace moesrv;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto bytes = std::make_shared<std::vector<uint8_t>>(data, data + size);
  try {
    auto f = SafetensorsFile::from_memory(bytes->data(), bytes->size(), bytes, "<fuzz>");
    volatile uint8_t sink = 0;
    for (const auto& [name, t] : f->tensors()) {
      if (t.nbytes == 0) continue;
      sink = sink ^ t.data[0] ^ t.data[t.nbytes - 1];
      const int64_t n = t.numel();
      if (n > 0) sink = sink ^ uint8_t(t.at(0) != 0) ^ uint8_t(t.at(n - 1) != 0);
    }
  } catch (const Error&) {
  }
  return 0;
}
