// A key-scored decode step's settle as one mlx primitive on the CPU (an experiment, see check.py).
//
// h2o_fn.core._by_key with alive=None: scores <- decay * scores + w, then in every row holding
// more than `budget` tokens the lowest (score, position) token that is neither a sink
// (p < n_sink) nor in the grace window (p > seen - 1 - grace) is freed (score 0, position -1).
// NaN orders as -inf, as in h2o_fn.rule. Shapes: scores, positions, w [B, H, C]; length, seen [B].
// Built with -ffp-contract=off so that decay * s + w rounds twice, as mlx's two ops do.
#include <array>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
using namespace mlx::core;

class H2OSettle : public Primitive {
 public:
  H2OSettle(Stream s, float decay, int n_sink, int grace, int budget)
      : Primitive(s), decay_(decay), n_sink_(n_sink), grace_(grace), budget_(budget) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& out) override {
    const array &scores = in[0], &pos = in[1], &length = in[2], &seen = in[3], &w = in[4];
    for (auto& o : out) o.set_data(allocator::malloc(o.nbytes()));
    auto& enc = cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    for (auto& o : out) enc.set_output_array(o);
    int B = scores.shape(0), H = scores.shape(1), C = scores.shape(2);
    auto strides = [](const array& a) { return std::array<int64_t, 3>{a.strides(0), a.strides(1), a.strides(2)}; };
    auto S = strides(scores), P = strides(pos), W = strides(w);
    int64_t LS = length.strides(0), SS = seen.strides(0);
    // the task runs after eval_cpu returns, when this primitive may be gone: copy what it reads
    enc.dispatch([B, H, C, S, P, W, LS, SS, decay = decay_, n_sink = n_sink_, grace = grace_, budget = budget_,
                  sc = array::unsafe_weak_copy(scores), ps = array::unsafe_weak_copy(pos),
                  ln = array::unsafe_weak_copy(length), se = array::unsafe_weak_copy(seen),
                  wa = array::unsafe_weak_copy(w), o0 = array::unsafe_weak_copy(out[0]),
                  o1 = array::unsafe_weak_copy(out[1]), o2 = array::unsafe_weak_copy(out[2])]() mutable {
      const float* s = sc.data<float>();
      const int32_t* p = ps.data<int32_t>();
      const int32_t* len = ln.data<int32_t>();
      const int32_t* sn = se.data<int32_t>();
      const float* wp = wa.data<float>();
      float* so = o0.data<float>();
      int32_t* po = o1.data<int32_t>();
      int32_t* lo = o2.data<int32_t>();
      const float inf = std::numeric_limits<float>::infinity();
      auto rank = [&](int q, float v, int newest) {  // h2o_fn.rule._lowest_scores' key
        bool evictable = q >= n_sink && q <= newest - grace;
        return evictable ? (std::isnan(v) ? -inf : v) : inf;
      };
      for (int b = 0; b < B; ++b) {
        bool over = len[b * LS] > budget;
        lo[b] = len[b * LS] - (over ? 1 : 0);
        int newest = sn[b * SS] - 1;
        for (int h = 0; h < H; ++h) {
          size_t o = (static_cast<size_t>(b) * H + h) * C;
          float lowest = inf;
          for (int c = 0; c < C; ++c) {
            float decayed = decay * s[b * S[0] + h * S[1] + c * S[2]];
            so[o + c] = decayed + wp[b * W[0] + h * W[1] + c * W[2]];
            po[o + c] = p[b * P[0] + h * P[1] + c * P[2]];
            lowest = std::min(lowest, rank(po[o + c], so[o + c], newest));
          }
          if (!over) continue;
          int victim = -1, first = std::numeric_limits<int>::max();
          for (int c = 0; c < C; ++c) {
            int q = po[o + c];
            bool evictable = q >= n_sink && q <= newest - grace;
            if (evictable && rank(q, so[o + c], newest) == lowest && q < first) {
              first = q;
              victim = c;
            }
          }
          if (victim >= 0) {
            so[o + victim] = 0.0f;
            po[o + victim] = -1;
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("H2OSettle runs on the CPU only");
  }

  const char* name() const override { return "H2OSettle"; }

 private:
  float decay_;
  int n_sink_, grace_, budget_;
};

std::vector<array> settle(const array& scores, const array& positions, const array& length, const array& seen,
                          const array& w, float decay, int n_sink, int grace, int budget) {
  if (scores.ndim() != 3 || positions.shape() != scores.shape() || w.shape() != scores.shape() ||
      length.ndim() != 1 || seen.ndim() != 1 || length.shape(0) != scores.shape(0) ||
      seen.shape(0) != scores.shape(0))
    throw std::invalid_argument("settle: expected scores, positions, w [B, H, C] and length, seen [B]");
  if (scores.dtype() != float32 || w.dtype() != float32 || positions.dtype() != int32 ||
      length.dtype() != int32 || seen.dtype() != int32)
    throw std::invalid_argument("settle: expected float32 scores and w, int32 positions, length and seen");
  return array::make_arrays({scores.shape(), positions.shape(), length.shape()}, {float32, int32, int32},
                            std::make_shared<H2OSettle>(default_stream(Device::cpu), decay, n_sink, grace, budget),
                            {scores, positions, length, seen, w});
}

NB_MODULE(_h2o_settle, m) {
  nb::module_::import_("mlx.core");
  m.def("settle", &settle, "(scores', positions', length') after decay-add and one eviction per row over budget");
}
