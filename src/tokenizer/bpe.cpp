#include "tokenizer/bpe.h"

#include <queue>

#include <nlohmann/json.hpp>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace moesrv {
namespace {
constexpr size_t kMaxCachedWordBytes = 64;
constexpr size_t kMaxCacheEntries = 200000;
}  // namespace

Bpe::Bpe(const nlohmann::json& m) {
  if (m.value("type", "BPE") != "BPE") fail("tokenizer: model type '{}' is not supported", m.value("type", ""));
  if (m.contains("dropout") && !m["dropout"].is_null()) fail("tokenizer: BPE dropout is not supported");
  auto nonempty = [&](const char* k) { return m.contains(k) && m[k].is_string() && !m[k].get<std::string>().empty(); };
  if (nonempty("continuing_subword_prefix") || nonempty("end_of_word_suffix"))
    fail("tokenizer: BPE subword prefix/suffix is not supported");
  if (m.value("byte_fallback", false)) fail("tokenizer: BPE byte_fallback is not supported");
  ignore_merges_ = m.value("ignore_merges", false);

  const auto& vocab = m.at("vocab");
  vocab_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) vocab_.emplace(it.key(), it.value().get<int32_t>());

  const auto& merges = m.at("merges");
  merges_.reserve(merges.size());
  int32_t rank = 0;
  for (const auto& mg : merges) {
    std::string a, b;
    if (mg.is_array()) {
      a = mg.at(0).get<std::string>();
      b = mg.at(1).get<std::string>();
    } else {
      const std::string& s = mg.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos) fail("tokenizer: malformed merge '{}'", s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b), im = vocab_.find(a + b);
    if (ia == vocab_.end() || ib == vocab_.end() || im == vocab_.end())
      fail("tokenizer: merge '{} {}' refers to tokens missing from the vocab", a, b);
    merges_.emplace(pair_key(ia->second, ib->second), Merge{rank++, im->second});
  }
}

void Bpe::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(std::string(word)); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::lock_guard lock(cache_mu_);
    if (auto it = cache_.find(std::string(word)); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t start = out.size();
  merge_symbols(word, out);
  if (cacheable) {
    std::lock_guard lock(cache_mu_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    cache_.emplace(std::string(word), std::vector<int32_t>(out.begin() + start, out.end()));
  }
}

// Classic BPE: repeatedly apply the lowest-ranked adjacent merge (leftmost on ties), using a
// min-heap of candidate merges over a linked list of symbols; stale heap entries are skipped.
void Bpe::merge_symbols(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int prev, next;
  };
  std::vector<Symbol> syms;
  syms.reserve(word.size());
  for (size_t i = 0; i < word.size();) {
    size_t start = i;
    i += std::min(utf8::seq_len(static_cast<unsigned char>(word[i])), word.size() - i);
    auto it = vocab_.find(std::string(word.substr(start, i - start)));
    if (it == vocab_.end()) fail("tokenizer: character '{}' is not in the vocab", word.substr(start, i - start));
    int n = int(syms.size());
    syms.push_back({it->second, n - 1, n + 1});
  }
  syms.back().next = -1;

  struct Candidate {
    int32_t rank;
    int pos;
    int32_t left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int pos) {
    int nx = syms[pos].next;
    if (nx < 0) return;
    auto it = merges_.find(pair_key(syms[pos].id, syms[nx].id));
    if (it != merges_.end()) heap.push({it->second.rank, pos, syms[pos].id, syms[nx].id});
  };
  for (int i = 0; i + 1 < int(syms.size()); ++i) push(i);

  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    Symbol& s = syms[c.pos];
    if (s.id != c.left || s.next < 0 || syms[s.next].id != c.right) continue;  // stale
    int right = s.next;
    s.id = merges_.at(pair_key(c.left, c.right)).merged_id;
    s.next = syms[right].next;
    if (s.next >= 0) syms[s.next].prev = c.pos;
    syms[right].id = -1;  // dead
    if (s.prev >= 0) push(s.prev);
    push(c.pos);
  }
  for (int i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

}  // namespace moesrv
