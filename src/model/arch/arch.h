// One describe() per architecture: config.json (its text fields) -> ModelSpec. registry.cpp maps model_type.
#pragma once
#include <nlohmann/json.hpp>

#include "model/spec.h"

namespace moesrv::arch {

ModelSpec describe_deepseek(const nlohmann::json& text);
ModelSpec describe_glm4_moe(const nlohmann::json& text);
ModelSpec describe_glm5_next(const nlohmann::json& text);
ModelSpec describe_qwen3_next(const nlohmann::json& text);

}  // namespace moesrv::arch
