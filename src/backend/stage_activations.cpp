#include "backend/stage_activations.h"

#include <algorithm>

#include "util/error.h"

namespace moesrv {

int64_t selection_width(const ModelSpec& c) { return c.index_kpool > 1 ? c.index_topk + c.index_kpool : c.index_topk; }

void pack_selection(const std::vector<std::vector<int32_t>>& sel, int64_t row0, int64_t n, int64_t width,
                    int32_t* out) {
  if (row0 < 0 || row0 + n > int64_t(sel.size()))
    fail("pack_selection: rows [{}, {}) outside a selection of {} tokens", row0, row0 + n, sel.size());
  for (int64_t r = 0; r < n; ++r) {
    const std::vector<int32_t>& s = sel[size_t(row0 + r)];
    if (int64_t(s.size()) > width)
      fail("pack_selection: token {} selects {} keys, the row holds {}", row0 + r, s.size(), width);
    int32_t* row = out + r * width;
    std::copy(s.begin(), s.end(), row);
    std::fill(row + s.size(), row + width, -1);
  }
}

void unpack_selection(const int32_t* rows, int64_t n, int64_t width, int64_t row0,
                      std::vector<std::vector<int32_t>>& sel) {
  if (row0 < 0 || row0 + n > int64_t(sel.size()))
    fail("unpack_selection: rows [{}, {}) outside a selection of {} tokens", row0, row0 + n, sel.size());
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* row = rows + r * width;
    sel[size_t(row0 + r)].assign(row, std::find(row, row + width, -1));
  }
}

}  // namespace moesrv
