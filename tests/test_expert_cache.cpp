// ExpertCache: LRU order, pinned experts never evicted, retained experts protected, stats, thread safety.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <thread>

#include "backend/expert_cache.h"
#include "util/error.h"

namespace moesrv {
namespace {

// Lent slots (a memory the engine has only between prefill passes): withdrawn at first, free slots once lent, and
// emptied when withdrawn again, while the other slots keep their experts.
TEST(ExpertCache, LentSlotsComeAndGo) {
  ExpertCache c({4}, 16, {2});
  EXPECT_EQ(c.usable_slots(0), 2);
  ASSERT_TRUE(c.admit(0, 0));
  ASSERT_TRUE(c.admit(0, 1));
  auto a = c.admit(0, 2);  // only slots 0 and 1 while withdrawn: the LRU one goes
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 0);
  EXPECT_LT(a->slot, 2);
  c.lend(0);
  c.lend(0);  // idempotent
  EXPECT_EQ(c.usable_slots(0), 4);
  for (int e : {3, 4}) {
    auto b = c.admit(0, e);
    ASSERT_TRUE(b);
    EXPECT_EQ(b->evicted, -1);  // the lent slots were free
    EXPECT_GE(b->slot, 2);
  }
  ASSERT_TRUE(c.lookup(0, 3));
  std::vector<int32_t> gone = c.withdraw(0);
  std::sort(gone.begin(), gone.end());
  EXPECT_EQ(gone, (std::vector<int32_t>{3, 4}));
  EXPECT_FALSE(c.peek(0, 3));
  EXPECT_FALSE(c.peek(0, 4));
  EXPECT_TRUE(c.peek(0, 1));
  EXPECT_TRUE(c.peek(0, 2));
  EXPECT_EQ(c.lru_order(0), (std::vector<int32_t>{1, 2}));
  EXPECT_TRUE(c.withdraw(0).empty());  // idempotent
  EXPECT_EQ(c.usable_slots(0), 2);
  auto d = c.admit(0, 5);  // withdrawn again: a base slot
  ASSERT_TRUE(d);
  EXPECT_EQ(d->evicted, 1);
  EXPECT_LT(d->slot, 2);
  c.lend(0);
  c.retain(0, 5);
  ASSERT_TRUE(c.admit(0, 6));
  EXPECT_GE(*c.peek(0, 6), 2);
  EXPECT_EQ(c.withdraw(0), (std::vector<int32_t>{6}));  // a retained expert in a base slot is no obstacle
  c.release(0, 5);
  EXPECT_THROW(ExpertCache({2}, 16, {3}), Error);
  EXPECT_THROW(ExpertCache({2, 2}, 16, {1}), Error);
}

// A victim window of n: the least used (lookups) of the n least recent experts goes, not the least recent one.
TEST(ExpertCache, VictimWindowKeepsTheOftenUsed) {
  ExpertCache c({4}, 16);
  c.set_victim_window(4);
  for (int e : {0, 1, 2, 3}) {
    EXPECT_FALSE(c.lookup(0, e));
    ASSERT_TRUE(c.admit(0, e));
  }
  for (int i = 0; i < 3; ++i)
    for (int e : {0, 1, 3}) ASSERT_TRUE(c.lookup(0, e));
  EXPECT_EQ(c.lru_order(0), (std::vector<int32_t>{2, 0, 1, 3}));
  EXPECT_FALSE(c.lookup(0, 5));
  auto a = c.admit(0, 5);  // 2 is the least recent and the least used
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 2);
  EXPECT_FALSE(c.lookup(0, 6));
  a = c.admit(0, 6);  // 0 is the least recent, 5 the least used
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 5);
  // A pass that admits its experts before computing them retains each: the window skips them, however little used.
  c.retain(0, 6);
  EXPECT_FALSE(c.lookup(0, 8));
  a = c.admit(0, 8);  // 6 is the least used but retained; of 0, 1, 3 (used 3 times each) 0 is the least recent
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 0);
  c.retain(0, 8);
  EXPECT_FALSE(c.lookup(0, 0));
  a = c.admit(0, 0);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 1);
  c.release(0, 6), c.release(0, 8);
  EXPECT_FALSE(c.lookup(0, 9));
  a = c.admit(0, 9);  // released: the least used of the window again (6 and 8 once each, 6 the less recent)
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 6);
  c.set_victim_window(1);  // plain LRU again
  EXPECT_FALSE(c.lookup(0, 7));
  a = c.admit(0, 7);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 3);
  EXPECT_THROW(c.set_victim_window(0), Error);
}

// The GPU engine's decode passes that admit all their experts before computing any (at most the usable slots) hold
// each one (acquire on a hit, retain after admit) until they have run: with any victim window, with lent slots coming
// and going between passes, every held expert keeps the slot it was given until released, and no two share one.
TEST(ExpertCache, HeldExpertsKeepTheirSlotsUnderAnyWindow) {
  for (int window : {1, 4, 16, 64}) {
    ExpertCache c({12}, 64, {5});
    c.set_victim_window(window);
    uint32_t rng = 12345u + uint32_t(window);
    auto next = [&](uint32_t n) {
      rng = rng * 1664525u + 1013904223u;
      return (rng >> 8) % n;
    };
    int64_t misses = 0;
    for (int pass = 0; pass < 3000; ++pass) {
      if (pass % 50 == 0) {  // a prefill between decode passes takes the lent slots back, the next decode lends them
        if (pass % 100 == 0) c.withdraw(0);
        else c.lend(0);
      }
      const int usable = c.usable_slots(0);
      const int picks = 1 + int(next(uint32_t(usable)));
      std::vector<std::pair<int32_t, int32_t>> held;  // expert, slot
      std::set<int32_t> chosen;
      while (int(chosen.size()) < picks) {
        // skewed: half of the picks from the 8 hottest experts
        const int32_t e = next(2) ? int32_t(next(8)) : int32_t(next(64));
        if (!chosen.insert(e).second) continue;
        std::optional<int32_t> s = c.acquire(0, e);
        if (!s) {
          ++misses;
          std::optional<Admission> a = c.admit(0, e);
          ASSERT_TRUE(a) << "window " << window << ", pass " << pass;
          c.retain(0, e);
          s = a->slot;
          for (const auto& [he, hs] : held) ASSERT_NE(a->evicted, he) << "window " << window << ", pass " << pass;
        }
        held.emplace_back(e, *s);
      }
      std::set<int32_t> slots;
      for (const auto& [e, s] : held) {
        ASSERT_EQ(c.peek(0, e), s) << "window " << window << ", pass " << pass << ", expert " << e;
        ASSERT_TRUE(slots.insert(s).second) << "window " << window << ", pass " << pass;
      }
      for (const auto& [e, s] : held) c.release(0, e);
    }
    EXPECT_GT(misses, 100) << "window " << window;
  }
}

TEST(ExpertCache, EvictsLeastRecentlyUsed) {
  ExpertCache c({3}, 16);
  for (int e : {0, 1, 2}) {
    auto a = c.admit(0, e);
    ASSERT_TRUE(a);
    EXPECT_EQ(a->evicted, -1);
  }
  EXPECT_EQ(c.lru_order(0), (std::vector<int32_t>{0, 1, 2}));
  ASSERT_TRUE(c.lookup(0, 0));  // 0 becomes most recent
  EXPECT_EQ(c.lru_order(0), (std::vector<int32_t>{1, 2, 0}));
  const int32_t slot_of_1 = *c.peek(0, 1);
  auto a = c.admit(0, 3);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 1);
  EXPECT_EQ(a->slot, slot_of_1);  // the victim's slot is reused
  EXPECT_FALSE(c.lookup(0, 1));
  EXPECT_EQ(c.lru_order(0), (std::vector<int32_t>{2, 0, 3}));
  auto again = c.admit(0, 0);  // already resident: same slot, nothing evicted
  ASSERT_TRUE(again);
  EXPECT_EQ(again->evicted, -1);
  EXPECT_EQ(again->slot, *c.peek(0, 0));
  ExpertCacheStats s = c.stats(0);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.admissions, 4u);
  EXPECT_DOUBLE_EQ(s.hit_rate(), 0.5);
}

// Prefill passes scan every expert of a layer in expert order. With a plain LRU each miss evicts the expert the next
// scan needs first: no hits at all. A streaming window recycles the scan's own admissions instead, so the next scan
// hits slots - window experts; end_stream makes them ordinary LRU entries again.
TEST(ExpertCache, StreamingScansKeepTheCachedExperts) {
  constexpr int32_t kExperts = 10, kSlots = 6, kWindow = 2;
  auto scan = [&](ExpertCache& c, int32_t window) {
    int hits = 0;
    for (int32_t e = 0; e < kExperts; ++e) {
      if (c.lookup(0, e)) ++hits;
      else EXPECT_TRUE(c.admit(0, e, window));
    }
    c.end_stream(0);
    return hits;
  };
  ExpertCache lru({kSlots}, kExperts), streamed({kSlots}, kExperts);
  for (int pass = 0; pass < 3; ++pass) {
    EXPECT_EQ(scan(lru, 0), 0) << pass;
    EXPECT_EQ(scan(streamed, kWindow), pass == 0 ? 0 : kSlots - kWindow) << pass;
  }
  EXPECT_EQ(streamed.lru_order(0), (std::vector<int32_t>{4, 5, 6, 7, 8, 9}));
  // Retained experts of the window are skipped; then the LRU victim as usual.
  ExpertCache c({3}, 8);
  for (int32_t e : {0, 1, 2}) ASSERT_TRUE(c.admit(0, e, 1));
  c.retain(0, 0);
  auto a = c.admit(0, 3, 1);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 1);  // the window's oldest unretained admission
  c.release(0, 0);
}

TEST(ExpertCache, PinnedNeverEvicted) {
  ExpertCache c({4, 2}, 32);
  const int32_t p0 = c.pin(0, 7), p1 = c.pin(0, 9);
  EXPECT_NE(p0, p1);
  EXPECT_TRUE(c.is_pinned(0, 7));
  for (int e = 10; e < 32; ++e) {
    auto a = c.admit(0, e);
    ASSERT_TRUE(a);
    EXPECT_NE(a->evicted, 7);
    EXPECT_NE(a->evicted, 9);
    EXPECT_NE(a->slot, p0);
    EXPECT_NE(a->slot, p1);
  }
  EXPECT_EQ(c.lookup(0, 7), p0);
  EXPECT_EQ(c.lookup(0, 9), p1);
  EXPECT_EQ(c.lru_order(0), (std::vector<int32_t>{30, 31}));  // only unpinned experts cycle
  // A layer whose slots are all pinned admits nothing.
  c.pin(1, 0), c.pin(1, 1);
  EXPECT_FALSE(c.admit(1, 2));
  EXPECT_THROW(c.pin(1, 3), Error);
  // Pinning a resident LRU expert keeps its slot and removes it from the LRU.
  ExpertCache d({2}, 8);
  const int32_t s = d.admit(0, 5)->slot;
  EXPECT_EQ(d.pin(0, 5), s);
  EXPECT_TRUE(d.lru_order(0).empty());
}

TEST(ExpertCache, RetainedExpertsAreNotVictims) {
  ExpertCache c({2}, 8);
  c.admit(0, 0), c.admit(0, 1);
  c.retain(0, 0);  // LRU victim would be 0
  auto a = c.admit(0, 2);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->evicted, 1);
  c.retain(0, 2);
  EXPECT_FALSE(c.admit(0, 3));  // everything retained
  c.release(0, 0);
  EXPECT_EQ(c.admit(0, 3)->evicted, 0);
  EXPECT_THROW(c.release(0, 0), Error);
  EXPECT_THROW(c.retain(0, 5), Error);  // not resident
}

TEST(ExpertCache, ForgottenExpertsFreeTheirSlots) {
  ExpertCache c({2}, 8);
  c.pin(0, 7);
  c.admit(0, 0);
  c.retain(0, 0);
  EXPECT_FALSE(c.forget(0, 0));  // retained
  EXPECT_FALSE(c.forget(0, 7));  // pinned
  EXPECT_FALSE(c.forget(0, 3));  // not resident
  c.release(0, 0);
  const int32_t slot = *c.peek(0, 0);
  EXPECT_TRUE(c.forget(0, 0));
  EXPECT_FALSE(c.peek(0, 0));
  EXPECT_TRUE(c.lru_order(0).empty());
  auto a = c.admit(0, 4);  // the freed slot, nobody evicted
  ASSERT_TRUE(a);
  EXPECT_EQ(a->slot, slot);
  EXPECT_EQ(a->evicted, -1);
  EXPECT_TRUE(c.is_pinned(0, 7));
}

TEST(ExpertCache, ZeroSlotsAndRangeChecks) {
  ExpertCache c({0, 1}, 4);
  EXPECT_FALSE(c.lookup(0, 1));
  EXPECT_FALSE(c.admit(0, 1));
  EXPECT_THROW(c.lookup(2, 0), Error);
  EXPECT_THROW(c.lookup(0, 4), Error);
  EXPECT_THROW(ExpertCache({5}, 4), Error);
}

// A decode thread (lookup/retain/release) against a copy thread (admit): slots stay a consistent bijection.
TEST(ExpertCache, DecodeAndCopyThreads) {
  constexpr int32_t kLayers = 4, kExperts = 64, kSlots = 8;
  ExpertCache c(std::vector<int32_t>(kLayers, kSlots), kExperts);
  for (int32_t l = 0; l < kLayers; ++l) c.pin(l, 0);
  std::atomic<bool> stop{false};
  std::thread copier([&] {
    uint32_t r = 1;
    // At least 4096 admits, however late this thread gets scheduled: every layer's slots end up filled.
    for (int n = 0; !stop || n < 4096; ++n) {
      r = r * 1664525u + 1013904223u;
      c.admit(int32_t(r % kLayers), int32_t(1 + (r >> 8) % (kExperts - 1)));
    }
  });
  uint32_t r = 7;
  for (int i = 0; i < 200000; ++i) {
    r = r * 1103515245u + 12345u;
    const int32_t l = int32_t(r % kLayers), e = int32_t((r >> 8) % kExperts);
    if (auto s = c.acquire(l, e)) {  // lookup + retain atomically: a separate retain could race an eviction
      EXPECT_EQ(c.peek(l, e), s);  // retained: the copy thread cannot take the slot
      c.release(l, e);
    }
  }
  stop = true;
  copier.join();
  for (int32_t l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(c.lookup(l, 0));  // pinned survived
    std::set<int32_t> slots;
    int resident = 0;
    for (int32_t e = 0; e < kExperts; ++e)
      if (auto s = c.peek(l, e)) {
        ++resident;
        EXPECT_TRUE(slots.insert(*s).second) << "slot " << *s << " holds two experts";
        EXPECT_LT(*s, kSlots);
      }
    EXPECT_EQ(resident, kSlots);
  }
  EXPECT_GT(c.total_stats().hits, 0u);
}

}  // namespace
}  // namespace moesrv
