// A batch's way into herald's window, compiled: its global row keys (keys stage), each rank's sorted
// unique reads (reads stage) and a sample selection of its bags (allocate stage).
//
// The torch ops these replace (pipeline/stages/keys.py, reads.py, context.select_samples) are a dozen
// small ops each over a global batch's ~13k ids, about 2 ms of a scheduling rank's CPU a step; here each
// stage is one pass, with the GIL released. The torch ops stay where this is not built, and
// tests/test_batch_keys_native.py checks both give the same tensors.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using i64 = int64_t;

template <class T>
T* ptr(const torch::Tensor& t) {
  return t.data_ptr<T>();
}

// Least-significant-digit radix sort of v (values < 2**bits) in place; tmp is scratch of the same size.
void radix_sort(std::vector<uint64_t>& v, std::vector<uint64_t>& tmp, int bits) {
  constexpr int kDigit = 11;
  constexpr size_t kBuckets = size_t(1) << kDigit;
  tmp.resize(v.size());
  std::vector<size_t> count(kBuckets);
  for (int shift = 0; shift < bits; shift += kDigit) {
    std::fill(count.begin(), count.end(), 0);
    for (uint64_t x : v) ++count[(x >> shift) & (kBuckets - 1)];
    size_t at = 0;
    for (auto& c : count) {
      const size_t n = c;
      c = at;
      at += n;
    }
    for (uint64_t x : v) tmp[count[(x >> shift) & (kBuckets - 1)]++] = x;
    v.swap(tmp);
  }
}

int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

// v sorted, repeats dropped
void sort_unique(std::vector<uint64_t>& v, uint64_t max_value) {
  std::vector<uint64_t> tmp;
  radix_sort(v, tmp, bit_length(max_value));
  v.erase(std::unique(v.begin(), v.end()), v.end());
}

torch::Tensor as_int64(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 1, what, " must be a vector");
  TORCH_CHECK(t.scalar_type() == torch::kInt64 || t.scalar_type() == torch::kInt32, what, " must be int32 or int64");
  return t.to(torch::kInt64).contiguous();
}

// keys stage: a KJT's feature-major bags (lengths [F * B]) -> each id's global row key
// (feature_offsets[f] + id), its sample, and the number of ids outside their table (< 0 or >= rows[f];
// their keys are meaningless and the caller names the first one)
std::vector<torch::Tensor> batch_keys(torch::Tensor values, torch::Tensor lengths, torch::Tensor feature_offsets,
                                      torch::Tensor rows_per_feature, i64 B) {
  const auto v = as_int64(values, "batch_keys: values");
  const auto l = as_int64(lengths, "batch_keys: lengths");
  const auto off = as_int64(feature_offsets, "batch_keys: feature_offsets");
  const auto rows = as_int64(rows_per_feature, "batch_keys: rows_per_feature");
  const i64 F = off.numel();
  TORCH_CHECK(rows.numel() == F, "batch_keys: ", F, " feature offsets but ", rows.numel(), " table sizes");
  TORCH_CHECK(B >= 0 && l.numel() == F * B, "batch_keys: ", l.numel(), " lengths for ", F, " features of ", B,
              " samples");
  const i64 n = v.numel();
  auto keys = torch::empty({n}, torch::kInt64);
  auto sample = torch::empty({n}, torch::kInt64);
  const i64 *pv = ptr<i64>(v), *pl = ptr<i64>(l), *po = ptr<i64>(off), *pr = ptr<i64>(rows);
  i64 *pk = ptr<i64>(keys), *ps = ptr<i64>(sample);
  i64 at = 0, invalid = 0;
  for (i64 f = 0; f < F; ++f) {
    const i64 base = po[f], limit = pr[f];
    for (i64 s = 0; s < B; ++s) {
      const i64 len = pl[f * B + s];
      TORCH_CHECK(len >= 0 && at + len <= n, "batch_keys: bag lengths do not add up to the ", n, " ids");
      for (i64 e = at + len; at < e; ++at) {
        const i64 id = pv[at];
        invalid += (id < 0) | (id >= limit);
        pk[at] = base + id;
        ps[at] = s;
      }
    }
  }
  TORCH_CHECK(at == n, "batch_keys: bag lengths add up to ", at, " ids, the batch has ", n);
  return {keys, sample, torch::scalar_tensor(invalid, torch::kInt64)};
}

// sorted unique keys (>= 0) = torch.unique(keys)
torch::Tensor sorted_unique_keys(torch::Tensor keys) {
  const auto k = as_int64(keys, "sorted_unique_keys: keys");
  const i64* pk = ptr<i64>(k);
  std::vector<uint64_t> v(k.numel());
  uint64_t hi = 0;
  for (i64 i = 0; i < k.numel(); ++i) {
    TORCH_CHECK(pk[i] >= 0, "sorted_unique_keys: key ", pk[i], " is negative");
    v[i] = static_cast<uint64_t>(pk[i]);
    hi = v[i] > hi ? v[i] : hi;
  }
  sort_unique(v, hi);
  auto out = torch::empty({static_cast<i64>(v.size())}, torch::kInt64);
  std::memcpy(out.data_ptr<i64>(), v.data(), v.size() * sizeof(i64));
  return out;
}

// reads stage on whole global batches: keys (in [0, num_rows)) read by samples `sample` assigned to
// ranks `rank_of` -> every rank's sorted unique keys concatenated, their counts [W], and the keys of
// `rank`'s samples in batch order
std::vector<torch::Tensor> reads_by_rank(torch::Tensor keys, torch::Tensor sample, torch::Tensor rank_of, i64 W,
                                         i64 num_rows, i64 rank) {
  const auto k = as_int64(keys, "reads_by_rank: keys");
  const auto s = as_int64(sample, "reads_by_rank: sample");
  const auto r = as_int64(rank_of, "reads_by_rank: rank_of");
  TORCH_CHECK(s.numel() == k.numel(), "reads_by_rank: ", k.numel(), " keys but ", s.numel(), " samples");
  TORCH_CHECK(W >= 1 && num_rows >= 1 && rank >= 0 && rank < W, "reads_by_rank: rank ", rank, " of ", W);
  const i64 n = k.numel(), G = r.numel();
  const i64 *pk = ptr<i64>(k), *ps = ptr<i64>(s), *pr = ptr<i64>(r);
  std::vector<uint64_t> both(n);
  std::vector<i64> mine;
  mine.reserve(n / W + 1);
  for (i64 i = 0; i < n; ++i) {
    TORCH_CHECK(pk[i] >= 0 && pk[i] < num_rows, "reads_by_rank: key ", pk[i], " outside [0, ", num_rows, ")");
    TORCH_CHECK(ps[i] >= 0 && ps[i] < G, "reads_by_rank: sample ", ps[i], " outside the ", G, " assigned");
    const i64 to = pr[ps[i]];
    TORCH_CHECK(to >= 0 && to < W, "reads_by_rank: sample ", ps[i], " assigned to rank ", to, " of ", W);
    both[i] = static_cast<uint64_t>(to) * num_rows + pk[i];  // by rank, then key
    if (to == rank) mine.push_back(pk[i]);
  }
  sort_unique(both, static_cast<uint64_t>(W) * num_rows - 1);
  auto reads = torch::empty({static_cast<i64>(both.size())}, torch::kInt64);
  auto counts = torch::zeros({W}, torch::kInt64);
  i64 *po = ptr<i64>(reads), *pc = ptr<i64>(counts);
  for (size_t i = 0; i < both.size(); ++i) {
    const i64 to = static_cast<i64>(both[i] / num_rows);
    ++pc[to];
    po[i] = static_cast<i64>(both[i]) - to * num_rows;
  }
  auto own = torch::empty({static_cast<i64>(mine.size())}, torch::kInt64);
  std::memcpy(own.data_ptr<i64>(), mine.data(), mine.size() * sizeof(i64));
  return {reads, counts, own};
}

// the samples `index` (in that order) of feature-major bags (lengths [F * G]) -> their lengths [F * k]
// and ids, in the input dtypes
template <class L, class V>
std::vector<torch::Tensor> select_bags_typed(const torch::Tensor& lengths, const torch::Tensor& values,
                                             const torch::Tensor& index, i64 G) {
  const i64 F = G ? lengths.numel() / G : 0, K = index.numel();
  const L* pl = lengths.data_ptr<L>();
  const V* pv = values.data_ptr<V>();
  const i64* pi = index.data_ptr<i64>();
  std::vector<i64> start(F * G + 1);
  start[0] = 0;
  for (i64 b = 0; b < F * G; ++b) {
    TORCH_CHECK(pl[b] >= 0, "select_bags: bag ", b, " has a negative length");
    start[b + 1] = start[b] + pl[b];
  }
  TORCH_CHECK(start[F * G] == values.numel(), "select_bags: bag lengths add up to ", start[F * G], " ids, there are ",
              values.numel());
  for (i64 j = 0; j < K; ++j) TORCH_CHECK(pi[j] >= 0 && pi[j] < G, "select_bags: sample ", pi[j], " of ", G);
  auto out_l = torch::empty({F * K}, lengths.options());
  L* ol = out_l.data_ptr<L>();
  i64 total = 0;
  for (i64 f = 0; f < F; ++f)
    for (i64 j = 0; j < K; ++j) total += (ol[f * K + j] = pl[f * G + pi[j]]);
  auto out_v = torch::empty({total}, values.options());
  V* ov = out_v.data_ptr<V>();
  for (i64 f = 0; f < F; ++f)
    for (i64 j = 0; j < K; ++j) {
      const i64 b = f * G + pi[j];
      const i64 len = start[b + 1] - start[b];
      std::memcpy(ov, pv + start[b], len * sizeof(V));
      ov += len;
    }
  return {out_l, out_v};
}

std::vector<torch::Tensor> select_bags(torch::Tensor lengths, torch::Tensor values, torch::Tensor index, i64 G) {
  TORCH_CHECK(lengths.dim() == 1 && values.dim() == 1 && index.dim() == 1, "select_bags: vectors expected");
  TORCH_CHECK(G > 0 ? lengths.numel() % G == 0 : lengths.numel() == 0, "select_bags: ", lengths.numel(),
              " lengths for batches of ", G);
  const auto l = lengths.contiguous(), v = values.contiguous(), i = index.to(torch::kInt64).contiguous();
  const bool l64 = l.scalar_type() == torch::kInt64, v64 = v.scalar_type() == torch::kInt64;
  TORCH_CHECK(l64 || l.scalar_type() == torch::kInt32, "select_bags: lengths must be int32 or int64");
  TORCH_CHECK(v64 || v.scalar_type() == torch::kInt32, "select_bags: values must be int32 or int64");
  if (l64) return v64 ? select_bags_typed<i64, i64>(l, v, i, G) : select_bags_typed<i64, int32_t>(l, v, i, G);
  return v64 ? select_bags_typed<int32_t, i64>(l, v, i, G) : select_bags_typed<int32_t, int32_t>(l, v, i, G);
}

}  // namespace

void register_batch_keys(pybind11::module& m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("batch_keys", &batch_keys, "a batch's global row keys, their samples and the count of ids outside their table",
        pybind11::arg("values"), pybind11::arg("lengths"), pybind11::arg("feature_offsets"),
        pybind11::arg("rows_per_feature"), pybind11::arg("batch_size"), nogil());
  m.def("sorted_unique_keys", &sorted_unique_keys, "torch.unique of non-negative keys (a radix sort)",
        pybind11::arg("keys"), nogil());
  m.def("reads_by_rank", &reads_by_rank, "every rank's sorted unique reads and this rank's keys, from an assignment",
        pybind11::arg("keys"), pybind11::arg("sample"), pybind11::arg("rank_of"), pybind11::arg("world_size"),
        pybind11::arg("num_rows"), pybind11::arg("rank"), nogil());
  m.def("select_bags", &select_bags, "the bags of samples `index` of feature-major KJT lengths and values",
        pybind11::arg("lengths"), pybind11::arg("values"), pybind11::arg("index"), pybind11::arg("batch_size"), nogil());
}
