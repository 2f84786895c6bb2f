// OpenAI-style API errors: thrown while handling a request, rendered as {"error":{message,type,param,code}}.
#pragma once
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace moesrv {

struct ApiError : std::runtime_error {
  int status;
  std::string type, param, code;
  ApiError(int status, std::string message, std::string type = "invalid_request_error", std::string param = "",
           std::string code = "")
      : std::runtime_error(std::move(message)), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}

  nlohmann::json to_json() const {
    auto opt = [](const std::string& s) { return s.empty() ? nlohmann::json(nullptr) : nlohmann::json(s); };
    return {{"error", {{"message", what()}, {"type", type}, {"param", opt(param)}, {"code", opt(code)}}}};
  }
};

inline ApiError bad_request(std::string message, std::string param = "", std::string code = "") {
  return ApiError(400, std::move(message), "invalid_request_error", std::move(param), std::move(code));
}

}  // namespace moesrv
