// Herald's exact lazy plan split by row ownership, one rank's share, in compiled code.
//
// The same state and the same plan as the Python reference HomeSplitLazyPlanner
// (torchrec_herald/pipeline/home_split.py; tests compare the two on random traces): a rank is a
// *reader* (its LRU caches of remote rows) and a *home* (for the rows of its block: which rank holds
// the latest version, which ranks cache each row and whether that copy is the latest, the flags of the
// hot replicas homed here). Hand-written because every step is a few thousand hash-map operations whose
// per-call cost in tensor code (dozens of torch ops per stage) outweighs the work itself.
//
// Messages are the Python ``Messages`` layout: ``counts[peer][section]`` int64 words, ``data`` peer by
// peer, section by section. Transfers are int64 [n, 3] rows of (key, src, dst).

#include <torch/extension.h>

#include "common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifndef HERALD_NATIVE_SOURCE_SHA  // set by torchrec_herald/native/build.py: the loader refuses a stale build
#define HERALD_NATIVE_SOURCE_SHA "unknown"
#endif
#ifndef HERALD_NATIVE_TORCH
#define HERALD_NATIVE_TORCH "unknown"
#endif

namespace {

using namespace herald;
constexpr uint8_t kPull = 1, kReduceHere = 2;
constexpr int kReaderBits = 16;  // (key, reader) pairs sort as key << 16 | reader
constexpr i64 kReaderMask = (i64{1} << kReaderBits) - 1;
constexpr i64 kInitialEntries = i64{1} << 17;  // per map: 16 MiB for the three, 1/4 of the 64 MiB budget

// rows_ holds the rows homed here that are dirty (their latest version is on rank ``master``) or cached
// elsewhere (``count`` remote copies; a copy is the latest iff its version equals ``version``): herald::Row

class HomeSplitCore : protected TableLayout {
 public:
  HomeSplitCore(i64 world, i64 rank, torch::Tensor table_offsets, torch::Tensor blocks, torch::Tensor hot_keys,
                torch::Tensor capacity, i64 num_rows)
      : TableLayout(table_offsets, blocks, hot_keys, capacity), W_(world), me_(rank), num_rows_(num_rows) {
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "herald_native: rank ", rank, " of ", world);
    TORCH_CHECK(world <= kReaderMask + 1, "herald_native: at most ", kReaderMask + 1, " ranks, got ", world);
    own_index_.assign(hot_keys_.size(), -1);
    for (size_t s = 0; s < hot_keys_.size(); ++s) {
      if (home_of(hot_keys_[s]) == me_) {
        own_index_[s] = static_cast<i64>(own_slots_.size());
        own_slots_.push_back(static_cast<i64>(s));
      }
    }
    reset();
  }

  void reset() {
    // sized for the caches' first steps up front: in the first ~10 steps of a run, doubling from empty
    // spent a quarter of the planner's CPU rehashing
    const size_t room = static_cast<size_t>(std::min<i64>(cache_capacity(), kInitialEntries));
    cache_.clear(room);
    count_.assign(T_, 0);
    lru_.assign(T_, std::deque<Bucket>());
    bucket_entries_ = 0;
    sent_next_.clear();
    has_sent_next_ = false;
    rows_.clear(room);
    copies_.clear(room);
    hot_valid_.assign(own_slots_.size() * W_, 1);
    ahead_keys_.clear();
    ahead_begin_.assign(W_ + 1, 0);
    step_ = 0;
  }

  i64 step() const { return step_; }

  i64 state_bytes() const {
    return static_cast<i64>(cache_.bytes() + rows_.bytes() + copies_.bytes() + hot_valid_.size() +
                            8 * (bucket_entries_ + ahead_keys_.size() + sent_next_.size()) + 8 * hot_slot_.size());
  }

  i64 cache_size() const { return static_cast<i64>(cache_.size()); }
  i64 cache_capacity() const {
    i64 c = 0;
    for (i64 x : cap_) c += x;
    return c;
  }

  // ---------------------------------------------------------------- reader
  std::pair<torch::Tensor, torch::Tensor> reader(const torch::Tensor& now_t, const torch::Tensor& nxt_t, bool use_next) {
    now_ = sorted_unique(now_t, "this step's");
    std::vector<i64> nxt = use_next ? sorted_unique(nxt_t, "the next step's") : std::vector<i64>();
    const size_t n = now_.size();
    std::vector<i64> home(n);
    std::vector<uint8_t> is_new(n, 0);
    std::vector<std::vector<i64>> touched(T_);
    size_t t = 0, hp = 0;  // the keys ascend: walk the tables and the hot keys alongside
    for (size_t i = 0; i < n; ++i) {
      if (i + 16 < n) cache_.prefetch(now_[i + 16]);
      const i64 x = now_[i];
      while (t + 1 < T_ && off_[t + 1] <= x) ++t;
      while (hp < hot_keys_.size() && hot_keys_[hp] < x) ++hp;
      const i64 h = block_div_[t].div(x - off_[t]);
      home[i] = h;
      if (h == me_ || (hp < hot_keys_.size() && hot_keys_[hp] == x)) continue;
      i64* last_use = cache_.find(x);
      if (last_use) {
        *last_use = step_;
      } else {
        cache_.put(x, step_);
        ++count_[t];
        is_new[i] = 1;
      }
      touched[t].push_back(x);
    }
    for (size_t k = 0; k < T_; ++k) {
      if (touched[k].empty()) continue;
      bucket_entries_ += touched[k].size();
      lru_[k].push_back(Bucket{step_, std::move(touched[k]), 0});
    }
    victims_ = evict();
    const bool has_now = !(has_sent_next_ && sent_next_ == now_);
    has_sent_next_ = use_next;
    // this step's keys to their homes (each home's in ascending order), with their new flags
    now_home_count_.assign(W_, 0);
    for (size_t i = 0; i < n; ++i) ++now_home_count_[home[i]];
    MessageBuilder msg(W_, 4);
    for (i64 q = 0; q < W_; ++q) msg.add(0, q, has_now ? 1 : 0);
    if (has_now) {
      msg.reserve(1, n);
      for (size_t i = 0; i < n; ++i) msg.add(1, home[i], now_[i]);
    }
    now_home_of_ = std::move(home);
    now_is_new_ = std::move(is_new);
    add_by_home(msg, 2, nxt);
    add_by_home(msg, 3, victims_);
    sent_next_ = std::move(nxt);
    return msg.build();
  }

  // ---------------------------------------------------------------- home
  std::pair<torch::Tensor, torch::Tensor> home(const torch::Tensor& counts, const torch::Tensor& data) {
    MessageView in(counts, data, W_, 4);
    // each reader's reads: what it sent now, or what it sent ahead last step
    std::vector<i64> X;
    std::vector<i64> R;
    std::vector<i64> reader_begin(W_ + 1, 0);
    for (i64 q = 0; q < W_; ++q) {
      TORCH_CHECK(in.count(q, 0) == 1, "herald_native: rank ", q, "'s message lacks its has-now word");
      bool has_now = in.words(q, 0)[0] > 0;
      const i64* k = has_now ? in.words(q, 1) : ahead_keys_.data() + ahead_begin_[q];
      i64 m = has_now ? in.count(q, 1) : ahead_begin_[q + 1] - ahead_begin_[q];
      X.insert(X.end(), k, k + m);
      R.insert(R.end(), static_cast<size_t>(m), q);
      reader_begin[q + 1] = static_cast<i64>(X.size());
    }
    // the keys each reader reads next step, kept for when they do not come again
    std::vector<i64> next_keys, next_src, next_begin(W_ + 1, 0);
    for (i64 q = 0; q < W_; ++q) {
      const i64* k = in.words(q, 2);
      i64 m = in.count(q, 2);
      next_keys.insert(next_keys.end(), k, k + m);
      next_src.insert(next_src.end(), static_cast<size_t>(m), q);
      next_begin[q + 1] = static_cast<i64>(next_keys.size());
    }
    const size_t n = X.size();
    // (key, reader) order: a key's readers adjacent, lowest rank first. Each reader's keys ascend (its
    // reads are sorted unique, grouped by home stably), so the k-th pair of reader r is its k-th key.
    std::vector<i64> order(n);  // key << 16 | reader (W <= 65536)
    for (size_t i = 0; i < n; ++i) order[i] = X[i] << kReaderBits | R[i];
    merge_runs(order, reader_begin);
    std::vector<i64> cursor(reader_begin.begin(), reader_begin.end() - 1);
    std::vector<i64> pos(n);  // position of each (key, reader) pair in reader order
    for (size_t i = 0; i < n; ++i) {
      const i64 r = order[i] & kReaderMask;
      pos[i] = cursor[r]++;
      TORCH_CHECK((X[pos[i]] << kReaderBits | r) == order[i], "herald_native: rank ", r, "'s keys for rank ", me_,
                  " are not sorted and unique");
    }
    std::vector<uint8_t> flags(n, 0);
    pre_.clear(); pull_.clear(); pull_miss_.clear(); reduce_.clear(); post_.clear(); miss_.clear(); update_.clear();
    pull_.reserve(n);
    pull_miss_.reserve(n);
    reduce_.reserve(n);
    update_.reserve(n);
    std::fill(std::begin(counters_), std::end(counters_), 0);
    constexpr size_t kAhead = 16;  // pairs whose hash slots are prefetched ahead of use
    size_t fetched = 0;
    // the exact rule's state and transfers (see herald::exact_row), and each pair's flags for its reader
    struct Rules {
      HomeSplitCore& c;
      const std::vector<i64>& order;
      const std::vector<i64>& pos;
      std::vector<uint8_t>& flags;
      Row* find_row(i64 x) { return c.rows_.find(x); }
      Row& put_row(i64 x, Row row) { return c.rows_.put(x, row); }
      void release(i64 x, Row* st) { c.release(x, st); }
      i64* copy(size_t j, i64, Row& st, bool& is_new) {
        i64* v = c.copies_.find(order[j]);
        if (!v) {
          is_new = true;
          v = &c.copies_.put(order[j], st.version);
          ++st.count;
        }
        return v;
      }
      void pre(i64 x, i64 from, i64 to) { c.pre_.push_back(Transfer{x, from, to}); }
      void pull(size_t j, i64 x, i64 from, i64 to, bool is_new) {
        TORCH_CHECK(from == c.me_, "home-split plan: a pull whose source is not the row's home");
        c.pull_.push_back(Transfer{x, from, to});
        c.pull_miss_.push_back(is_new);
        flags[pos[j]] |= kPull;
      }
      void reduce(size_t, i64 x, i64 from, i64 to) { c.reduce_.push_back(Transfer{x, from, to}); }
      void reduce_here(size_t j) { flags[pos[j]] |= kReduceHere; }
      void updated(i64 x, i64 reducer) {
        if (reducer == c.me_) c.update_.push_back(x);
      }
    } rules{*this, order, pos, flags};
    size_t hp = 0;
    for (size_t a = 0; a < n;) {
      for (; fetched < std::min(n, a + kAhead); ++fetched) {
        rows_.prefetch(order[fetched] >> kReaderBits);
        copies_.prefetch(order[fetched]);
      }
      const i64 x = order[a] >> kReaderBits;
      size_t b = a + 1;
      while (b < n && (order[b] >> kReaderBits) == x) ++b;
      while (hp < hot_keys_.size() && hot_keys_[hp] < x) ++hp;  // the keys ascend: walk the hot keys
      uint8_t* valid = nullptr;
      if (hp < hot_keys_.size() && hot_keys_[hp] == x) {
        const i64 own = own_index_[hp];
        TORCH_CHECK(own >= 0, "herald_native: rank ", me_, " received hot key ", x, " homed elsewhere");
        valid = &hot_valid_[own * W_];
      }
      exact_row(rules, order.data(), a, b, kReaderBits, x, me_, valid, W_, counters_);
      a = b;
    }
    // look-ahead: a dirty row another rank reads next step goes home now
    std::vector<i64> go;
    for (size_t i = 0; i < next_keys.size(); ++i) {
      if (i + kAhead < next_keys.size()) rows_.prefetch(next_keys[i + kAhead]);
      i64 m1 = master(next_keys[i]);
      if (m1 != me_ && next_src[i] != m1) go.push_back(next_keys[i]);
    }
    std::sort(go.begin(), go.end());
    go.erase(std::unique(go.begin(), go.end()), go.end());
    for (i64 x : go) push_home(x, post_);
    counters_[kUpdatePush] = static_cast<i64>(pre_.size() + post_.size());
    // evictions: a victim holding the only latest version goes home; its copy is gone
    std::vector<std::pair<i64, i64>> vict;  // (key, reader)
    for (i64 q = 0; q < W_; ++q) {
      const i64* k = in.words(q, 3);
      for (i64 i = 0; i < in.count(q, 3); ++i) vict.push_back({k[i], q});
    }
    std::vector<uint8_t> goes(vict.size());
    for (size_t i = 0; i < vict.size(); ++i) goes[i] = master(vict[i].first) == vict[i].second;
    for (size_t i = 0; i < vict.size(); ++i) {
      const i64 x = vict[i].first, r = vict[i].second;
      Row* st = rows_.find(x);
      if (goes[i]) {
        miss_.push_back(Transfer{x, r, me_});
        st->master = me_;
      }
      if (copies_.erase(x << kReaderBits | r)) --st->count;
      if (st) release(x, st);
    }
    counters_[kMissPush] = static_cast<i64>(miss_.size());
    ahead_keys_ = std::move(next_keys);
    ahead_begin_ = std::move(next_begin);
    // replies: per reader its flags in its send order, 8 to a word; the rows it pushes home
    MessageBuilder reply(W_, 4);
    for (i64 q = 0; q < W_; ++q) {
      const i64 lo = reader_begin[q], m = reader_begin[q + 1] - lo;
      for (i64 w = 0; w < (m + 7) / 8; ++w) {
        uint64_t word = 0;
        for (i64 k = 0; k < 8 && w * 8 + k < m; ++k) word |= static_cast<uint64_t>(flags[lo + w * 8 + k]) << (8 * k);
        reply.add(0, q, static_cast<i64>(word));
      }
    }
    for (const Transfer& t : pre_) reply.add(1, t.src, t.key);
    for (const Transfer& t : post_) reply.add(2, t.src, t.key);
    for (const Transfer& t : miss_) reply.add(3, t.src, t.key);
    return reply.build();
  }

  // ---------------------------------------------------------------- this rank's plan
  // (push_before_read, pull, pull_miss, reduce, update_keys, update_push, miss_push, reads, evictions, counters)
  std::vector<torch::Tensor> assemble(const torch::Tensor& counts, const torch::Tensor& data) {
    MessageView in(counts, data, W_, 4);
    std::vector<const uint8_t*> flag_of(W_);
    for (i64 h = 0; h < W_; ++h) {
      const i64 m = now_home_count_[h];
      TORCH_CHECK(in.count(h, 0) == (m + 7) / 8, "herald_native: rank ", h, " replied with ", in.count(h, 0),
                  " flag words for ", m, " keys");
      flag_of[h] = reinterpret_cast<const uint8_t*>(in.words(h, 0));
    }
    // this rank's reads of other homes' rows, in key order (a home's flags follow its keys' order)
    std::vector<Transfer> my_pull, my_reduce;
    std::vector<uint8_t> my_miss;
    std::vector<i64> my_update;
    my_pull.reserve(now_.size());
    my_miss.reserve(now_.size());
    my_reduce.reserve(now_.size());
    my_update.reserve(now_.size());
    for (size_t i = 0; i < now_.size(); ++i) {
      const i64 h = now_home_of_[i];
      const uint8_t f = *flag_of[h]++;
      if (h == me_) continue;  // this rank's own rows: its home share holds every decision
      const i64 x = now_[i];
      if (f & kPull) {
        my_pull.push_back(Transfer{x, h, me_});
        my_miss.push_back(now_is_new_[i]);
      }
      if (f & kReduceHere) {
        my_update.push_back(x);
      } else {
        my_reduce.push_back(Transfer{x, me_, h});
      }
    }
    // the home share and the reader share are each sorted: merge
    std::vector<size_t> pull_order = merge_order(pull_, my_pull);
    auto miss_t = torch::empty({static_cast<i64>(pull_order.size())}, torch::kBool);
    auto pull_t = torch::empty({static_cast<i64>(pull_order.size()), 3}, torch::kInt64);
    bool* mp = miss_t.data_ptr<bool>();
    Transfer* pp = reinterpret_cast<Transfer*>(pull_t.data_ptr<i64>());
    for (size_t i = 0; i < pull_order.size(); ++i) {
      const size_t k = pull_order[i];
      const bool home_share = k < pull_.size();
      pp[i] = home_share ? pull_[k] : my_pull[k - pull_.size()];
      mp[i] = (home_share ? pull_miss_[k] : my_miss[k - pull_.size()]) != 0;
    }
    std::vector<Transfer> reduce(reduce_.size() + my_reduce.size());
    std::merge(reduce_.begin(), reduce_.end(), my_reduce.begin(), my_reduce.end(), reduce.begin());
    std::vector<i64> update(update_.size() + my_update.size());
    std::merge(update_.begin(), update_.end(), my_update.begin(), my_update.end(), update.begin());
    std::vector<Transfer> pre = pre_, post = post_, miss = miss_;
    std::vector<Transfer>* to[3] = {&pre, &post, &miss};
    for (i64 q = 0; q < W_; ++q) {
      if (q == me_) continue;
      for (int s = 1; s <= 3; ++s) {
        const i64* k = in.words(q, s);
        for (i64 i = 0; i < in.count(q, s); ++i) to[s - 1]->push_back(Transfer{k[i], me_, q});
      }
    }
    auto ctr = torch::empty({kNumCounters}, torch::kInt64);
    std::memcpy(ctr.data_ptr<i64>(), counters_, sizeof(counters_));
    ++step_;
    return {sorted_transfers(pre), pull_t, miss_t, transfer_tensor(reduce), vec_tensor(update),
            sorted_transfers(post), sorted_transfers(miss), vec_tensor(now_), vec_tensor(victims_), ctr};
  }

  // ---------------------------------------------------------------- flush
  std::pair<torch::Tensor, torch::Tensor> flush_messages() {
    std::vector<i64> keys;
    rows_.for_each([&](i64 k, const Row& st) {
      if (st.master != me_) keys.push_back(k);
    });
    std::sort(keys.begin(), keys.end());
    flush_push_.clear();
    for (i64 x : keys) push_home(x, flush_push_);
    flush_pull_.clear();
    for (size_t o = 0; o < own_slots_.size(); ++o)
      for (i64 r = 0; r < W_; ++r)
        if (!hot_valid_[o * W_ + r]) flush_pull_.push_back(Transfer{hot_keys_[own_slots_[o]], me_, r});
    MessageBuilder msg(W_, 2);
    for (const Transfer& t : flush_push_) msg.add(0, t.src, t.key);
    for (const Transfer& t : flush_pull_) msg.add(1, t.dst, t.key);
    return msg.build();
  }

  // (push, pull, dropped); resets the state
  std::vector<torch::Tensor> flush_assemble(const torch::Tensor& counts, const torch::Tensor& data) {
    MessageView in(counts, data, W_, 2);
    std::vector<Transfer> push = flush_push_, pull = flush_pull_;
    for (i64 q = 0; q < W_; ++q) {
      if (q == me_) continue;
      const i64* k = in.words(q, 0);
      for (i64 i = 0; i < in.count(q, 0); ++i) push.push_back(Transfer{k[i], me_, q});
      k = in.words(q, 1);
      for (i64 i = 0; i < in.count(q, 1); ++i) pull.push_back(Transfer{k[i], q, me_});
    }
    std::vector<i64> dropped;
    dropped.reserve(cache_.size());
    cache_.for_each([&](i64 k, i64) { dropped.push_back(k); });
    std::sort(dropped.begin(), dropped.end());
    std::vector<torch::Tensor> out = {sorted_transfers(push), sorted_transfers(pull), vec_tensor(dropped)};
    reset();
    return out;
  }

 private:

  std::vector<i64> sorted_unique(const torch::Tensor& t, const char* what) const {
    std::vector<i64> v = to_vec(t.reshape(-1));
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i] < 0 || v[i] >= num_rows_)
        throw std::invalid_argument("read keys outside [0, " + std::to_string(num_rows_) + ")");
      if (i && v[i] <= v[i - 1])
        throw std::invalid_argument(std::string("planning by home: ") + what +
                                    " read keys must be sorted and unique (torch.unique)");
    }
    return v;
  }

  i64 master(i64 x) const {
    const Row* st = rows_.find(x);
    return st ? st->master : me_;
  }
  // forget a row that is clean and cached nowhere
  void release(i64 x, Row* st) {
    if (st->count == 0 && st->master == me_) rows_.erase(x);
  }
  // dirty row x goes home (from its master): its home's hot replica is the latest again
  void push_home(i64 x, std::vector<Transfer>& out) {
    Row* st = rows_.find(x);
    out.push_back(Transfer{x, st->master, me_});
    const i64 s = hot_slot(x);
    if (s >= 0) hot_valid_[own_index_[s] * W_ + me_] = 1;
    st->master = me_;
    release(x, st);
  }

  // each key to its home, each home's in ascending order (build() groups them stably)
  void add_by_home(MessageBuilder& msg, int s, const std::vector<i64>& keys) const {
    msg.reserve(s, keys.size());
    size_t t = 0;  // the keys ascend (victims, look-ahead reads): walk the tables alongside
    for (i64 x : keys) {
      while (t + 1 < T_ && off_[t + 1] <= x) ++t;
      msg.add(s, block_div_[t].div(x - off_[t]), x);
    }
  }

  // trim each table's cache to capacity: least recently used first, ties to the lower key; sorted keys
  std::vector<i64> evict() {
    std::vector<i64> out;
    for (size_t t = 0; t < T_; ++t) {
      const i64 excess = count_[t] - cap_[t];
      if (excess <= 0) continue;
      const i64 taken = lru_take(lru_[t], excess, bucket_entries_, [&](i64 x, i64 step) {
        const i64* last_use = cache_.find(x);
        if (!last_use || *last_use != step) return false;
        out.push_back(x);
        cache_.erase(x);
        return true;
      });
      count_[t] -= taken;
      TORCH_CHECK(taken == excess, "herald_native: LRU of table ", t, " is empty with ", excess - taken,
                  " rows over capacity");
    }
    if (bucket_entries_ > 2 * cache_.size() + 4096) compact();
    std::sort(out.begin(), out.end());
    return out;
  }

  void compact() {  // drop the entries of rows read again later or evicted
    bucket_entries_ = 0;
    for (auto& dq : lru_)
      lru_compact(dq, bucket_entries_, [&](i64 x, i64 step) {
        const i64* last_use = cache_.find(x);
        return last_use && *last_use == step;
      });
  }

  // layout
  i64 W_, me_, num_rows_;
  std::vector<i64> own_index_, own_slots_;
  // reader
  FlatMap<i64> cache_;  // cached remote row -> the step it was last read at
  std::vector<i64> count_;
  std::vector<std::deque<Bucket>> lru_;
  size_t bucket_entries_ = 0;
  std::vector<i64> sent_next_;
  bool has_sent_next_ = false;
  std::vector<i64> now_, now_home_of_, now_home_count_, victims_;  // this step's reads, their homes
  std::vector<uint8_t> now_is_new_;  // the read entered the cache this step
  // home
  FlatMap<Row> rows_;  // rows homed here that are dirty or cached elsewhere
  FlatMap<i64> copies_;     // x << 16 | r -> version of rank r's copy of row x
  std::vector<uint8_t> hot_valid_;  // [own hot slot][rank]
  std::vector<i64> ahead_keys_, ahead_begin_;
  std::vector<Transfer> pre_, pull_, reduce_, post_, miss_, flush_push_, flush_pull_;
  std::vector<uint8_t> pull_miss_;
  std::vector<i64> update_;
  i64 counters_[kNumCounters] = {};
  i64 step_ = 0;
};

}  // namespace

using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;

void register_row_store(pybind11::module& m);  // row_store.cpp: the plan executor's by-key row access
void register_global_plan(pybind11::module& m);  // global_plan.cpp: the global lazy plan and HET's
void register_id_split(pybind11::module& m);  // id_split.cpp: hot replication's per-step id bookkeeping
void register_greedy_assign(pybind11::module& m);  // greedy_assign.cpp: the input allocator's greedy
void register_synthetic_sample(pybind11::module& m);  // synthetic_sample.cpp: the synthetic data's sampling
void register_batch_keys(pybind11::module& m);  // batch_keys.cpp: a batch's keys, reads and sample selection

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Herald's per-rank lazy plan (planning by home) and the plan executor's row access in compiled code";
  register_row_store(m);
  register_global_plan(m);
  register_id_split(m);
  register_greedy_assign(m);
  register_synthetic_sample(m);
  register_batch_keys(m);
  m.attr("SOURCE_SHA") = HERALD_NATIVE_SOURCE_SHA;
  m.attr("TORCH_VERSION") = HERALD_NATIVE_TORCH;
  pybind11::class_<HomeSplitCore>(m, "HomeSplitCore")
      .def(pybind11::init<i64, i64, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, i64>())
      .def("step", &HomeSplitCore::step)
      .def("state_bytes", &HomeSplitCore::state_bytes)
      .def("cache_size", &HomeSplitCore::cache_size)
      .def("cache_capacity", &HomeSplitCore::cache_capacity)
      // the stages run in the scheduler thread beside training: they let go of the GIL, so the training
      // thread's Python goes on meanwhile (an instance is used by one thread at a time)
      .def("reset", &HomeSplitCore::reset, nogil())
      .def("reader", &HomeSplitCore::reader, nogil())
      .def("home", &HomeSplitCore::home, nogil())
      .def("assemble", &HomeSplitCore::assemble, nogil())
      .def("flush_messages", &HomeSplitCore::flush_messages, nogil())
      .def("flush_assemble", &HomeSplitCore::flush_assemble, nogil());
}
