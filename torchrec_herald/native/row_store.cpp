// The plan executor's by-key row access in compiled code: one pass over the keys that finds where each
// global key's row lives on this rank (a hot replica, a row of its own ROW_WISE block, or a cache slot)
// and copies the row, and its row-wise Adagrad state, out of or into that buffer (bounded staleness:
// adding accumulated updates, keeping each copy's base); each transfer list's route on this rank; and
// a bounded-staleness plan's pushes merged with the next plan's pulls.
//
// The torch reference is RowStore._where / read / write (torchrec_herald/sharding/row_store.py; tests
// compare the two). Hand-written because the reference runs about thirty small tensor ops per call and
// the executor calls it several times a step on the training thread. CPU rows only: a store on a GPU
// keeps the torch path.

#include <torch/extension.h>

#include "common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using i64 = int64_t;
constexpr int kHot = 0, kOwn = 1, kCache = 2, kNotHeld = -1;

// Where a rank holds a key's row: the layout's sorted hot keys, its tables' first keys, block sizes and this
// rank's block offsets, and the cache's sorted keys with their slots.
struct Where {
  const i64* hot;
  i64 num_hot;
  const i64* table_offsets;
  i64 num_tables;
  const i64* blocks;
  const i64* block_offsets;
  i64 rank;
  const i64* cache_keys;
  const i64* cache_slots;
  i64 num_cached;

  // kHot / kOwn / kCache with the row's slot in that buffer, or kNotHeld (the order of RowStore._where:
  // a hot replica first, then this rank's block, then the cache)
  int find(i64 key, i64* slot) const {
    if (num_hot) {
      const i64* p = std::lower_bound(hot, hot + num_hot, key);
      if (p != hot + num_hot && *p == key) {
        *slot = p - hot;
        return kHot;
      }
    }
    const i64 t = (std::upper_bound(table_offsets, table_offsets + num_tables, key) - table_offsets) - 1;
    if (t >= 0) {
      const i64 local = key - table_offsets[t], block = blocks[t];
      if (block > 0 && local / block == rank) {
        *slot = block_offsets[t] + local - rank * block;
        return kOwn;
      }
    }
    if (num_cached) {
      const i64* p = std::lower_bound(cache_keys, cache_keys + num_cached, key);
      if (p != cache_keys + num_cached && *p == key) {
        *slot = cache_slots[p - cache_keys];
        return kCache;
      }
    }
    return kNotHeld;
  }
};

Where where_of(const torch::Tensor& hot_keys, const torch::Tensor& table_offsets, const torch::Tensor& blocks,
               const torch::Tensor& block_offsets, i64 rank, const torch::Tensor& cache_keys,
               const torch::Tensor& cache_slots) {
  for (const auto* t : {&hot_keys, &table_offsets, &blocks, &block_offsets, &cache_keys, &cache_slots}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->device().is_cpu(),
                "row store: index tensors must be contiguous int64 on the CPU");
  }
  TORCH_CHECK(table_offsets.numel() == blocks.numel() && blocks.numel() == block_offsets.numel(),
              "row store: one offset, block size and block offset per table");
  TORCH_CHECK(cache_keys.numel() == cache_slots.numel(), "row store: one slot per cached key");
  return Where{hot_keys.data_ptr<i64>(), hot_keys.numel(), table_offsets.data_ptr<i64>(), table_offsets.numel(),
               blocks.data_ptr<i64>(), block_offsets.data_ptr<i64>(), rank, cache_keys.data_ptr<i64>(),
               cache_slots.data_ptr<i64>(), cache_keys.numel()};
}

// The three row buffers ([rows, D] float32, rows contiguous) and, with row-wise Adagrad, their states.
struct Buffers {
  float* w[3];
  i64 w_stride[3];
  i64 w_rows[3];
  float* s[3];
  i64 s_stride[3];
  bool state;
};

Buffers buffers_of(const std::vector<torch::Tensor>& w, const std::vector<torch::Tensor>& s, i64 dim) {
  TORCH_CHECK(w.size() == 3 && (s.empty() || s.size() == 3), "row store: hot, own and cache buffers");
  Buffers b{};
  b.state = !s.empty();
  for (int k = 0; k < 3; ++k) {
    TORCH_CHECK(w[k].scalar_type() == torch::kFloat32 && w[k].dim() == 2 && w[k].size(1) == dim &&
                    (w[k].size(0) == 0 || w[k].stride(1) == 1) && w[k].device().is_cpu(),
                "row store: row buffers must be float32 [rows, D] CPU tensors with contiguous rows");
    b.w[k] = w[k].data_ptr<float>();
    b.w_stride[k] = w[k].stride(0);
    b.w_rows[k] = w[k].size(0);
    if (b.state) {
      TORCH_CHECK(s[k].scalar_type() == torch::kFloat32 && s[k].dim() == 1 && s[k].size(0) >= w[k].size(0) &&
                      s[k].device().is_cpu(),
                  "row store: state buffers must be float32 [rows] CPU tensors");
      b.s[k] = s[k].data_ptr<float>();
      b.s_stride[k] = s[k].stride(0);
    }
  }
  return b;
}

void check_keys(const torch::Tensor& keys) {
  TORCH_CHECK(keys.scalar_type() == torch::kInt64 && keys.is_contiguous() && keys.dim() == 1,
              "row store: keys must be a contiguous int64 vector");
}

// Calls copy(i, kind, slot) for every key this rank holds in a buffer of ``b`` (the GIL let go meanwhile);
// returns the positions of the keys it does not hold.
template <typename Copy>
std::vector<i64> for_each_held(const Where& where, const Buffers& b, const torch::Tensor& keys, Copy copy) {
  const i64* k = keys.data_ptr<i64>();
  const i64 n = keys.numel();
  std::vector<i64> missing;
  pybind11::gil_scoped_release no_gil;
  for (i64 i = 0; i < n; ++i) {
    i64 slot = 0;
    const int kind = where.find(k[i], &slot);
    if (kind == kNotHeld || slot < 0 || slot >= b.w_rows[kind]) {
      missing.push_back(i);
      continue;
    }
    copy(i, kind, slot);
  }
  return missing;
}

torch::Tensor positions(const std::vector<i64>& v) {
  auto out = torch::empty({static_cast<i64>(v.size())}, torch::kInt64);
  if (!v.empty()) std::memcpy(out.data_ptr<i64>(), v.data(), v.size() * sizeof(i64));
  return out;
}

// (weights [n, D], states [n] (zeros without them), positions of the keys this rank does not hold)
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> row_store_gather(
    torch::Tensor keys, torch::Tensor hot_keys, torch::Tensor table_offsets, torch::Tensor blocks,
    torch::Tensor block_offsets, i64 rank, torch::Tensor cache_keys, torch::Tensor cache_slots,
    std::vector<torch::Tensor> w, std::vector<torch::Tensor> s, i64 dim) {
  check_keys(keys);
  const Where where = where_of(hot_keys, table_offsets, blocks, block_offsets, rank, cache_keys, cache_slots);
  const Buffers b = buffers_of(w, s, dim);
  const i64 n = keys.numel();
  auto out_w = torch::zeros({n, dim}, torch::kFloat32);  // (rows not held stay zero)
  auto out_s = torch::zeros({n}, torch::kFloat32);
  float* ow = out_w.data_ptr<float>();
  float* os = out_s.data_ptr<float>();
  const auto missing = for_each_held(where, b, keys, [&](i64 i, int kind, i64 slot) {
    std::memcpy(ow + i * dim, b.w[kind] + slot * b.w_stride[kind], dim * sizeof(float));
    if (b.state) os[i] = b.s[kind][slot * b.s_stride[kind]];
  });
  return {out_w, out_s, positions(missing)};
}

// Writes row i of ``rows`` (and ``states[i]`` with them) where this rank holds keys[i]; returns the
// positions of the keys it does not hold (not written: the caller gives them cache slots first).
torch::Tensor row_store_scatter(torch::Tensor keys, torch::Tensor hot_keys, torch::Tensor table_offsets,
                                torch::Tensor blocks, torch::Tensor block_offsets, i64 rank, torch::Tensor cache_keys,
                                torch::Tensor cache_slots, torch::Tensor rows, torch::Tensor states,
                                std::vector<torch::Tensor> w, std::vector<torch::Tensor> s, i64 dim) {
  check_keys(keys);
  const i64 n = keys.numel();
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() && rows.dim() == 2 && rows.size(0) == n &&
                  rows.size(1) == dim && rows.device().is_cpu(),
              "row store: rows must be contiguous float32 [len(keys), D] on the CPU");
  const Where where = where_of(hot_keys, table_offsets, blocks, block_offsets, rank, cache_keys, cache_slots);
  const Buffers b = buffers_of(w, s, dim);
  if (b.state) {
    TORCH_CHECK(states.scalar_type() == torch::kFloat32 && states.is_contiguous() && states.numel() == n &&
                    states.device().is_cpu(),
                "row store: states must be contiguous float32 [len(keys)] on the CPU");
  }
  const float* rw = rows.data_ptr<float>();
  const float* rs = b.state ? states.data_ptr<float>() : nullptr;
  return positions(for_each_held(where, b, keys, [&](i64 i, int kind, i64 slot) {
    std::memcpy(b.w[kind] + slot * b.w_stride[kind], rw + i * dim, dim * sizeof(float));
    if (b.state) b.s[kind][slot * b.s_stride[kind]] = rs[i];
  }));
}

// (kind: 0 hot replica, 1 own block row, 2 cache slot, -1 not held; the row's slot there, -1 if not held)
std::tuple<torch::Tensor, torch::Tensor> row_store_locate(torch::Tensor keys, torch::Tensor hot_keys,
                                                          torch::Tensor table_offsets, torch::Tensor blocks,
                                                          torch::Tensor block_offsets, i64 rank,
                                                          torch::Tensor cache_keys, torch::Tensor cache_slots) {
  check_keys(keys);
  const Where where = where_of(hot_keys, table_offsets, blocks, block_offsets, rank, cache_keys, cache_slots);
  const i64 n = keys.numel();
  auto kind = torch::empty({n}, torch::kInt64);
  auto slot = torch::empty({n}, torch::kInt64);
  const i64* k = keys.data_ptr<i64>();
  i64* ok = kind.data_ptr<i64>();
  i64* os = slot.data_ptr<i64>();
  {
    pybind11::gil_scoped_release no_gil;
    for (i64 i = 0; i < n; ++i) {
      i64 at = -1;
      ok[i] = where.find(k[i], &at);
      os[i] = ok[i] == kNotHeld ? -1 : at;
    }
  }
  return {kind, slot};
}

// The keys' rows grouped by kind of row, for the torch ops' gathers and scatters where the rows are on a GPU
// (RowStore._slots): the counts per kind [3] (0 hot, 1 own block, 2 cache), and [the keys' positions grouped by
// kind, each group in the keys' order | their slots, in the same order] (one copy to the device); the first
// position not held, or -1 (then the rest is not filled). One counting pass where min, bincount, a stable sort,
// an index and a cat took six host ops.
std::tuple<torch::Tensor, torch::Tensor, i64> row_store_slots(torch::Tensor keys, torch::Tensor hot_keys,
                                                              torch::Tensor table_offsets, torch::Tensor blocks,
                                                              torch::Tensor block_offsets, i64 rank,
                                                              torch::Tensor cache_keys, torch::Tensor cache_slots) {
  check_keys(keys);
  const Where where = where_of(hot_keys, table_offsets, blocks, block_offsets, rank, cache_keys, cache_slots);
  const i64 n = keys.numel();
  auto counts = torch::zeros({3}, torch::kInt64);
  auto flat = torch::empty({2 * n}, torch::kInt64);
  const i64* k = keys.data_ptr<i64>();
  i64* oc = counts.data_ptr<i64>();
  i64* of = flat.data_ptr<i64>();
  i64 missing = -1;
  {
    pybind11::gil_scoped_release no_gil;
    std::vector<int> kind(n);
    std::vector<i64> slot(n);
    for (i64 i = 0; i < n; ++i) {
      kind[i] = where.find(k[i], &slot[i]);
      if (kind[i] == kNotHeld) {
        missing = i;
        break;
      }
      ++oc[kind[i]];
    }
    if (missing < 0) {
      i64 next[3] = {0, oc[0], oc[0] + oc[1]};  // each kind's group starts after the ones before it
      for (i64 i = 0; i < n; ++i) {
        const i64 p = next[kind[i]]++;
        of[p] = i;
        of[n + p] = slot[i];
      }
    }
  }
  return {counts, flat, missing};
}

// Bounded staleness: each hot replica's and cache entry's base (its value and state when last synced with
// its home), [rows, D + 1] float32, rows contiguous. Own rows have none (their copy is the home's).
struct Bases {
  float* at[3];
  i64 rows[3];
};

Bases bases_of(const torch::Tensor& base_hot, const torch::Tensor& base_cache, i64 dim) {
  for (const auto* t : {&base_hot, &base_cache}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 && t->size(1) == dim + 1 &&
                    t->device().is_cpu(),
                "row store: bases must be contiguous float32 [rows, D + 1] CPU tensors");
  }
  return Bases{{base_hot.data_ptr<float>(), nullptr, base_cache.data_ptr<float>()},
               {base_hot.size(0), 0, base_cache.size(0)}};
}

// the row's base, or nullptr (an own row, or a slot past the buffer)
inline float* base_row(const Bases& bases, int kind, i64 slot, i64 dim) {
  return kind != kOwn && slot < bases.rows[kind] ? bases.at[kind] + slot * (dim + 1) : nullptr;
}

inline void set_base(float* base, const float* w, float s, i64 dim) {
  std::memcpy(base, w, dim * sizeof(float));
  base[dim] = s;
}

// Stores the rows one source sent (``rows`` [n, D (+ 1 state)]): where ``add[i]`` adds them to the row
// (an accumulated update), else replaces it; with ``track_base`` a hot replica's or cache entry's base
// becomes its new value. Returns the positions of the keys this rank does not hold (not written: the
// caller gives them cache slots first). The torch reference: PlanExecutor._store_received.
torch::Tensor row_store_receive(torch::Tensor keys, torch::Tensor hot_keys, torch::Tensor table_offsets,
                                torch::Tensor blocks, torch::Tensor block_offsets, i64 rank, torch::Tensor cache_keys,
                                torch::Tensor cache_slots, torch::Tensor rows, torch::Tensor add,
                                std::vector<torch::Tensor> w, std::vector<torch::Tensor> s, torch::Tensor base_hot,
                                torch::Tensor base_cache, bool track_base, i64 dim) {
  check_keys(keys);
  const i64 n = keys.numel();
  const Where where = where_of(hot_keys, table_offsets, blocks, block_offsets, rank, cache_keys, cache_slots);
  const Buffers b = buffers_of(w, s, dim);
  const i64 width = dim + (b.state ? 1 : 0);
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() && rows.dim() == 2 && rows.size(0) == n &&
                  rows.size(1) == width && rows.device().is_cpu(),
              "row store: received rows must be contiguous float32 [len(keys), ", width, "] on the CPU");
  TORCH_CHECK(add.scalar_type() == torch::kBool && add.is_contiguous() && add.numel() == n && add.device().is_cpu(),
              "row store: one add flag per key");
  const Bases bases = bases_of(base_hot, base_cache, dim);
  const float* src = rows.data_ptr<float>();
  const bool* a = add.data_ptr<bool>();
  return positions(for_each_held(where, b, keys, [&](i64 i, int kind, i64 slot) {
    float* dst = b.w[kind] + slot * b.w_stride[kind];
    const float* in = src + i * width;
    if (a[i]) {
      for (i64 d = 0; d < dim; ++d) dst[d] += in[d];
    } else {
      std::memcpy(dst, in, dim * sizeof(float));
    }
    float state = 0.0f;
    if (b.state) {
      float& st = b.s[kind][slot * b.s_stride[kind]];
      st = a[i] ? st + in[dim] : in[dim];
      state = st;
    }
    if (track_base) {
      if (float* base = base_row(bases, kind, slot, dim)) set_base(base, dst, state, dim);
    }
  }));
}

// (rows [n, D + 1]: each row's value and state (0 without), minus its base where ``add[i]`` (the copy's
// accumulated update); positions of the keys not held; positions of own rows flagged add, which have no
// base). The torch reference: PlanExecutor._row_payload.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> row_store_payload(
    torch::Tensor keys, torch::Tensor hot_keys, torch::Tensor table_offsets, torch::Tensor blocks,
    torch::Tensor block_offsets, i64 rank, torch::Tensor cache_keys, torch::Tensor cache_slots, torch::Tensor add,
    std::vector<torch::Tensor> w, std::vector<torch::Tensor> s, torch::Tensor base_hot, torch::Tensor base_cache,
    i64 dim) {
  check_keys(keys);
  const i64 n = keys.numel();
  const Where where = where_of(hot_keys, table_offsets, blocks, block_offsets, rank, cache_keys, cache_slots);
  const Buffers b = buffers_of(w, s, dim);
  TORCH_CHECK(add.scalar_type() == torch::kBool && add.is_contiguous() && add.numel() == n && add.device().is_cpu(),
              "row store: one add flag per key");
  const Bases bases = bases_of(base_hot, base_cache, dim);
  auto out = torch::zeros({n, dim + 1}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const bool* a = add.data_ptr<bool>();
  std::vector<i64> own_add;
  const auto missing = for_each_held(where, b, keys, [&](i64 i, int kind, i64 slot) {
    float* row = o + i * (dim + 1);
    std::memcpy(row, b.w[kind] + slot * b.w_stride[kind], dim * sizeof(float));
    if (b.state) row[dim] = b.s[kind][slot * b.s_stride[kind]];
    if (!a[i]) return;
    const float* base = base_row(bases, kind, slot, dim);
    if (!base) {
      own_add.push_back(i);
      return;
    }
    for (i64 d = 0; d <= dim; ++d) row[d] -= base[d];
  });
  return {out, positions(missing), positions(own_add)};
}

// base := current value and state for the hot replicas and cache entries among ``keys`` (own rows are
// passed over); returns the positions of the keys not held. The torch reference: RowStore.rebase.
torch::Tensor row_store_rebase(torch::Tensor keys, torch::Tensor hot_keys, torch::Tensor table_offsets,
                               torch::Tensor blocks, torch::Tensor block_offsets, i64 rank, torch::Tensor cache_keys,
                               torch::Tensor cache_slots, std::vector<torch::Tensor> w, std::vector<torch::Tensor> s,
                               torch::Tensor base_hot, torch::Tensor base_cache, i64 dim) {
  check_keys(keys);
  const Where where = where_of(hot_keys, table_offsets, blocks, block_offsets, rank, cache_keys, cache_slots);
  const Buffers b = buffers_of(w, s, dim);
  const Bases bases = bases_of(base_hot, base_cache, dim);
  return positions(for_each_held(where, b, keys, [&](i64, int kind, i64 slot) {
    if (float* base = base_row(bases, kind, slot, dim))
      set_base(base, b.w[kind] + slot * b.w_stride[kind], b.state ? b.s[kind][slot * b.s_stride[kind]] : 0.0f, dim);
  }));
}

// Of ``transfers`` (int64 [n, 3] rows (key, src, dst), the same on every rank): the positions rank ``me``
// sends, grouped by destination, with the count per destination; the positions it receives, grouped by
// source, with the count per source (plan order within each group). A counting sort: the torch reference
// (PlanExecutor._route) runs about ten small ops for it, three times a step on the training thread.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> plan_route(torch::Tensor transfers, i64 me,
                                                                                   i64 world) {
  TORCH_CHECK(transfers.scalar_type() == torch::kInt64 && transfers.is_contiguous() && transfers.dim() == 2 &&
                  transfers.size(1) == 3 && transfers.device().is_cpu(),
              "plan route: transfers must be contiguous int64 [n, 3] (key, src, dst) on the CPU");
  TORCH_CHECK(world >= 1 && me >= 0 && me < world, "plan route: rank ", me, " outside [0, ", world, ")");
  const i64 n = transfers.size(0);
  const i64* t = transfers.data_ptr<i64>();
  auto send_counts = torch::zeros({world}, torch::kInt64);
  auto recv_counts = torch::zeros({world}, torch::kInt64);
  i64* sc = send_counts.data_ptr<i64>();
  i64* rc = recv_counts.data_ptr<i64>();
  for (i64 i = 0; i < n; ++i) {
    const i64 src = t[3 * i + 1], dst = t[3 * i + 2];
    TORCH_CHECK(src >= 0 && src < world && dst >= 0 && dst < world, "plan route: transfer ", i, " names rank ",
                src < 0 || src >= world ? src : dst, ", outside [0, ", world, ")");
    if (src == me) ++sc[dst];
    if (dst == me) ++rc[src];
  }
  std::vector<i64> send_at(world, 0), recv_at(world, 0);
  for (i64 r = 1; r < world; ++r) {
    send_at[r] = send_at[r - 1] + sc[r - 1];
    recv_at[r] = recv_at[r - 1] + rc[r - 1];
  }
  auto send = torch::empty({world ? send_at[world - 1] + sc[world - 1] : 0}, torch::kInt64);
  auto recv = torch::empty({world ? recv_at[world - 1] + rc[world - 1] : 0}, torch::kInt64);
  i64* s = send.data_ptr<i64>();
  i64* r = recv.data_ptr<i64>();
  for (i64 i = 0; i < n; ++i) {
    if (t[3 * i + 1] == me) s[send_at[t[3 * i + 2]]++] = i;
    if (t[3 * i + 2] == me) r[recv_at[t[3 * i + 1]]++] = i;
  }
  return {send, send_counts, recv, recv_counts};
}


// A bounded-staleness plan's pushes (three phases: ``up``date pushes, eviction pushes ``miss``, the next
// plan's pushes before its reads ``pre``; each int64 [n, 3] (key, src, dst), with add flags, empty: none
// add) and the next plan's ``pulls`` as one transfer list: = PlanExecutor._additive_pushes_with_next_pulls's
// torch ops (their docstring states the rule), which run about twenty small ops a step on the training
// thread. Returns (ok, merged [N, 3], add [N], phase [N]); not ok where a rank pushes one row twice.
std::tuple<bool, torch::Tensor, torch::Tensor, torch::Tensor> additive_merge(
    torch::Tensor up, torch::Tensor miss, torch::Tensor pre, torch::Tensor up_add, torch::Tensor miss_add,
    torch::Tensor pre_add, torch::Tensor pulls, i64 world) {
  const torch::Tensor phases[3] = {up, miss, pre};
  const torch::Tensor flags[3] = {up_add, miss_add, pre_add};
  std::vector<i64> rows;  // the pushes, (key, src, dst), in phase order
  std::vector<uint8_t> add;
  std::vector<i64> phase;
  for (int ph = 0; ph < 3; ++ph) {
    const auto& t = phases[ph];
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 2 && t.size(1) == 3 && t.device().is_cpu(),
                "additive merge: transfers must be int64 [n, 3] (key, src, dst) on the CPU");
    const auto tc = t.contiguous();
    const i64 n = tc.size(0);
    const i64* p = tc.data_ptr<i64>();
    rows.insert(rows.end(), p, p + 3 * n);
    const bool flagged = flags[ph].numel() > 0;
    TORCH_CHECK(!flagged || (flags[ph].scalar_type() == torch::kBool && flags[ph].numel() == n),
                "additive merge: add flags must be empty or one bool per transfer");
    const auto fc = flagged ? flags[ph].contiguous() : flags[ph];
    const bool* f = flagged ? fc.data_ptr<bool>() : nullptr;
    for (i64 i = 0; i < n; ++i) {
      add.push_back(flagged && f[i]);
      phase.push_back(ph);
    }
  }
  const i64 P = static_cast<i64>(phase.size());
  for (i64 i = 0; i < P; ++i)
    TORCH_CHECK(rows[3 * i] >= 0 && rows[3 * i + 1] >= 0 && rows[3 * i + 1] < world,
                "additive merge: push ", i, " has a negative key or a source outside [0, ", world, ")");
  // each row's pushes in the order its home applies them: by key, then phase, then pushing rank
  std::vector<i64> order(P);
  for (i64 i = 0; i < P; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](i64 a, i64 b) {
    if (rows[3 * a] != rows[3 * b]) return rows[3 * a] < rows[3 * b];
    if (phase[a] != phase[b]) return phase[a] < phase[b];
    return rows[3 * a + 1] < rows[3 * b + 1];
  });
  std::vector<i64> by_rank(P);  // no rank may push one row twice
  for (i64 i = 0; i < P; ++i) by_rank[i] = rows[3 * i] * world + rows[3 * i + 1];
  std::sort(by_rank.begin(), by_rank.end());
  for (i64 i = 1; i < P; ++i)
    if (by_rank[i] == by_rank[i - 1]) return {false, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  TORCH_CHECK(pulls.scalar_type() == torch::kInt64 && pulls.dim() == 2 && pulls.size(1) == 3,
              "additive merge: pulls must be int64 [n, 3] (key, src, dst)");
  const auto pc = pulls.contiguous();
  const i64 M = pc.size(0);
  const i64* pl = pc.data_ptr<i64>();
  auto key_at = [&](i64 j) { return rows[3 * order[j]]; };
  // per pull: the sorted pushes of its key [lo, hi); a replacing first push reroutes the pull to its pusher
  std::vector<i64> lo(M), hi(M), pull_src(M);
  i64 copies = 0;
  for (i64 m = 0; m < M; ++m) {
    const i64 k = pl[3 * m];
    i64 a = 0, b = P;  // lower bound
    while (a < b) {
      const i64 mid = (a + b) / 2;
      if (key_at(mid) < k) a = mid + 1; else b = mid;
    }
    i64 e = a;
    while (e < P && key_at(e) == k) ++e;
    pull_src[m] = pl[3 * m + 1];
    i64 start = a;
    if (e > a && !add[order[a]]) {
      pull_src[m] = rows[3 * order[a] + 1];
      start = a + 1;
    }
    lo[m] = start;
    hi[m] = e;
    copies += e - start;
  }
  const i64 N = P + M + copies;
  auto merged = torch::empty({N, 3}, torch::kInt64);
  auto add_out = torch::empty({N}, torch::kBool);
  auto phase_out = torch::empty({N}, torch::kInt64);
  i64* o = merged.data_ptr<i64>();
  bool* oa = add_out.data_ptr<bool>();
  i64* op = phase_out.data_ptr<i64>();
  std::copy(rows.begin(), rows.end(), o);
  for (i64 i = 0; i < P; ++i) oa[i] = add[i], op[i] = phase[i];
  for (i64 m = 0; m < M; ++m) {
    o[3 * (P + m)] = pl[3 * m];
    o[3 * (P + m) + 1] = pull_src[m];
    o[3 * (P + m) + 2] = pl[3 * m + 2];
    oa[P + m] = false;
    op[P + m] = 0;
  }
  i64 at = P + M;
  for (i64 m = 0; m < M; ++m)
    for (i64 j = lo[m]; j < hi[m]; ++j, ++at) {  // the added updates the puller applies after the row
      o[3 * at] = rows[3 * order[j]];
      o[3 * at + 1] = rows[3 * order[j] + 1];
      o[3 * at + 2] = pl[3 * m + 2];
      oa[at] = true;
      op[at] = phase[order[j]];
    }
  return {true, merged, add_out, phase_out};
}

// The forward's lookups ``keys`` in the plan's sorted unique reads ``planned``: each key's position
// (= torch.searchsorted(planned, keys)) and whether the batch's rows differ from the plan's (a key not
// among them, or one of them not read) as a 0-d bool: = PlanExecutor.working_set's torch ops.
std::tuple<torch::Tensor, torch::Tensor> plan_positions(torch::Tensor planned, torch::Tensor keys) {
  TORCH_CHECK(planned.scalar_type() == torch::kInt64 && planned.dim() == 1 && planned.device().is_cpu(),
              "plan positions: planned must be an int64 vector on the CPU");
  TORCH_CHECK(keys.scalar_type() == torch::kInt64 && keys.device().is_cpu(),
              "plan positions: keys must be int64 on the CPU");
  const auto pc = planned.contiguous(), kc = keys.contiguous();
  const i64 n = pc.numel(), m = kc.numel();
  const i64* p = pc.data_ptr<i64>();
  const i64* k = kc.data_ptr<i64>();
  auto pos = torch::empty(kc.sizes(), torch::kInt64);
  i64* o = pos.data_ptr<i64>();
  std::vector<uint8_t> read(n, 0);
  bool wrong = n == 0 && m > 0;
  if (n > 0) {  // lower bounds (entries < key), searched in lockstep: a branchy search is slower than torch's
    herald::lockstep_bounds(p, n, k, m, o, [](i64 e, i64 key) { return e < key; });
    for (i64 i = 0; i < m; ++i) {
      const bool hit = o[i] < n && p[o[i]] == k[i];
      if (hit) read[o[i]] = 1;
      if (o[i] >= n) o[i] = n - 1;  // a key past every read: a lookup in range, the flag raises after backward
      wrong |= !hit;
    }
  } else {
    for (i64 i = 0; i < m; ++i) o[i] = 0;
  }
  for (i64 j = 0; j < n && !wrong; ++j) wrong = !read[j];
  return {pos, torch::scalar_tensor(wrong, torch::kBool)};
}
}  // namespace

void register_row_store(pybind11::module& m) {
  m.def("row_store_locate", &row_store_locate,
        "(kind: 0 hot, 1 own block, 2 cache, -1 not held; slot) of global keys on this rank");
  m.def("row_store_slots", &row_store_slots,
        "(counts per kind, [positions grouped by kind | their slots], first position not held or -1) of global keys");
  m.def("row_store_gather", &row_store_gather,
        "(weights, states, positions not held) of global keys' rows: hot replica, own block row or cache slot");
  m.def("row_store_scatter", &row_store_scatter,
        "write global keys' rows (and states) where this rank holds them; returns the positions it does not hold");
  m.def("row_store_receive", &row_store_receive,
        "store the rows one source sent (replace, or add where flagged), rebasing hot and cached copies; "
        "returns the positions not held");
  m.def("row_store_payload", &row_store_payload,
        "(value + state rows, minus the base where flagged; positions not held; own rows flagged add)");
  m.def("plan_route", &plan_route,
        "(positions sent grouped by destination, counts per destination, positions received grouped by source, "
        "counts per source) of a plan's (key, src, dst) transfers on one rank");
  m.def("plan_positions", &plan_positions,
        "(each key's position among the plan's sorted reads, whether the keys differ from the reads)");
  m.def("additive_merge", &additive_merge,
        "(ok, transfers, add flags, phases) of a bounded-staleness plan's pushes with the next plan's pulls");
  m.def("row_store_rebase", &row_store_rebase,
        "base := value + state of the hot replicas and cache entries among keys; returns the positions not held");
}
