#include "model/exl3_selection.h"

#include <map>
#include <memory>
#include <optional>

#include "model/spec.h"

namespace moesrv {

bool exl3_keep_exact(const TensorEntry& t) {
  if (!t.quantizable()) return true;
  if (t.name.ends_with(".kv_b_proj.weight")) return true;
  return t.name.find(".indexer.") != std::string::npos;
}

bool exl3_select_by_manifest(const ModelPackage& pkg, Exl3ConvertOptions& opt) {
  std::optional<ModelSpec> spec;
  try {
    spec = ModelSpec::from_json(pkg.config());
  } catch (const std::exception&) {
    return false;  // no ModelSpec for this config
  }
  // The text model's root, as ModelWeights::load finds it.
  const std::string nested = "model.language_model.";
  const std::string root =
      pkg.has(nested + "embed_tokens.weight") || pkg.unindexed().count(nested + "embed_tokens.weight") ? nested
                                                                                                       : "model.";
  auto decisions = std::make_shared<std::map<std::string, bool>>();  // manifest tensor -> quantize
  for (const TensorEntry& t : manifest(*spec, root)) (*decisions)[t.name] = !exl3_keep_exact(t);
  const std::string mtp = root + "layers." + std::to_string(spec->num_layers) + ".";
  opt.select = [decisions, mtp](const std::string& name, const TensorView& t) {
    if (auto it = decisions->find(name); it != decisions->end()) return it->second;
    if (name.starts_with(mtp)) return exl3_should_quantize(name, t);
    return false;
  };
  opt.select_name = "manifest (" + spec->model_type + ")";
  return true;
}

Exl3ConvertStats exl3_convert_package(const std::string& in_dir, const std::string& out_dir, Exl3ConvertOptions opt) {
  exl3_select_by_manifest(*ModelPackage::open(in_dir), opt);
  return exl3_convert_model(in_dir, out_dir, opt);
}

}  // namespace moesrv
