// config.json `quantization_config` of an EXL3 model, e.g.
// {"quant_method": "exl3", "version": "1.4.4", "bits": 2.05, "head_bits": 5, "codebook": "mul1", ...}.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "format/exl3_codebook.h"

namespace moesrv {

struct Exl3QuantConfig {
  double bits = 0;                        // average bits per weight (may be fractional: K mixes across tensors)
  int head_bits = 0;                      // lm_head bits (0: absent)
  Exl3Codebook codebook = Exl3Codebook::Inst3;  // default codebook; each tensor's marker (.mcg/.mul1) decides
  std::string version;                    // exllamav3 version that wrote it, if given
  std::string out_scales;                 // "always", "never", "auto"... if given
  nlohmann::json raw;                     // the whole object
};

// nullopt when there is no quantization_config or its quant_method is not "exl3"; throws Error when an
// EXL3 config is malformed (bits missing or not a number, unknown codebook).
std::optional<Exl3QuantConfig> parse_exl3_config(const nlohmann::json& config);

// The object to store as config["quantization_config"].
nlohmann::json exl3_config_json(const Exl3QuantConfig& q);

}  // namespace moesrv
