// exl3_convert <in_dir> <out_dir> [--bits K] [--head-bits K] [--codebook mul1|mcg|3inst] [--seed N] [--scale-search]
// Quantizes a small bf16 HF model folder to EXL3 with the test encoder (no calibration; see exl3_convert.h). The
// tensors to quantize come from the model's tensor manifest (model/exl3_selection.h) when its architecture is
// known, else from the name rule.
#include <chrono>
#include <cstdio>
#include <string>

#include "model/exl3_selection.h"
#include "util/error.h"

int main(int argc, char** argv) {
  using namespace moesrv;
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: %s <in_dir> <out_dir> [--bits K] [--head-bits K] [--codebook mul1|mcg|3inst] [--seed N] "
                 "[--scale-search]\n",
                 argv[0]);
    return 2;
  }
  try {
    Exl3ConvertOptions opt;
    for (int i = 3; i < argc; ++i) {
      std::string a = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) fail("{} needs a value", a);
        return argv[++i];
      };
      if (a == "--bits") opt.bits = std::stoi(next());
      else if (a == "--head-bits") opt.head_bits = std::stoi(next());
      else if (a == "--seed") opt.seed = std::stoull(next());
      else if (a == "--scale-search") opt.scale_search = true;
      else if (a == "--codebook") {
        std::string cb = next();
        if (!parse_exl3_codebook(cb, opt.codebook)) fail("unknown codebook '{}'", cb);
      } else fail("unknown option '{}'", a);
    }
    auto t0 = std::chrono::steady_clock::now();
    opt.on_tensor = [](const std::string& n) { std::fprintf(stderr, "  quantizing %s\n", n.c_str()); };
    auto st = exl3_convert_package(argv[1], argv[2], opt);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "%s: %d tensors quantized (K=%d, head K=%d, %s; selected by %s), %d kept; mean relative MSE %.5f; %.1f s\n",
        argv[2], st.quantized, opt.bits, opt.head_bits, std::string(exl3_codebook_name(opt.codebook)).c_str(),
        st.selection.c_str(), st.kept, st.mean_rel_mse, s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "exl3_convert: %s\n", e.what());
    return 1;
  }
  return 0;
}
