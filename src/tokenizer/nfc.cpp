#include "tokenizer/nfc.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tokenizer/utf8.h"

namespace moesrv {
namespace {

struct CccEntry {
  uint32_t cp;
  uint8_t ccc;
};
struct DecompEntry {
  uint32_t cp, offset, len;
};
struct ComposeEntry {
  uint32_t first, second, composite;
};
#include "tokenizer/nfc_tables.inc"

constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

uint8_t ccc_of(uint32_t cp) {
  if (cp < 0x300) return 0;
  auto it = std::lower_bound(std::begin(kCcc), std::end(kCcc), cp,
                             [](const CccEntry& e, uint32_t v) { return e.cp < v; });
  return (it != std::end(kCcc) && it->cp == cp) ? it->ccc : 0;
}

const DecompEntry* decomp_of(uint32_t cp) {
  auto it = std::lower_bound(std::begin(kDecomp), std::end(kDecomp), cp,
                             [](const DecompEntry& e, uint32_t v) { return e.cp < v; });
  return (it != std::end(kDecomp) && it->cp == cp) ? &*it : nullptr;
}

bool is_compose_second(uint32_t cp) {
  if (cp >= kVBase && cp < kVBase + kVCount) return true;
  if (cp > kTBase && cp < kTBase + kTCount) return true;
  return std::binary_search(std::begin(kComposeSecond), std::end(kComposeSecond), cp);
}

// A code point that NFC leaves untouched regardless of its neighbours.
bool is_stable(uint32_t cp) {
  if (cp < 0x300) return true;
  if (cp - kSBase < kSCount) return true;  // precomposed Hangul may still take a trailing T: checked via T
  return ccc_of(cp) == 0 && !decomp_of(cp) && !is_compose_second(cp);
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp - kSBase < kSCount) {
    uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const DecompEntry* d = decomp_of(cp)) {
    out.insert(out.end(), kDecompData + d->offset, kDecompData + d->offset + d->len);
  } else {
    out.push_back(cp);
  }
}

// Returns the primary composite of (a, b) or 0.
uint32_t compose_pair(uint32_t a, uint32_t b) {
  if (a - kLBase < kLCount && b - kVBase < kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a - kSBase < kSCount && (a - kSBase) % kTCount == 0 && b - kTBase - 1 < kTCount - 1)
    return a + (b - kTBase);
  auto it = std::lower_bound(std::begin(kCompose), std::end(kCompose), std::pair{a, b},
                             [](const ComposeEntry& e, const std::pair<uint32_t, uint32_t>& v) {
                               return e.first < v.first || (e.first == v.first && e.second < v.second);
                             });
  return (it != std::end(kCompose) && it->first == a && it->second == b) ? it->composite : 0;
}

}  // namespace

bool nfc_quick_check(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    if (!is_stable(utf8::decode(s, i))) return false;
  }
  return true;
}

std::string nfc_normalize(std::string_view s) {
  if (nfc_quick_check(s)) return std::string(s);
  std::vector<uint32_t> cps;
  cps.reserve(s.size());
  for (size_t i = 0; i < s.size();) decompose(utf8::decode(s, i), cps);
  // Canonical ordering: stable sort each run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (ccc_of(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && ccc_of(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j,
                     [](uint32_t a, uint32_t b) { return ccc_of(a) < ccc_of(b); });
    i = j;
  }
  // Canonical composition.
  std::vector<uint32_t> out;
  out.reserve(cps.size());
  long starter = -1;
  int last_ccc = -1;
  for (uint32_t cp : cps) {
    int c = ccc_of(cp);
    if (starter >= 0 && (last_ccc < c || (last_ccc == 0 && out.size() == size_t(starter) + 1))) {
      // Not blocked: either directly after the starter, or all intervening marks have lower ccc.
      if (uint32_t comp = compose_pair(out[starter], cp)) {
        out[starter] = comp;
        continue;
      }
    }
    if (c == 0) {
      starter = long(out.size());
      last_ccc = 0;
      out.push_back(cp);
      continue;
    }
    last_ccc = c;
    out.push_back(cp);
  }
  std::string result;
  result.reserve(s.size());
  for (uint32_t cp : out) utf8::append(result, cp);
  return result;
}

}  // namespace moesrv
