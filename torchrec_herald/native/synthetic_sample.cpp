// The synthetic data's inverse-CDF sampling, compiled: for each table f and draw u, the row
// perm_f[min(upper_bound(cdf_f, u), n_f - 1)], and the draws' label effects added table by table.
//
// torch.searchsorted answers the same upper bounds, but its branchy binary search mispredicts about once
// a level on random draws (~0.5 ms a global batch of 512, 40 % of a scheduling rank's batch reading); the
// search below (common.h lockstep_bounds) has no data-dependent branch. data/synthetic.py runs the torch
// ops where this is not built, and tests/test_data_synthetic.py checks both give the same batches bit for
// bit.

#include <torch/extension.h>

#include "common.h"

#include <cstdint>

namespace {

using i64 = int64_t;

// rows [T, G] int64, numbered across the concatenated tables: u [T, G] float64 draws in [0, 1);
// cdfs: the tables' CDFs (non-decreasing) concatenated, offsets [T + 1] their bounds; perm: the
// per-table permutations concatenated (each in its table's own row numbers)
torch::Tensor inverse_cdf_rows(torch::Tensor u, torch::Tensor cdfs, torch::Tensor offsets, torch::Tensor perm) {
  TORCH_CHECK(u.dim() == 2 && u.scalar_type() == torch::kFloat64, "inverse_cdf_rows: u must be [T, G] float64");
  TORCH_CHECK(cdfs.dim() == 1 && cdfs.scalar_type() == torch::kFloat64 && cdfs.is_contiguous(),
              "inverse_cdf_rows: cdfs must be a contiguous float64 vector");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == torch::kInt64 && offsets.size(0) == u.size(0) + 1,
              "inverse_cdf_rows: offsets must be [T + 1] int64");
  TORCH_CHECK(perm.scalar_type() == torch::kInt64 && perm.is_contiguous() && perm.numel() == cdfs.numel(),
              "inverse_cdf_rows: perm must be a contiguous int64 vector as long as cdfs");
  const auto uc = u.contiguous();
  const i64 T = uc.size(0), G = uc.size(1);
  auto out = torch::empty({T, G}, torch::kInt64);
  const double* du = uc.data_ptr<double>();
  const double* c = cdfs.data_ptr<double>();
  const i64* off = offsets.data_ptr<i64>();
  const i64* p = perm.data_ptr<i64>();
  i64* o = out.data_ptr<i64>();
  for (i64 f = 0; f < T; ++f) {
    const double* table = c + off[f];
    const i64 n = off[f + 1] - off[f];
    TORCH_CHECK(n >= 1, "inverse_cdf_rows: table ", f, " has no rows");
    // the draws' upper bounds (entries <= u), then the row: clamped to the last (the CDF may end below 1)
    i64* rows = o + f * G;
    herald::lockstep_bounds(table, n, du + f * G, G, rows, [](double e, double x) { return e <= x; });
    for (i64 s = 0; s < G; ++s) rows[s] = off[f] + p[off[f] + (rows[s] < n ? rows[s] : n - 1)];
  }
  return out;
}

// logits [G] float32 += effects[rows[f]] (* present[f]) for f = 0 .. T - 1, in that order: the same
// float32 additions as one torch add per table
void add_row_effects_(torch::Tensor logits, torch::Tensor effects, torch::Tensor rows, torch::Tensor present) {
  TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "add_row_effects_: logits must be a contiguous float32 vector");
  TORCH_CHECK(effects.scalar_type() == torch::kFloat32 && effects.is_contiguous(),
              "add_row_effects_: effects must be a contiguous float32 vector");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kInt64 && rows.size(1) == logits.size(0),
              "add_row_effects_: rows must be [T, G] int64");
  const bool masked = present.numel() > 0;
  TORCH_CHECK(!masked || (present.scalar_type() == torch::kBool && present.sizes() == rows.sizes()),
              "add_row_effects_: present must be empty or a [T, G] bool tensor");
  const auto rc = rows.contiguous();
  const auto pc = masked ? present.contiguous() : present;
  const i64 T = rc.size(0), G = rc.size(1), n = effects.numel();
  float* l = logits.data_ptr<float>();
  const float* e = effects.data_ptr<float>();
  const i64* r = rc.data_ptr<i64>();
  const bool* m = masked ? pc.data_ptr<bool>() : nullptr;
  for (i64 f = 0; f < T; ++f) {
    for (i64 s = 0; s < G; ++s) {
      const i64 row = r[f * G + s];
      TORCH_CHECK(row >= 0 && row < n, "add_row_effects_: row ", row, " out of range");
      const float v = e[row];
      l[s] += masked ? v * static_cast<float>(m[f * G + s]) : v;
    }
  }
}

}  // namespace

void register_synthetic_sample(pybind11::module& m) {
  m.def("inverse_cdf_rows", &inverse_cdf_rows, "the synthetic data's inverse-CDF rows of every table at once",
        pybind11::arg("u"), pybind11::arg("cdfs"), pybind11::arg("offsets"), pybind11::arg("perm"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_row_effects_", &add_row_effects_, "the draws' label effects added to the logits, table by table",
        pybind11::arg("logits"), pybind11::arg("effects"), pybind11::arg("rows"), pybind11::arg("present"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
