// Herald's input allocator, compiled: the sequential room-limited greedy of
// pipeline/input_allocator.py's greedy_assign (its docstring states the rule), one sample at a time.
//
// The torch reference vectorises the same greedy by rounds (about twenty small tensor ops a global batch on
// the scheduler thread, which shares the rank's core with training); here it is one O(G log G + G*W) pass
// without the GIL. tests/test_input_allocator.py checks both against a one-by-one Python greedy.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

using i64 = int64_t;

// rank of each of the G samples ([G] int64): scores [G, W] integer local lookups, exactly G / W per rank
torch::Tensor greedy_assign(torch::Tensor scores, i64 step, bool home_ties, i64 move_penalty) {
  TORCH_CHECK(scores.dim() == 2 && scores.device().is_cpu(), "greedy_assign: scores must be a [G, W] CPU tensor");
  TORCH_CHECK(move_penalty >= 0, "greedy_assign: move_penalty must be >= 0, got ", move_penalty);
  const auto s64 = scores.to(torch::kInt64).contiguous();
  const i64 G = s64.size(0), W = s64.size(1);
  auto out = torch::empty({G}, torch::kInt64);
  if (G == 0) return out;
  TORCH_CHECK(W >= 1 && G % W == 0, "greedy_assign: ", G, " samples do not split over ", W, " ranks");
  const i64 B = G / W;
  const i64* s = s64.data_ptr<i64>();
  i64* placed = out.data_ptr<i64>();
  std::vector<i64> tie(W);  // W - 1 - pref: larger is more preferred among equal scores
  for (i64 r = 0; r < W; ++r) tie[r] = W - 1 - (((r - step) % W) + W) % W;
  // the home rank's score raised by the move penalty; priority = W * max - sum
  auto score = [&](i64 i, i64 r) { return s[i * W + r] + (r == i / B ? move_penalty : 0); };
  std::vector<i64> priority(G);
  for (i64 i = 0; i < G; ++i) {
    i64 top = score(i, 0), sum = 0;
    for (i64 r = 0; r < W; ++r) {
      const i64 v = score(i, r);
      top = std::max(top, v);
      sum += v;
    }
    priority[i] = W * top - sum;
  }
  std::vector<i64> order(G);
  std::iota(order.begin(), order.end(), i64{0});
  std::stable_sort(order.begin(), order.end(), [&](i64 a, i64 b) { return priority[a] > priority[b]; });
  std::vector<i64> room(W, B);
  for (const i64 i : order) {
    i64 best = -1, best_key = 0;
    for (i64 r = 0; r < W; ++r) {
      if (room[r] == 0) continue;
      const i64 key = home_ties ? score(i, r) * 2 * W + (r == i / B ? W : 0) + tie[r] : score(i, r) * W + tie[r];
      if (best < 0 || key > best_key) best = r, best_key = key;
    }
    placed[i] = best;
    --room[best];
  }
  return out;
}

}  // namespace

void register_greedy_assign(pybind11::module& m) {
  m.def("greedy_assign", &greedy_assign,
        "the input allocator's greedy: each sample, in priority order, to its most preferred rank with room",
        pybind11::arg("scores"), pybind11::arg("step"), pybind11::arg("home_ties"), pybind11::arg("move_penalty"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
