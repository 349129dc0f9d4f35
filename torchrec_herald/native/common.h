// Shared by herald's compiled planners (home_split.cpp: planning by home; global_plan.cpp: the global
// lazy plan and its bounded-staleness variant): a flat hash map, transfers and their tensors, a fast
// divider, the per-step LRU buckets, the plan counters and the exact plan's rule for one read row.

#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

namespace herald {

using i64 = int64_t;
constexpr i64 kEmpty = -1;  // keys are >= 0

inline uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Open addressing, linear probing, backward-shift deletion (no tombstones); keys >= 0; key and value
// side by side (one cache line per lookup). Most lookups miss (clean rows, cold keys in the hot map), so
// the load stays at most 1/2: a miss probes ~2.5 slots (at 3/4: ~8.5).
template <class V>
class FlatMap {
 public:
  FlatMap() { reset(16); }
  size_t size() const { return n_; }
  size_t bytes() const { return slots_.size() * sizeof(Slot); }
  // empty, with room for n entries before it grows (growing rehashes every entry)
  void clear(size_t n = 8) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    reset(cap);
  }
  void prefetch(i64 k) const { __builtin_prefetch(&slots_[mix(k) & mask_]); }

  V* find(i64 k) {
    size_t i = mix(k) & mask_;
    while (true) {
      if (slots_[i].key == k) return &slots_[i].val;
      if (slots_[i].key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  const V* find(i64 k) const { return const_cast<FlatMap*>(this)->find(k); }

  // the value of k, inserted as v when absent (pointers into the map are invalid after an insert)
  V& put(i64 k, const V& v) {
    if ((n_ + 1) * 2 > slots_.size()) grow();
    size_t i = mix(k) & mask_;
    while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & mask_;
    if (slots_[i].key == kEmpty) ++n_;
    slots_[i].key = k;
    slots_[i].val = v;
    return slots_[i].val;
  }

  bool erase(i64 k) {
    size_t i = mix(k) & mask_;
    while (slots_[i].key != k) {
      if (slots_[i].key == kEmpty) return false;
      i = (i + 1) & mask_;
    }
    size_t j = i;
    while (true) {  // shift back every later entry of the run that may move to the hole
      j = (j + 1) & mask_;
      if (slots_[j].key == kEmpty) break;
      size_t h = mix(slots_[j].key) & mask_;
      bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].key = kEmpty;
    --n_;
    return true;
  }

  template <class F>
  void for_each(F f) const {
    for (const Slot& sl : slots_)
      if (sl.key != kEmpty) f(sl.key, sl.val);
  }

 private:
  struct Slot {
    i64 key = kEmpty;
    V val{};
  };
  void reset(size_t cap) {
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    n_ = 0;
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    reset(old.size() * 2);
    for (const Slot& sl : old)
      if (sl.key != kEmpty) put(sl.key, sl.val);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0, n_ = 0;
};

struct Transfer {
  i64 key, src, dst;
  bool operator<(const Transfer& o) const {
    if (key != o.key) return key < o.key;
    if (src != o.src) return src < o.src;
    return dst < o.dst;
  }
};

inline torch::Tensor vec_tensor(const std::vector<i64>& v) {
  auto t = torch::empty({static_cast<i64>(v.size())}, torch::kInt64);
  if (!v.empty()) std::memcpy(t.data_ptr<i64>(), v.data(), v.size() * sizeof(i64));
  return t;
}

inline torch::Tensor transfer_tensor(const std::vector<Transfer>& v) {
  auto t = torch::empty({static_cast<i64>(v.size()), 3}, torch::kInt64);
  if (!v.empty()) std::memcpy(t.data_ptr<i64>(), v.data(), v.size() * sizeof(Transfer));
  return t;
}

// the order merging two sorted lists (indices into a, then b offset by a.size()); ties: a first
inline std::vector<size_t> merge_order(const std::vector<Transfer>& a, const std::vector<Transfer>& b) {
  std::vector<size_t> out;
  out.reserve(a.size() + b.size());
  size_t i = 0, j = 0;
  while (i < a.size() || j < b.size()) {
    if (j == b.size() || (i < a.size() && !(b[j] < a[i]))) {
      out.push_back(i++);
    } else {
      out.push_back(a.size() + j++);
    }
  }
  return out;
}

inline torch::Tensor sorted_transfers(std::vector<Transfer>& v) {
  std::sort(v.begin(), v.end());
  return transfer_tensor(v);
}

// One message to every peer: per section, (peer, word) pairs in any peer order; build() groups them by
// peer stably (a counting sort), so a peer's words keep the order they were added in.
class MessageBuilder {
 public:
  MessageBuilder(int W, int S) : W_(W), S_(S), words_(S) {}
  void add(int s, i64 peer, i64 word) { words_[s].push_back({peer, word}); }
  void reserve(int s, size_t n) { words_[s].reserve(n); }
  std::pair<torch::Tensor, torch::Tensor> build() const {
    auto counts = torch::zeros({W_, S_}, torch::kInt64);
    i64* c = counts.data_ptr<i64>();
    for (int s = 0; s < S_; ++s)
      for (const auto& pw : words_[s]) ++c[pw.first * S_ + s];
    std::vector<i64> cursor(static_cast<size_t>(W_) * S_);
    i64 total = 0;
    for (int i = 0; i < W_ * S_; ++i) {
      cursor[i] = total;
      total += c[i];
    }
    auto data = torch::empty({total}, torch::kInt64);
    i64* d = data.data_ptr<i64>();
    for (int s = 0; s < S_; ++s)
      for (const auto& pw : words_[s]) d[cursor[pw.first * S_ + s]++] = pw.second;
    return {counts, data};
  }

 private:
  int W_, S_;
  std::vector<std::vector<std::pair<i64, i64>>> words_;
};

// A received message: section s of peer q is words [begin(q, s), begin(q, s) + count(q, s)).
class MessageView {
 public:
  MessageView(const torch::Tensor& counts, const torch::Tensor& data, int W, int S)
      : counts_(counts.contiguous()), data_(data.contiguous()), W_(W), S_(S) {
    TORCH_CHECK(counts_.scalar_type() == torch::kInt64 && data_.scalar_type() == torch::kInt64,
                "herald_native: messages are int64");
    TORCH_CHECK(counts_.numel() == static_cast<i64>(W) * S, "herald_native: a message has counts [", W, ", ", S,
                "], got ", counts_.numel(), " words");
    const i64* c = counts_.data_ptr<i64>();
    base_.resize(static_cast<size_t>(W) * S + 1);
    base_[0] = 0;
    for (int i = 0; i < W * S; ++i) base_[i + 1] = base_[i] + c[i];
    TORCH_CHECK(base_.back() == data_.numel(), "herald_native: a message's counts add up to ", base_.back(),
                " words, its data has ", data_.numel());
  }
  i64 count(int q, int s) const { return counts_.data_ptr<i64>()[q * S_ + s]; }
  const i64* words(int q, int s) const { return data_.data_ptr<i64>() + base_[q * S_ + s]; }

 private:
  torch::Tensor counts_, data_;
  int W_, S_;
  std::vector<i64> base_;
};

// n / d for 0 <= n < 2^52 by a multiplication (a 64-bit division costs ~40 cycles, and every key needs its home)
struct Divider {
  explicit Divider(i64 d_) : d(d_), inv(1.0 / static_cast<double>(d_)) {}
  i64 div(i64 n) const {
    i64 q = static_cast<i64>(static_cast<double>(n) * inv);
    if (q * d > n) --q;
    else if ((q + 1) * d <= n) ++q;
    return q;
  }
  i64 d;
  double inv;
};

// The tables' layout both planners share: each table's offset in the global row space, its row-wise block
// (a row's home is its block), its cache capacity, and the hot keys with their slots.
class TableLayout {
 protected:
  TableLayout(const torch::Tensor& table_offsets, const torch::Tensor& blocks, const torch::Tensor& hot_keys,
              const torch::Tensor& capacity)
      : off_(to_vec(table_offsets)), block_(to_vec(blocks)), cap_(to_vec(capacity)), hot_keys_(to_vec(hot_keys)) {
    for (i64 b : block_) {
      TORCH_CHECK(b >= 1, "herald_native: block sizes must be >= 1");
      block_div_.push_back(Divider(b));
    }
    T_ = off_.size();
    TORCH_CHECK(block_.size() == T_ && cap_.size() == T_, "herald_native: one block size and capacity per table");
    for (size_t s = 0; s < hot_keys_.size(); ++s) hot_slot_.put(hot_keys_[s], static_cast<i64>(s));
  }

  static std::vector<i64> to_vec(const torch::Tensor& t) {
    auto c = t.to(torch::kInt64).contiguous();
    return std::vector<i64>(c.data_ptr<i64>(), c.data_ptr<i64>() + c.numel());
  }
  i64 table_of(i64 x) const {
    return static_cast<i64>(std::upper_bound(off_.begin(), off_.end(), x) - off_.begin()) - 1;
  }
  i64 home_of(i64 x) const {
    i64 t = table_of(x);
    return block_div_[t].div(x - off_[t]);
  }
  i64 hot_slot(i64 x) const {  // -1 for a cold row
    const i64* s = hot_slot_.find(x);
    return s ? *s : -1;
  }

  std::vector<i64> off_, block_, cap_, hot_keys_;
  std::vector<Divider> block_div_;
  FlatMap<i64> hot_slot_;
  size_t T_ = 0;
};

struct Bucket {  // the keys read at one step (ascending); an entry is live iff its last_use is still this step
  i64 step;
  std::vector<i64> keys;
  size_t head = 0;  // keys before it were consumed
};

// An LRU cache's order is a queue of buckets, oldest first; ``entries`` counts the keys the buckets hold
// (a key read again leaves a dead entry behind in its older bucket). Both lazy plans (per rank by home,
// global per (rank, table)) keep their caches so, each with its own test of liveness.

// consume ``dq``'s oldest entries until ``take(key, step)`` (which evicts the key where its entry is live,
// and says so) took ``excess`` keys or the queue is empty; returns how many it took
template <class Take>
i64 lru_take(std::deque<Bucket>& dq, i64 excess, size_t& entries, Take take) {
  i64 taken = 0;
  while (taken < excess && !dq.empty()) {
    Bucket& b = dq.front();
    while (b.head < b.keys.size() && taken < excess)
      if (take(b.keys[b.head++], b.step)) ++taken;
    if (b.head == b.keys.size()) {
      entries -= b.keys.size();
      dq.pop_front();
    }
  }
  return taken;
}

// keep only ``dq``'s live entries (``live(key, step)``), adding the ones kept to ``entries``
template <class Live>
void lru_compact(std::deque<Bucket>& dq, size_t& entries, Live live) {
  std::deque<Bucket> kept;
  for (Bucket& b : dq) {
    Bucket nb{b.step, {}, 0};
    for (size_t i = b.head; i < b.keys.size(); ++i)
      if (live(b.keys[i], b.step)) nb.keys.push_back(b.keys[i]);
    if (!nb.keys.empty()) {
      entries += nb.keys.size();
      kept.push_back(std::move(nb));
    }
  }
  dq.swap(kept);
}

// sort v, made of ascending runs [begin[q], begin[q + 1]): merge neighbouring runs, log2(runs) passes (a
// few times faster than sorting); an unsorted run is sorted first (the check below then names the reader)
inline void merge_runs(std::vector<i64>& v, const std::vector<i64>& begin) {
  std::vector<i64> bounds;
  for (size_t q = 0; q + 1 < begin.size(); ++q) {
    if (begin[q + 1] == begin[q]) continue;
    if (!std::is_sorted(v.begin() + begin[q], v.begin() + begin[q + 1]))
      std::sort(v.begin() + begin[q], v.begin() + begin[q + 1]);
    bounds.push_back(begin[q]);
  }
  bounds.push_back(static_cast<i64>(v.size()));
  std::vector<i64> buf(v.size());
  while (bounds.size() > 2) {
    std::vector<i64> next;
    size_t k = 0;
    for (; k + 2 < bounds.size(); k += 2) {
      std::merge(v.begin() + bounds[k], v.begin() + bounds[k + 1], v.begin() + bounds[k + 1],
                 v.begin() + bounds[k + 2], buf.begin() + bounds[k]);
      next.push_back(bounds[k]);
    }
    if (k + 1 < bounds.size()) {  // an odd run out: copied as is
      std::copy(v.begin() + bounds[k], v.begin() + bounds[k + 1], buf.begin() + bounds[k]);
      next.push_back(bounds[k]);
    }
    next.push_back(static_cast<i64>(v.size()));
    v.swap(buf);
    bounds.swap(next);
  }
}

// the plans' counters, in the order the Python side reads them
enum Counter { kReads, kHits, kCacheReads, kCacheHits, kMissPull, kUpdatePull, kReduce, kUpdatePush, kMissPush, kNumCounters };

// A row with state. Exact plan: dirty (``master`` != its home) or cached somewhere (``count`` copies;
// ``version`` advances with each update). Bounded staleness: cached somewhere; ``version`` is its home version.
struct Row {
  i64 master = 0;
  i64 version = 0;
  i64 count = 0;
};

// Herald's exact rule for the readers of one row x (docs/design.md §3, Herald (b)), one code for the global
// plan (every rank plans every row) and planning by home (each home plans its own rows): a dirty row read
// by another rank than its master goes home first; each reader pulls the row unless its replica or copy
// is the latest; one reader applies the update (the only reader, else the home) and the others send it
// their gradient. ``order[a..b)``: x's (x << bits | reader) pairs, lowest reader first; ``h``: x's home;
// ``valid``: x's W hot-replica flags (null for a cold row); ``ctr``: the counters. ``P`` holds the rest:
//   Row* find_row(x); Row& put_row(x, Row); void release(x, Row*)   (forget a clean row cached nowhere)
//   i64* copy(j, r, Row& row, bool& is_new)   (reader r's copy version of a cold row, made if new)
//   pre(x, from, to); pull(j, x, from, to, is_new); reduce(j, x, from, to); reduce_here(j); updated(x, reducer)
template <class P>
void exact_row(P& p, const i64* order, size_t a, size_t b, int bits, i64 x, i64 h, uint8_t* valid, i64 W, i64* ctr) {
  const i64 mask = (i64{1} << bits) - 1;
  const i64 first = order[a] & mask;
  const bool only_reader = b - a == 1;
  Row* st = p.find_row(x);  // valid until the next insert into the planner's rows
  i64 m = st ? st->master : h;
  if (m != h && !(only_reader && first == m)) {
    p.pre(x, m, h);
    if (valid) valid[h] = 1;
    st->master = m = h;
  }
  i64* only_copy = nullptr;  // the only reader's copy (valid while no other copy is made)
  for (size_t j = a; j < b; ++j) {
    const i64 r = order[j] & mask;
    const bool cold_remote = !valid && r != h;
    bool ok, is_new = false;
    if (valid) {
      ok = valid[r];
      valid[r] = 1;  // after the reads every reader holds the latest version
    } else if (!cold_remote) {
      ok = m == h;  // the home copy is the latest iff the row is not dirty
    } else {
      if (!st) st = &p.put_row(x, Row{h, 0, 0});
      i64* v = p.copy(j, r, *st, is_new);
      ok = !is_new && *v == st->version;
      *v = st->version;
      only_copy = v;
    }
    ctr[kReads] += 1;
    ctr[kHits] += ok;
    ctr[kCacheReads] += cold_remote;
    ctr[kCacheHits] += cold_remote && ok;
    if (!ok) {
      p.pull(j, x, m, r, is_new);
      ctr[is_new ? kMissPull : kUpdatePull] += 1;
    }
  }
  const i64 reducer = only_reader ? first : h;
  for (size_t j = a; j < b; ++j) {
    const i64 r = order[j] & mask;
    if (r != reducer) {
      p.reduce(j, x, r, reducer);
      ctr[kReduce] += 1;
    } else {
      p.reduce_here(j);
    }
  }
  if (valid) {
    std::memset(valid, 0, W);
    valid[reducer] = 1;
  } else if (st) {
    ++st->version;  // every copy is outdated, the reducer's is the latest
    if (reducer != h) *only_copy = st->version;  // the reducer is the only reader
  }
  if (reducer == h) {
    if (st) {
      st->master = h;
      p.release(x, st);
    }
  } else if (st) {
    st->master = reducer;
  } else {
    p.put_row(x, Row{reducer, 0, 0});
  }
  p.updated(x, reducer);
}

// Binary searches of ``count`` values ``x`` in the sorted ``table`` of ``n >= 1`` entries, kLanes of them in
// lockstep with no data-dependent branch (a branchy search mispredicts about once a level on random
// values, and the lanes' loads overlap): ``out[i]`` = the number of entries ``e`` with ``before(e, x[i])``,
// the lower bound with ``<``, the upper bound with ``<=``.
template <class T, class Before>
inline void lockstep_bounds(const T* table, i64 n, const T* x, i64 count, i64* out, Before before) {
  constexpr i64 kLanes = 16;
  for (i64 i0 = 0; i0 < count; i0 += kLanes) {
    const i64 lanes = std::min(kLanes, count - i0);
    const T* base[kLanes];
    for (i64 l = 0; l < lanes; ++l) base[l] = table;
    for (i64 len = n; len > 1;) {  // the answer lies in [base[l], base[l] + len]
      const i64 half = len / 2;
      for (i64 l = 0; l < lanes; ++l) base[l] = before(base[l][half], x[i0 + l]) ? base[l] + half : base[l];
      len -= half;
    }
    for (i64 l = 0; l < lanes; ++l) out[i0 + l] = (base[l] - table) + (before(*base[l], x[i0 + l]) ? 1 : 0);
  }
}

}  // namespace herald
