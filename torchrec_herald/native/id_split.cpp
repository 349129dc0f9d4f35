// Hot replication's per-step id bookkeeping in one pass over the batch's ids (CPU): each id checked against
// its table, split into a hot replica's row or a cold id bucketed to its row-wise owner, and the counts
// the input dist exchanges.
//
// The torch reference is ops/hot_cold.py (out_of_table, then split_hot_cold: a searchsorted over the hot
// keys and fbgemm's block_bucketize_sparse_features with a spare bucket for hot ids) plus the reductions
// of ShardedHeraldEmbeddingBagCollection.input_dist; tests compare the two output for output. Hand-written
// because the reference is about thirty small tensor ops a step on the training thread of a rank whose
// step is bound by its CPU. Ids on a GPU keep the torch path (no host round trip of the ids).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using i64 = int64_t;

// every tensor of ``tensors`` a contiguous 1-d CPU vector of ``type`` (else ``message``)
void check_vectors(std::initializer_list<const torch::Tensor*> tensors, torch::ScalarType type, const char* message) {
  for (const auto* t : tensors) {
    TORCH_CHECK(t->scalar_type() == type && t->is_contiguous() && t->dim() == 1 && t->device().is_cpu(), message);
  }
}

// (sub_lengths [W*F*B], hot_offsets [F*B + 1], bucketed_ids [N], bucketed_hot_rows [N],
//  per [2, W, F] (cold ids and non-empty sub-bags to each owner per feature), read [num_hot] (hot rows
//  read), any_bad (0-d bool))
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
hot_cold_split(torch::Tensor values, torch::Tensor lengths, torch::Tensor feature_table, torch::Tensor table_offsets,
               torch::Tensor hot_keys, torch::Tensor block_sizes, torch::Tensor rows_per_feature, i64 world,
               i64 batch) {
  check_vectors({&values, &lengths, &feature_table, &table_offsets, &hot_keys, &block_sizes, &rows_per_feature},
                torch::kInt64, "hot_cold_split: every input must be a contiguous 1-d int64 CPU tensor");
  const i64 F = feature_table.size(0), FB = lengths.size(0), N = values.size(0), H = hot_keys.size(0);
  TORCH_CHECK(world >= 1 && batch >= 1 && FB == F * batch, "hot_cold_split: ", FB, " lengths for ", F,
              " features of batch ", batch);
  TORCH_CHECK(block_sizes.size(0) == F && rows_per_feature.size(0) == F, "hot_cold_split: one block size and "
              "one row count per feature");
  const i64* v = values.data_ptr<i64>();
  const i64* len = lengths.data_ptr<i64>();
  const i64* ft = feature_table.data_ptr<i64>();
  const i64* toff = table_offsets.data_ptr<i64>();
  const i64* hot = hot_keys.data_ptr<i64>();
  const i64* blk = block_sizes.data_ptr<i64>();
  const i64* rows = rows_per_feature.data_ptr<i64>();
  for (i64 f = 0; f < F; ++f) {
    TORCH_CHECK(blk[f] >= 1, "hot_cold_split: feature ", f, " has block size ", blk[f]);
    TORCH_CHECK(ft[f] >= 0 && ft[f] < table_offsets.size(0), "hot_cold_split: feature ", f, " names table ", ft[f]);
  }
  const i64 buckets = world + 1;  // the owners, then a spare bucket for hot ids
  auto counts = torch::zeros({buckets * FB}, torch::kInt64);
  i64* cnt = counts.data_ptr<i64>();
  std::vector<i64> bucket(N), new_id(N), row_or_spare(N), bag_of(N);
  auto read = torch::zeros({H}, torch::kBool);
  bool* rd = read.data_ptr<bool>();
  bool any_bad = false;
  i64 i = 0;
  for (i64 b = 0; b < FB; ++b) {
    const i64 f = b / batch, block = blk[f], limit = rows[f], first = toff[ft[f]];
    TORCH_CHECK(len[b] >= 0 && i + len[b] <= N, "hot_cold_split: lengths add up to more than the ", N, " values");
    for (i64 j = 0; j < len[b]; ++j, ++i) {
      i64 id = v[i];
      if (id < 0 || id >= limit) {  // read as row 0 until every rank raises it at the first wait
        any_bad = true;
        id = 0;
      }
      const i64 key = first + id;
      i64 p, nid, ros = H;
      const i64* at = H ? std::lower_bound(hot, hot + H, key) : hot;
      if (H && at != hot + H && *at == key) {  // a hot replica: the spare bucket (block_bucketize of W * block)
        p = world;
        nid = 0;
        ros = at - hot;
        rd[ros] = true;
      } else if (id < block * buckets) {  // block_bucketize_sparse_features' rule, my_size = W + 1
        p = id / block;
        nid = id % block;
      } else {
        p = id % buckets;
        nid = id / buckets;
      }
      bucket[i] = p;
      new_id[i] = nid;
      row_or_spare[i] = ros;
      bag_of[i] = b;
      ++cnt[p * FB + b];
    }
  }
  TORCH_CHECK(i == N, "hot_cold_split: lengths add up to ", i, ", not the ", N, " values");
  // each (bucket, bag)'s first position in the output: (bucket, bag) order, each bag's ids in their order
  std::vector<i64> cursor(buckets * FB);
  i64 at = 0;
  for (i64 k = 0; k < buckets * FB; ++k) {
    cursor[k] = at;
    at += cnt[k];
  }
  auto bucketed_ids = torch::empty({N}, torch::kInt64);
  auto bucketed_hot_rows = torch::empty({N}, torch::kInt64);
  i64* ids_out = bucketed_ids.data_ptr<i64>();
  i64* rows_out = bucketed_hot_rows.data_ptr<i64>();
  for (i64 k = 0; k < N; ++k) {
    const i64 to = cursor[bucket[k] * FB + bag_of[k]]++;
    ids_out[to] = new_id[k];
    rows_out[to] = row_or_spare[k];
  }
  auto hot_offsets = torch::zeros({FB + 1}, torch::kInt64);
  i64* ho = hot_offsets.data_ptr<i64>();
  for (i64 b = 0; b < FB; ++b) ho[b + 1] = ho[b] + cnt[world * FB + b];
  auto per = torch::zeros({2, world, F}, torch::kInt64);
  i64* pr = per.data_ptr<i64>();
  for (i64 o = 0; o < world; ++o) {
    for (i64 b = 0; b < FB; ++b) {
      const i64 c = cnt[o * FB + b], f = b / batch;
      pr[o * F + f] += c;
      pr[world * F + o * F + f] += c > 0;
    }
  }
  auto sub_lengths = counts.narrow(0, 0, world * FB);
  return {sub_lengths, hot_offsets, bucketed_ids, bucketed_hot_rows, per, read, torch::tensor(any_bad)};
}

// At the input dist's first wait, with the sizes on the host: (hot_unique, hot_inverse, sparse_idx,
// send_bag_index, packed) of ShardedHeraldEmbeddingBagCollection._sized_by_host: the hot rows read and each
// hot id's place among them, the sparsely synced rows' places, each non-empty sub-bag's bag, and for each
// owner o in turn its non-empty sub-bags' lengths then its cold ids' rows of o's block (int32).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> hot_cold_message(
    torch::Tensor read, torch::Tensor read_sparse, torch::Tensor sub_lengths, torch::Tensor bucketed_ids,
    torch::Tensor bucketed_hot_rows, torch::Tensor owner_feature_offsets, i64 world, i64 features, i64 batch) {
  check_vectors({&read, &read_sparse}, torch::kBool, "hot_cold_message: the masks must be contiguous 1-d bool CPU tensors");
  check_vectors({&sub_lengths, &bucketed_ids, &bucketed_hot_rows, &owner_feature_offsets}, torch::kInt64,
                "hot_cold_message: every index input must be a contiguous 1-d int64 CPU tensor");
  const i64 FB = features * batch, H = read.size(0), N = bucketed_ids.size(0);
  TORCH_CHECK(sub_lengths.size(0) == world * FB && owner_feature_offsets.size(0) == world * features &&
                  read_sparse.size(0) >= H && bucketed_hot_rows.size(0) == N,
              "hot_cold_message: sizes do not match ", world, " owners x ", features, " features x batch ", batch);
  const bool* rd = read.data_ptr<bool>();
  const bool* rs = read_sparse.data_ptr<bool>();
  const i64* sub = sub_lengths.data_ptr<i64>();
  const i64* ids = bucketed_ids.data_ptr<i64>();
  const i64* hot_rows = bucketed_hot_rows.data_ptr<i64>();
  const i64* ofo = owner_feature_offsets.data_ptr<i64>();
  std::vector<i64> rank_of(H, -1), unique;
  for (i64 h = 0; h < H; ++h) {
    if (rd[h]) {
      rank_of[h] = static_cast<i64>(unique.size());
      unique.push_back(h);
    }
  }
  std::vector<i64> sparse;
  for (i64 h = 0; h < H; ++h) {
    if (rs[h]) sparse.push_back(rank_of[h]);
  }
  std::vector<i64> bag_index;
  std::vector<int32_t> packed;
  packed.reserve(world * FB + N);
  i64 n_cold = 0;
  for (i64 o = 0; o < world; ++o) {
    i64 ids_of_o = 0;
    for (i64 b = 0; b < FB; ++b) {
      const i64 len = sub[o * FB + b];
      if (len > 0) {
        bag_index.push_back(b);
        packed.push_back(static_cast<int32_t>(len));
        ids_of_o += len;
      }
    }
    i64 at = n_cold;
    for (i64 b = 0; b < FB; ++b) {
      const i64 off = ofo[o * features + b / batch];
      for (i64 j = 0; j < sub[o * FB + b]; ++j, ++at) {
        TORCH_CHECK(at < N, "hot_cold_message: the sub-bags hold more ids than the ", N, " bucketed");
        packed.push_back(static_cast<int32_t>(off + ids[at]));
      }
    }
    n_cold += ids_of_o;
  }
  std::vector<i64> inverse;
  inverse.reserve(N - n_cold);
  for (i64 k = n_cold; k < N; ++k) {
    const i64 r = hot_rows[k];
    TORCH_CHECK(r >= 0 && r < H && rank_of[r] >= 0, "hot_cold_message: hot id ", k, " names row ", r,
                " that the batch's read mask does not hold");
    inverse.push_back(rank_of[r]);
  }
  auto to_tensor = [](const auto& v, torch::ScalarType type) {
    auto t = torch::empty({static_cast<i64>(v.size())}, type);
    std::copy(v.begin(), v.end(), static_cast<typename std::decay_t<decltype(v)>::value_type*>(t.data_ptr()));
    return t;
  };
  return {to_tensor(unique, torch::kInt64), to_tensor(inverse, torch::kInt64), to_tensor(sparse, torch::kInt64),
          to_tensor(bag_index, torch::kInt64), to_tensor(packed, torch::kInt32)};
}

}  // namespace

void register_id_split(pybind11::module& m) {
  m.def("hot_cold_message", &hot_cold_message,
        "the input dist's data-sized part on the host: (hot rows read, each hot id's place among them, the "
        "sparsely synced rows' places, each non-empty sub-bag's bag, the packed int32 message per owner)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("hot_cold_split", &hot_cold_split,
        "hot replication's id bookkeeping in one pass: (sub_lengths, hot_offsets, bucketed_ids, bucketed_hot_rows, "
        "per-(owner, feature) cold ids and non-empty sub-bags, hot rows read, any id outside its table)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
