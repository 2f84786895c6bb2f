#include "format/exl3_convert.h"

#include <deque>
#include <filesystem>
#include <fstream>

#include "format/exl3_config.h"
#include "format/exl3_encode.h"
#include "format/package.h"
#include "format/safetensors.h"
#include "util/error.h"

namespace moesrv {

namespace fs = std::filesystem;

bool exl3_should_quantize(const std::string& name, const TensorView& t) {
  if (t.shape.size() != 2) return false;
  if (name == "lm_head.weight") return true;
  const std::string suffix = ".weight";
  if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  std::string module = name.substr(0, name.size() - suffix.size());
  std::string leaf = module.substr(module.rfind('.') + 1);
  if (leaf.find("proj") == std::string::npos) return false;  // q_proj, in_proj_qkvz, gate_proj, ...
  if (leaf == "kv_b_proj") return false;                     // MLA absorbs it: keep exact
  if (module.find(".indexer.") != std::string::npos) return false;
  return true;
}

Exl3ConvertStats exl3_convert_model(const std::string& in_dir, const std::string& out_dir, const Exl3ConvertOptions& opt) {
  auto pkg = ModelPackage::open(in_dir);
  fs::create_directories(out_dir);
  Exl3ConvertStats st;
  st.selection = !opt.select ? "names" : opt.select_name.empty() ? "custom" : opt.select_name;
  std::deque<Exl3Encoded> encoded;  // stable addresses: views point into these
  std::vector<TensorView> views;
  std::map<std::string, std::string> meta = {{"format", "pt"}};
  double mse_sum = 0;
  for (const std::string& name : pkg->names()) {
    const TensorView& t = pkg->require(name);
    const bool selected = t.shape.size() == 2 && (opt.select ? opt.select(name, t) : exl3_should_quantize(name, t));
    if (!selected || (opt.filter && !opt.filter(name))) {
      views.push_back(t);
      ++st.kept;
      continue;
    }
    if (opt.on_tensor) opt.on_tensor(name);
    std::string prefix = name.substr(0, name.size() - 7);  // drop ".weight"
    Exl3EncodeOptions eo;
    eo.K = name == "lm_head.weight" ? opt.head_bits : opt.bits;
    eo.codebook = opt.codebook;
    eo.seed = opt.seed + std::hash<std::string>{}(name);
    eo.scale_search = opt.scale_search;
    std::vector<float> w = t.to_f32();
    encoded.push_back(exl3_encode(w.data(), t.dim(0), t.dim(1), eo));
    const Exl3Encoded& e = encoded.back();
    for (auto& v : e.tensor_views(prefix)) views.push_back(v);
    if (e.weights.out_pad != t.dim(0) || e.weights.in_pad != t.dim(1))
      meta["exl3.shape." + prefix] = std::to_string(t.dim(0)) + "," + std::to_string(t.dim(1));
    mse_sum += e.rotated_rel_mse;
    ++st.quantized;
  }
  st.mean_rel_mse = st.quantized ? mse_sum / st.quantized : 0.0;
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), views, meta);

  nlohmann::json config = pkg->config();
  Exl3QuantConfig q;
  q.bits = opt.bits;
  q.head_bits = opt.head_bits;
  q.codebook = opt.codebook;
  q.version = "moesrv-exl3-test-encoder";
  q.out_scales = "always";
  config["quantization_config"] = exl3_config_json(q);
  std::ofstream(fs::path(out_dir) / "config.json") << config.dump(2) << "\n";
  for (const auto& entry : fs::directory_iterator(in_dir)) {  // tokenizer, generation config, ...
    std::string fn = entry.path().filename().string();
    if (!entry.is_regular_file() || fn == "config.json" || fn.ends_with(".safetensors") ||
        fn == "model.safetensors.index.json")
      continue;
    fs::copy_file(entry.path(), fs::path(out_dir) / fn, fs::copy_options::overwrite_existing);
  }
  return st;
}

}  // namespace moesrv
