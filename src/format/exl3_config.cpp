#include "format/exl3_config.h"

#include "util/error.h"

namespace moesrv {

std::optional<Exl3QuantConfig> parse_exl3_config(const nlohmann::json& config) {
  if (!config.is_object() || !config.contains("quantization_config")) return std::nullopt;
  const auto& q = config["quantization_config"];
  if (!q.is_object() || q.value("quant_method", std::string()) != "exl3") return std::nullopt;
  Exl3QuantConfig c;
  c.raw = q;
  MOESRV_CHECK(q.contains("bits") && q["bits"].is_number(), "quantization_config (exl3): 'bits' missing or not a number");
  c.bits = q["bits"].get<double>();
  MOESRV_CHECK(c.bits > 0 && c.bits <= 8, "quantization_config (exl3): bits = {} out of range (0, 8]", c.bits);
  if (q.contains("head_bits")) {
    MOESRV_CHECK(q["head_bits"].is_number(), "quantization_config (exl3): 'head_bits' is not a number");
    c.head_bits = int(q["head_bits"].get<double>());
  }
  std::string cb = q.value("codebook", std::string("3inst"));
  MOESRV_CHECK(parse_exl3_codebook(cb, c.codebook), "quantization_config (exl3): unknown codebook '{}'", cb);
  if (q.contains("version") && q["version"].is_string()) c.version = q["version"].get<std::string>();
  if (q.contains("out_scales") && q["out_scales"].is_string()) c.out_scales = q["out_scales"].get<std::string>();
  return c;
}

nlohmann::json exl3_config_json(const Exl3QuantConfig& c) {
  nlohmann::json q = c.raw.is_object() ? c.raw : nlohmann::json::object();
  q["quant_method"] = "exl3";
  q["bits"] = c.bits;
  q["head_bits"] = c.head_bits;
  q["codebook"] = std::string(exl3_codebook_name(c.codebook));
  if (!c.version.empty()) q["version"] = c.version;
  if (!c.out_scales.empty()) q["out_scales"] = c.out_scales;
  return q;
}

}  // namespace moesrv
