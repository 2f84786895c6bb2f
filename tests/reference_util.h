// Helpers for comparing against reference outputs saved by Hugging Face transformers.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "format/safetensors.h"

namespace moesrv::testing {

inline std::string hf_tiny(const std::string& model) { return std::string(MOESRV_TESTDATA) + "/hf-tiny/" + model; }

struct Reference {
  std::vector<int32_t> input_ids, gen_ids;
  std::vector<float> logits, gen_logits;  // [n, vocab]
  int64_t prompt_len = 40;                // gen_ids = prompt_len prompt ids + greedy tokens
};

inline Reference load_reference(const std::string& model) {
  auto f = SafetensorsFile::open(hf_tiny(model) + "/reference.safetensors");
  Reference r;
  auto ids = [&](const char* n) {
    std::vector<int32_t> v;
    for (float x : f->find(n)->to_f32()) v.push_back(int32_t(x));
    return v;
  };
  r.input_ids = ids("input_ids");
  r.gen_ids = ids("gen_ids");
  r.logits = f->find("logits")->to_f32();
  r.gen_logits = f->find("gen_logits")->to_f32();
  if (f->find("prompt_len")) r.prompt_len = int64_t(f->find("prompt_len")->to_f32()[0]);
  return r;
}

// The first n (at most all) ids of the model's reference prompt.
inline std::vector<int32_t> reference_prompt(const std::string& model, size_t n) {
  auto ids = load_reference(model).input_ids;
  return std::vector<int32_t>(ids.begin(), ids.begin() + long(std::min(n, ids.size())));
}

// |a - ref| / |ref| in the L2 norm (|ref| = 0 counts as 1); vectors of different sizes: infinity.
inline double rel_l2_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) d += double(a[i] - ref[i]) * (a[i] - ref[i]), m += double(ref[i]) * ref[i];
  return std::sqrt(d / (m > 0 ? m : 1));
}

// max |a - b| over rows, relative to the reference row's L2 norm (the acceptance metric).
inline double max_rel_row_error(const float* a, const float* ref, int64_t rows, int64_t vocab) {
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double norm = 0, maxdiff = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      norm += double(ref[r * vocab + i]) * ref[r * vocab + i];
      maxdiff = std::max(maxdiff, std::abs(double(a[r * vocab + i]) - ref[r * vocab + i]));
    }
    worst = std::max(worst, maxdiff / std::sqrt(norm));
  }
  return worst;
}

inline int32_t argmax(const float* v, int64_t n) {
  int32_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = int32_t(i);
  return best;
}

}  // namespace moesrv::testing
