// Herald's global lazy plan (every rank plans every rank's reads, the same plan everywhere) in compiled
// code: the exact owner-route LRU plan of TensorLazySyncPlanner (torchrec_herald/pipeline/lazy_sync.py)
// and HET's bounded-staleness plan of StalenessPlanner (torchrec_herald/pipeline/staleness.py). The
// Python planners stay the readable reference; tests compare the two on random traces (evictions,
// look-ahead, flush). Hand-written because a step is a few thousand hash-map operations that the tensor
// code spreads over about a thousand small torch calls on the scheduler thread, holding the GIL.
//
// Keys are global rows (table offset + row id). A copy of row x on rank r is keyed x << 16 | r. Transfers
// are int64 [n, 3] rows of (key, src, dst).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"

namespace {

using namespace herald;
constexpr int kRankBits = 16;
constexpr i64 kRankMask = (i64{1} << kRankBits) - 1;

// A remote cold row's copy on one rank. Exact plan: ``version`` (the copy is the latest iff it equals its
// row's). Bounded staleness: ``base`` (the home version it is based on) and ``pending`` (local updates not
// pushed home yet).
struct Copy {
  i64 last_use = 0;
  i64 version = 0;  // exact: the row's version it holds; staleness: base
  i64 pending = 0;  // staleness only
};

// The layout and the LRU caches both planners share: tables, homes, hot slots, per-(rank, table) cache
// counts and LRU buckets of copies.
class GlobalPlanBase : protected TableLayout {
 public:
  GlobalPlanBase(i64 world, torch::Tensor table_offsets, torch::Tensor blocks, torch::Tensor hot_keys,
                 torch::Tensor capacity, i64 num_rows, i64 window)
      : TableLayout(table_offsets, blocks, hot_keys, capacity), W_(world), num_rows_(num_rows), window_(window) {
    TORCH_CHECK(world >= 1 && world <= kRankMask + 1, "herald_native: 1 to ", kRankMask + 1, " ranks, got ", world);
  }

  i64 step() const { return step_; }

 protected:
  void reset_caches() {
    copies_.clear(1 << 12);
    count_.assign(static_cast<size_t>(W_) * T_, 0);
    lru_.assign(static_cast<size_t>(W_) * T_, std::deque<Bucket>());
    touched_.assign(static_cast<size_t>(W_) * T_, std::vector<i64>());
    bucket_entries_ = 0;
    step_ = 0;
  }

  // one rank's reads per tensor: their (key << 16 | rank) pairs in (key, rank) order; checks the keys
  std::vector<i64> pairs(const std::vector<torch::Tensor>& reads, const char* what) const {
    if (static_cast<i64>(reads.size()) != W_)
      throw std::invalid_argument("reads need one key set per rank (" + std::to_string(W_) + "), got " +
                                  std::to_string(reads.size()));
    std::vector<i64> order;
    std::vector<i64> begin(W_ + 1, 0);
    for (i64 r = 0; r < W_; ++r) {
      auto k = reads[r].reshape(-1).to(torch::kInt64).contiguous();
      const i64* p = k.data_ptr<i64>();
      for (i64 i = 0; i < k.numel(); ++i) {
        if (p[i] < 0 || p[i] >= num_rows_)
          throw std::invalid_argument("read keys outside [0, " + std::to_string(num_rows_) + ")");
        if (i && p[i] <= p[i - 1])
          throw std::invalid_argument(std::string("the global plan: ") + what + " read keys of rank " +
                                      std::to_string(r) + " must be sorted and unique (torch.unique)");
        order.push_back(p[i] << kRankBits | r);
      }
      begin[r + 1] = static_cast<i64>(order.size());
    }
    merge_runs(order, begin);
    return order;
  }

  // a cold read (r, x) of table t touches r's copy: it enters or refreshes its LRU place
  void touch(i64 r, i64 t, i64 x) { touched_[r * T_ + t].push_back(x); }

  // this step's touched copies join the LRU (ascending keys per (rank, table): the pairs come in key order)
  void close_buckets() {
    for (size_t g = 0; g < touched_.size(); ++g) {
      if (touched_[g].empty()) continue;
      bucket_entries_ += touched_[g].size();
      lru_[g].push_back(Bucket{step_, std::move(touched_[g]), 0});
      touched_[g] = std::vector<i64>();
    }
  }

  // trim each (rank, table) cache to capacity, least recently used first (ties: the lower key); the
  // victims (rank, key), sorted by rank then key; their copies stay in ``copies_`` (the caller's)
  std::vector<std::pair<i64, i64>> lru_victims() {
    std::vector<std::pair<i64, i64>> out;
    for (i64 r = 0; r < W_; ++r) {
      const size_t first = out.size();
      for (size_t t = 0; t < T_; ++t) {
        const size_t g = r * T_ + t;
        const i64 excess = count_[g] - cap_[t];
        if (excess <= 0) continue;
        const i64 taken = lru_take(lru_[g], excess, bucket_entries_, [&](i64 x, i64 step) {
          Copy* c = copies_.find(x << kRankBits | r);
          if (!c || c->last_use != step) return false;
          out.push_back({r, x});
          c->last_use = -1;  // taken (a key appears once per bucket, but in several buckets)
          return true;
        });
        count_[g] -= taken;
        TORCH_CHECK(taken == excess, "herald_native: LRU of rank ", r, " table ", t, " is empty with ",
                    excess - taken, " rows over capacity");
      }
      std::sort(out.begin() + first, out.end());
    }
    return out;
  }

  void maybe_compact() {  // drop the bucket entries of copies read again later or evicted
    if (bucket_entries_ <= 2 * copies_.size() + 4096) return;
    bucket_entries_ = 0;
    for (size_t g = 0; g < lru_.size(); ++g) {
      const i64 r = static_cast<i64>(g / T_);
      lru_compact(lru_[g], bucket_entries_, [&](i64 x, i64 step) {
        const Copy* c = copies_.find(x << kRankBits | r);
        return c && c->last_use == step;
      });
    }
  }

  // per rank, the keys it caches (sorted), concatenated, and their counts per rank
  std::pair<torch::Tensor, torch::Tensor> cached() const {
    std::vector<i64> pairs;
    pairs.reserve(copies_.size());
    copies_.for_each([&](i64 k, const Copy&) { pairs.push_back((k & kRankMask) << 48 | (k >> kRankBits)); });
    std::sort(pairs.begin(), pairs.end());
    std::vector<i64> keys(pairs.size()), counts(W_, 0);
    for (size_t i = 0; i < pairs.size(); ++i) {
      keys[i] = pairs[i] & ((i64{1} << 48) - 1);
      ++counts[pairs[i] >> 48];
    }
    return {vec_tensor(keys), vec_tensor(counts)};
  }

  template <class Local>
  torch::Tensor scores(const torch::Tensor& keys_t, const torch::Tensor& sample_t, i64 num_samples, Local local) const {
    auto keys = keys_t.reshape(-1).to(torch::kInt64).contiguous();
    auto sample = sample_t.reshape(-1).to(torch::kInt64).contiguous();
    TORCH_CHECK(keys.numel() == sample.numel(), "herald_native: one sample per key");
    auto out = torch::zeros({num_samples, W_}, torch::kInt32);
    int32_t* o = out.data_ptr<int32_t>();
    const i64* k = keys.data_ptr<i64>();
    const i64* s = sample.data_ptr<i64>();
    for (i64 i = 0; i < keys.numel(); ++i) {
      const i64 x = k[i];
      if (x < 0 || x >= num_rows_)
        throw std::invalid_argument("allocator keys outside [0, " + std::to_string(num_rows_) + ")");
      if (s[i] < 0 || s[i] >= num_samples)
        throw std::invalid_argument("allocator sample index outside [0, " + std::to_string(num_samples) + ")");
      int32_t* row = o + s[i] * W_;
      if (hot_slot(x) >= 0) {
        for (i64 r = 0; r < W_; ++r) ++row[r];
        continue;
      }
      ++row[home_of(x)];
      const Row* st = rows_.find(x);
      if (!st) continue;  // cached nowhere
      for (i64 r = 0; r < W_; ++r) {
        const Copy* c = copies_.find(x << kRankBits | r);
        if (c && local(*st, *c)) ++row[r];
      }
    }
    return out;
  }

  // bool [n] of 0/1 bytes; int64 [kNumCounters]
  static torch::Tensor flags(const std::vector<uint8_t>& v) {
    auto t = torch::empty({static_cast<i64>(v.size())}, torch::kBool);
    for (size_t i = 0; i < v.size(); ++i) t.data_ptr<bool>()[i] = v[i] != 0;
    return t;
  }
  static torch::Tensor counters(const i64* ctr) {
    auto t = torch::empty({kNumCounters}, torch::kInt64);
    std::memcpy(t.data_ptr<i64>(), ctr, kNumCounters * sizeof(i64));
    return t;
  }

  i64 base_bytes() const {
    return static_cast<i64>(copies_.bytes() + rows_.bytes() + 8 * bucket_entries_ + 8 * hot_slot_.size() + 8 * count_.size());
  }

  i64 W_, num_rows_, window_;
  FlatMap<Copy> copies_;
  FlatMap<Row> rows_;
  std::vector<i64> count_;  // [rank][table] cached rows
  std::vector<std::deque<Bucket>> lru_;
  std::vector<std::vector<i64>> touched_;
  size_t bucket_entries_ = 0;
  i64 step_ = 0;
};

// ------------------------------------------------------------------------------------------ exact plan
class GlobalExactCore : public GlobalPlanBase {
 public:
  GlobalExactCore(i64 world, torch::Tensor table_offsets, torch::Tensor blocks, torch::Tensor hot_keys,
                  torch::Tensor capacity, i64 num_rows, i64 window)
      : GlobalPlanBase(world, table_offsets, blocks, hot_keys, capacity, num_rows, window) {
    reset();
  }

  void reset() {
    reset_caches();
    rows_.clear(1 << 12);
    hot_valid_.assign(hot_keys_.size() * W_, 1);
  }

  i64 state_bytes() const { return base_bytes() + static_cast<i64>(hot_valid_.size()); }

  // (push_before_read, pull, pull_miss, reduce, update_keys, reducer, update_push, miss_push,
  //  evicted keys, evictions per rank, counters)
  std::vector<torch::Tensor> plan_step(const std::vector<torch::Tensor>& now, const std::vector<torch::Tensor>& nxt,
                                       bool use_next) {
    const std::vector<i64> order = pairs(now, "this step's");
    const std::vector<i64> ahead = use_next ? pairs(nxt, "the next step's") : std::vector<i64>();
    const size_t n = order.size();
    std::vector<Transfer> pre, pull, reduce, post, miss;
    std::vector<uint8_t> pull_miss;
    std::vector<i64> update, reducer_of;
    pull.reserve(n);
    pull_miss.reserve(n);
    reduce.reserve(n);
    update.reserve(n);
    reducer_of.reserve(n);
    i64 ctr[kNumCounters] = {};
    // the exact rule's state and transfers (see herald::exact_row); t: the row's table
    struct Rules {
      GlobalExactCore& c;
      std::vector<Transfer>&pre_out, &pull_out, &reduce_out;
      std::vector<uint8_t>& pull_miss;
      std::vector<i64>&update, &reducer_of;
      const std::vector<i64>& order;
      size_t t;
      Row* find_row(i64 x) { return c.rows_.find(x); }
      Row& put_row(i64 x, Row row) { return c.rows_.put(x, row); }
      void release(i64 x, Row* st) { c.release(x, st); }
      i64* copy(size_t j, i64 r, Row& st, bool& is_new) {  // a cold remote read: the copy's LRU place too
        Copy* cp = c.copies_.find(order[j]);
        if (cp) {
          cp->last_use = c.step_;
        } else {
          is_new = true;
          cp = &c.copies_.put(order[j], Copy{c.step_, st.version, 0});
          ++st.count;
          ++c.count_[r * c.T_ + t];
        }
        c.touch(r, static_cast<i64>(t), order[j] >> kRankBits);
        return &cp->version;
      }
      void pre(i64 x, i64 from, i64 to) { pre_out.push_back(Transfer{x, from, to}); }
      void pull(size_t, i64 x, i64 from, i64 to, bool is_new) {
        pull_out.push_back(Transfer{x, from, to});
        pull_miss.push_back(is_new);
      }
      void reduce(size_t, i64 x, i64 from, i64 to) { reduce_out.push_back(Transfer{x, from, to}); }
      void reduce_here(size_t) {}
      void updated(i64 x, i64 reducer) {
        update.push_back(x);
        reducer_of.push_back(reducer);
      }
    } rules{*this, pre, pull, reduce, pull_miss, update, reducer_of, order, 0};
    size_t hp = 0;
    for (size_t a = 0; a < n;) {
      const i64 x = order[a] >> kRankBits;
      size_t b = a + 1;
      while (b < n && (order[b] >> kRankBits) == x) ++b;
      while (rules.t + 1 < T_ && off_[rules.t + 1] <= x) ++rules.t;  // the keys ascend: walk the tables and the hot keys
      while (hp < hot_keys_.size() && hot_keys_[hp] < x) ++hp;
      const bool hot = hp < hot_keys_.size() && hot_keys_[hp] == x;
      exact_row(rules, order.data(), a, b, kRankBits, x, block_div_[rules.t].div(x - off_[rules.t]),
                hot ? &hot_valid_[hp * W_] : nullptr, W_, ctr);
      a = b;
    }
    close_buckets();
    // look-ahead: a dirty row another rank reads in the next step goes home now
    if (use_next && window_ > 1) {
      std::vector<i64> go;
      for (i64 p : ahead) {
        const i64 x = p >> kRankBits, r = p & kRankMask;
        const Row* st = rows_.find(x);
        if (st && st->master != home_of(x) && r != st->master) go.push_back(x);
      }
      go.erase(std::unique(go.begin(), go.end()), go.end());  // (the pairs come in key order)
      for (i64 x : go) push_home(x, post);
    }
    ctr[kUpdatePush] = static_cast<i64>(pre.size() + post.size());
    // evictions: a victim holding the only latest version goes home; its copy is gone
    std::vector<std::pair<i64, i64>> victims = lru_victims();
    std::vector<i64> evicted, per_rank(W_, 0);
    evicted.reserve(victims.size());
    for (const auto& v : victims) {
      const i64 r = v.first, x = v.second;
      Row* st = rows_.find(x);
      if (st->master == r) {
        miss.push_back(Transfer{x, r, home_of(x)});
        st->master = home_of(x);
      }
      copies_.erase(x << kRankBits | r);
      --st->count;
      release(x, st);
      evicted.push_back(x);
      ++per_rank[r];
    }
    maybe_compact();
    ctr[kMissPush] = static_cast<i64>(miss.size());
    ++step_;
    return {transfer_tensor(pre), transfer_tensor(pull), flags(pull_miss), transfer_tensor(reduce), vec_tensor(update),
            vec_tensor(reducer_of), sorted_transfers(post), sorted_transfers(miss), vec_tensor(evicted),
            vec_tensor(per_rank), counters(ctr)};
  }

  // (push, pull, cached keys, cached per rank); resets the state
  std::vector<torch::Tensor> flush() {
    std::vector<i64> dirty;
    rows_.for_each([&](i64 k, const Row& st) {
      if (st.master != home_of(k)) dirty.push_back(k);
    });
    std::sort(dirty.begin(), dirty.end());
    std::vector<Transfer> push;
    for (i64 x : dirty) push_home(x, push);
    std::vector<Transfer> pull;
    for (size_t s = 0; s < hot_keys_.size(); ++s)
      for (i64 r = 0; r < W_; ++r)
        if (!hot_valid_[s * W_ + r]) pull.push_back(Transfer{hot_keys_[s], home_of(hot_keys_[s]), r});
    auto dropped = cached();
    std::vector<torch::Tensor> out = {transfer_tensor(push), sorted_transfers(pull), dropped.first, dropped.second};
    reset();
    return out;
  }

  // int32 [num_samples, W]: each sample's lookups local to each rank (hot, its own block, a valid copy)
  torch::Tensor local_scores(const torch::Tensor& keys, const torch::Tensor& sample, i64 num_samples) const {
    return scores(keys, sample, num_samples, [](const Row& row, const Copy& c) { return c.version == row.version; });
  }

  std::pair<torch::Tensor, torch::Tensor> cached_rows() const { return cached(); }

 private:
  // forget a row that is clean and cached nowhere
  void release(i64 x, Row* st) {
    if (st->count == 0 && st->master == home_of(x)) rows_.erase(x);
  }
  // dirty row x goes home (from its master): its home's hot replica is the latest again
  void push_home(i64 x, std::vector<Transfer>& out) {
    Row* st = rows_.find(x);
    const i64 h = home_of(x);
    out.push_back(Transfer{x, st->master, h});
    const i64 s = hot_slot(x);
    if (s >= 0) hot_valid_[s * W_ + h] = 1;
    st->master = h;
    release(x, st);
  }

  std::vector<uint8_t> hot_valid_;  // [hot slot][rank]
};

// ------------------------------------------------------------------------------ bounded staleness (HET)
// State as StalenessPlanner: hv (home version) of a hot row in hv_hot_, of a cold row in ``rows_`` while
// some rank caches it (``version``); base and pending of a hot replica in [rank][slot] vectors, of a cache
// entry in its Copy (``version`` = base).
class GlobalStalenessCore : public GlobalPlanBase {
 public:
  GlobalStalenessCore(i64 world, torch::Tensor table_offsets, torch::Tensor blocks, torch::Tensor hot_keys,
                      torch::Tensor capacity, i64 num_rows, i64 window, i64 staleness)
      : GlobalPlanBase(world, table_offsets, blocks, hot_keys, capacity, num_rows, window), s_(staleness) {
    TORCH_CHECK(staleness >= 0, "herald_native: staleness must be >= 0");
    reset();
  }

  void reset() {
    reset_caches();
    rows_.clear(1 << 12);
    const size_t nh = hot_keys_.size();
    hv_hot_.assign(nh, 0);
    base_hot_.assign(nh * W_, 0);
    pending_hot_.assign(nh * W_, 0);
  }

  i64 state_bytes() const { return base_bytes() + static_cast<i64>(8 * (hv_hot_.size() + base_hot_.size() + pending_hot_.size())); }

  // (push_before_read, its add flags, pull, pull_miss, reduce, update_keys, reducer, update_push, its add
  //  flags, miss_push, its add flags, evicted keys, evictions per rank, counters, [stale reads, max staleness])
  std::vector<torch::Tensor> plan_step(const std::vector<torch::Tensor>& now) {
    const std::vector<i64> order = pairs(now, "this step's");
    const size_t n = order.size();
    const i64 nh = static_cast<i64>(hot_keys_.size());
    std::vector<i64> X(n), R(n), slot(n), home(n), table(n), grp(n);
    std::vector<uint8_t> home_read(n), held(n), refresh(n), pend(n);
    std::vector<Copy*> cp(n, nullptr);
    std::vector<i64> group_begin;  // pairs [group_begin[g], group_begin[g + 1]) read row g
    size_t hp = 0, t = 0;
    for (size_t j = 0; j < n; ++j) {
      const i64 x = order[j] >> kRankBits, r = order[j] & kRankMask;
      if (!j || x != X[j - 1]) {
        group_begin.push_back(static_cast<i64>(j));
        while (t + 1 < T_ && off_[t + 1] <= x) ++t;
        while (hp < hot_keys_.size() && hot_keys_[hp] < x) ++hp;
      }
      X[j] = x;
      R[j] = r;
      grp[j] = static_cast<i64>(group_begin.size()) - 1;
      table[j] = static_cast<i64>(t);
      slot[j] = hp < hot_keys_.size() && hot_keys_[hp] == x ? static_cast<i64>(hp) : -1;
      home[j] = block_div_[t].div(x - off_[t]);
      home_read[j] = home[j] == r;
      if (slot[j] < 0 && !home_read[j]) cp[j] = copies_.find(order[j]);
      held[j] = slot[j] >= 0 || home_read[j] || cp[j] != nullptr;
    }
    const size_t G = group_begin.size();
    group_begin.push_back(static_cast<i64>(n));
    auto base = [&](size_t j) -> i64 {
      return slot[j] >= 0 ? base_hot_[R[j] * nh + slot[j]] : cp[j] ? cp[j]->version : 0;
    };
    auto pending = [&](size_t j) -> i64 {
      return slot[j] >= 0 ? pending_hot_[R[j] * nh + slot[j]] : cp[j] ? cp[j]->pending : 0;
    };
    std::vector<i64> lag(n);
    auto lag_now = [&]() {
      for (size_t j = 0; j < n; ++j) lag[j] = home_read[j] ? 0 : hv(X[j], slot[j]) - base(j);
    };
    lag_now();
    for (size_t j = 0; j < n; ++j) refresh[j] = held[j] && !home_read[j] && lag[j] > s_;
    // a refreshing copy's pending updates go home before the reads; they raise the home version the other
    // copies are read against: grow the refreshed set to its fixed point, then push once, rank by rank
    std::vector<i64> ahead(G);
    while (true) {
      bool any = false;
      for (size_t j = 0; j < n; ++j) any |= (pend[j] = refresh[j] && pending(j) > 0);
      if (!any) break;
      std::fill(ahead.begin(), ahead.end(), 0);
      for (size_t j = 0; j < n; ++j)
        if (pend[j]) ahead[grp[j]] += pending(j);
      bool grew = false;
      for (size_t j = 0; j < n; ++j) {
        if (!refresh[j] && held[j] && !home_read[j] && lag[j] + ahead[grp[j]] > s_) {
          refresh[j] = 1;
          grew = true;
        }
      }
      if (!grew) break;
    }
    std::vector<Transfer> pre, post, miss;
    std::vector<uint8_t> pre_add, post_add, miss_add;
    {
      std::vector<std::pair<i64, i64>> go;
      for (size_t j = 0; j < n; ++j)
        if (pend[j]) go.push_back({X[j], R[j]});
      push(go, pre, pre_add);
    }
    lag_now();  // at read time
    i64 ctr[kNumCounters] = {};
    std::vector<Transfer> pull, reduce;
    std::vector<uint8_t> pull_miss;
    i64 stale_reads = 0, max_staleness = 0;
    std::vector<uint8_t> need(n);
    for (size_t j = 0; j < n; ++j) {
      const bool miss_j = !held[j];
      need[j] = miss_j || refresh[j];
      const bool cold = slot[j] < 0 && !home_read[j];
      ctr[kReads] += 1;
      ctr[kCacheReads] += cold;
      if (need[j]) {
        pull.push_back(Transfer{X[j], home[j], R[j]});
        pull_miss.push_back(miss_j);
        ctr[miss_j ? kMissPull : kUpdatePull] += 1;
      } else {
        ctr[kHits] += 1;
        ctr[kCacheHits] += cold;
        if (lag[j] > 0) {
          ++stale_reads;
          max_staleness = std::max(max_staleness, lag[j]);
        }
      }
    }
    // cache bookkeeping (remote cold rows), LRU as in the exact plan; a pulled copy is based on hv now
    for (size_t j = 0; j < n; ++j) {
      if (slot[j] >= 0 || home_read[j]) continue;
      if (cp[j]) {
        cp[j]->last_use = step_;
      } else {
        Row* row = rows_.find(X[j]);
        if (!row) row = &rows_.put(X[j], Row{0, 0, 0});
        ++row->count;
        ++count_[R[j] * T_ + table[j]];
      }
      touch(R[j], table[j], X[j]);
    }
    for (size_t j = 0; j < n; ++j) {  // (inserts first: pointers into copies_ move when it grows)
      if (slot[j] >= 0 || home_read[j] || cp[j]) continue;
      copies_.put(order[j], Copy{step_, 0, 0});
    }
    for (size_t j = 0; j < n; ++j) {
      cp[j] = slot[j] < 0 && !home_read[j] ? copies_.find(order[j]) : nullptr;
      if (!need[j]) continue;
      const i64 v = hv(X[j], slot[j]);
      if (slot[j] >= 0) base_hot_[R[j] * nh + slot[j]] = v;
      else cp[j]->version = v;
    }
    close_buckets();
    // writes (s = 0): one update per row, by its only reader or at home where several ranks' gradients are
    // summed; (s > 0) every reader updates its own copy, no gradient travels (HET's workers)
    std::vector<i64> update, reducer_of;
    update.reserve(s_ ? n : G);
    reducer_of.reserve(s_ ? n : G);
    std::vector<std::pair<i64, i64>> over;  // (key, rank), sorted: groups ascend by key, readers by rank
    auto write = [&](size_t j, i64 updater) {  // the update of row X[j] on updater's copy (j: a read of it)
      const i64 x = X[j], sl = slot[j];
      update.push_back(x);
      reducer_of.push_back(updater);
      if (updater == home[j]) {
        if (sl >= 0) {
          ++hv_hot_[sl];
        } else if (Row* row = rows_.find(x)) {  // tracked only while some rank caches it
          ++row->version;
        }
      } else {
        i64& p = sl >= 0 ? pending_hot_[updater * nh + sl] : cp[j]->pending;
        if (++p > s_) over.push_back({x, updater});
      }
    };
    for (size_t g = 0; g < G; ++g) {
      const size_t a = group_begin[g], b = group_begin[g + 1];
      if (s_ > 0) {
        for (size_t j = a; j < b; ++j) write(j, R[j]);
        continue;
      }
      const i64 reducer = b - a == 1 ? R[a] : home[a];
      for (size_t j = a; j < b; ++j)
        if (R[j] != reducer) reduce.push_back(Transfer{X[a], R[j], reducer});
      write(a, reducer);  // (a reducer other than home is the only reader, a: its read)
    }
    std::sort(reduce.begin(), reduce.end());
    ctr[kReduce] = static_cast<i64>(reduce.size());
    push(over, post, post_add);
    ctr[kUpdatePush] = static_cast<i64>(pre.size() + post.size());
    // evictions: an evicted copy with pending updates is pushed home; a row nobody caches forgets its hv
    std::vector<std::pair<i64, i64>> victims = lru_victims();
    std::vector<std::pair<i64, i64>> dirty;
    std::vector<i64> evicted, per_rank(W_, 0);
    for (const auto& v : victims) {
      if (copies_.find(v.second << kRankBits | v.first)->pending > 0) dirty.push_back({v.second, v.first});
      evicted.push_back(v.second);
      ++per_rank[v.first];
    }
    std::sort(dirty.begin(), dirty.end());
    push(dirty, miss, miss_add);
    for (const auto& v : victims) {
      copies_.erase(v.second << kRankBits | v.first);
      Row* row = rows_.find(v.second);
      if (--row->count == 0) rows_.erase(v.second);
    }
    maybe_compact();
    ctr[kMissPush] = static_cast<i64>(miss.size());
    std::vector<i64> stale = {stale_reads, max_staleness};
    ++step_;
    return {transfer_tensor(pre), flags(pre_add), transfer_tensor(pull), flags(pull_miss), transfer_tensor(reduce),
            vec_tensor(update), vec_tensor(reducer_of), transfer_tensor(post), flags(post_add), transfer_tensor(miss),
            flags(miss_add), vec_tensor(evicted), vec_tensor(per_rank), counters(ctr), vec_tensor(stale)};
  }

  // (push, its add flags, pull, cached keys, cached per rank): every pending update goes home, every
  // lagging hot replica is refreshed, the caches are dropped; resets the state
  std::vector<torch::Tensor> flush() {
    std::vector<std::pair<i64, i64>> go;
    const i64 nh = static_cast<i64>(hot_keys_.size());
    for (i64 r = 0; r < W_; ++r)
      for (i64 sl = 0; sl < nh; ++sl)
        if (pending_hot_[r * nh + sl] > 0) go.push_back({hot_keys_[sl], r});
    copies_.for_each([&](i64 k, const Copy& c) {
      if (c.pending > 0) go.push_back({k >> kRankBits, k & kRankMask});
    });
    std::sort(go.begin(), go.end());
    std::vector<Transfer> pushed, pull;
    std::vector<uint8_t> add;
    push(go, pushed, add);
    for (i64 sl = 0; sl < nh; ++sl) {
      const i64 h = home_of(hot_keys_[sl]);
      for (i64 r = 0; r < W_; ++r)
        if (r != h && hv_hot_[sl] - base_hot_[r * nh + sl] > 0) pull.push_back(Transfer{hot_keys_[sl], h, r});
    }
    auto dropped = cached();
    std::vector<torch::Tensor> out = {transfer_tensor(pushed), flags(add), sorted_transfers(pull), dropped.first,
                                      dropped.second};
    reset();
    return out;
  }

  // int32 [num_samples, W]: lookups local to each rank (hot, its own block, a copy at most s behind)
  torch::Tensor local_scores(const torch::Tensor& keys, const torch::Tensor& sample, i64 num_samples) const {
    return scores(keys, sample, num_samples, [this](const Row& row, const Copy& c) { return row.version - c.version <= s_; });
  }

  std::pair<torch::Tensor, torch::Tensor> cached_rows() const { return cached(); }

 private:
  i64 hv(i64 x, i64 sl) const {
    if (sl >= 0) return hv_hot_[sl];
    const Row* row = rows_.find(x);
    return row ? row->version : 0;
  }

  // push the pending updates of copies (x, r) (distinct, sorted by key then rank) home: each push sees the
  // home version its predecessors left (the first may replace, the others add)
  void push(const std::vector<std::pair<i64, i64>>& go, std::vector<Transfer>& out, std::vector<uint8_t>& add) {
    const i64 nh = static_cast<i64>(hot_keys_.size());
    for (size_t a = 0; a < go.size();) {
      const i64 x = go[a].first, sl = hot_slot(x), h = home_of(x);
      const i64 hv0 = hv(x, sl);
      i64 sum = 0;
      size_t b = a;
      for (; b < go.size() && go[b].first == x; ++b) {
        const i64 r = go[b].second;
        i64* base;
        i64* pend;
        if (sl >= 0) {
          base = &base_hot_[r * nh + sl];
          pend = &pending_hot_[r * nh + sl];
        } else {
          Copy* c = copies_.find(x << kRankBits | r);
          base = &c->version;
          pend = &c->pending;
        }
        add.push_back(hv0 + sum != *base);
        sum += *pend;
        *base += *pend;
        *pend = 0;
        out.push_back(Transfer{x, r, h});
      }
      if (sl >= 0) hv_hot_[sl] += sum;
      else rows_.find(x)->version += sum;  // (the pusher caches the row: it has a Row)
      a = b;
    }
  }

  i64 s_;
  std::vector<i64> hv_hot_, base_hot_, pending_hot_;  // [slot], [rank][slot], [rank][slot]
};

}  // namespace

void register_global_plan(pybind11::module& m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<GlobalExactCore>(m, "GlobalExactCore")
      .def(pybind11::init<i64, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, i64, i64>())
      .def("step", &GlobalExactCore::step)
      .def("state_bytes", &GlobalExactCore::state_bytes)
      .def("cached_rows", &GlobalExactCore::cached_rows)
      // the planner runs in the scheduler thread beside training: it lets go of the GIL
      .def("reset", &GlobalExactCore::reset, nogil())
      .def("plan_step", &GlobalExactCore::plan_step, nogil())
      .def("flush", &GlobalExactCore::flush, nogil())
      .def("local_scores", &GlobalExactCore::local_scores, nogil());
  pybind11::class_<GlobalStalenessCore>(m, "GlobalStalenessCore")
      .def(pybind11::init<i64, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, i64, i64, i64>())
      .def("step", &GlobalStalenessCore::step)
      .def("state_bytes", &GlobalStalenessCore::state_bytes)
      .def("cached_rows", &GlobalStalenessCore::cached_rows)
      .def("reset", &GlobalStalenessCore::reset, nogil())
      .def("plan_step", &GlobalStalenessCore::plan_step, nogil())
      .def("flush", &GlobalStalenessCore::flush, nogil())
      .def("local_scores", &GlobalStalenessCore::local_scores, nogil());
}
