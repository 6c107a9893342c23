// Decode tokens as mlx primitives on the CPU (h2o_fn.metal_ops.cpu_step builds it).
//
// What h2o_fn.core.admit then h2o_fn.core.settle_key do for one token with every batch row
// taking it (alive=None) and rows stored dense, per (b, h):
//   1. admit: the token's key and value rows (cast to the store's dtype) go into the first free
//      slot (position -1; slot 0 when none is, as mx.argmax gives), at position seen[b];
//      length and seen grow by one;
//   2. weights: softmax over the slots holding a token other than the new one of
//      K_j . (k * scale), in float32 (k as given, K as stored); 0 elsewhere, 0 when none is;
//   3. settle: scores <- decay * scores + w (two roundings: built with -ffp-contract=off), then a
//      row holding more than `budget` tokens frees its lowest (score, position) token that is
//      neither a sink (p < n_sink) nor in the grace window (p > newest - grace); NaN as -inf.
// Primitives: the keys' row write, the settle (2 and 3, reading the written keys), the values'
// row write. Each write is in place when mlx can donate the store (nothing else holds it), else a
// copy. The evicted token's rows stay where they are: this token's decode view (the first span
// slots) is the admitted state's.
// A query-scored decode token: the two row writes and H2OAdmitCounts (core.admit), H2OAttend (the
// hook's attention of one query per head with its weights averaged per KV head) and
// H2OWeightSettle (core.settle).
// Shapes: keys [B, H, C, Dk], values [B, H, C, Dv], scores and positions [B, H, C], length and
// seen [B], key [B, H, 1, Dk], value [B, H, 1, Dv].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
using namespace mlx::core;

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc);  // mlx's BLAS

namespace {

struct Knobs {
  float decay, scale;
  int n_sink, grace, budget;
  int span = 0;  // the key step: slots of the view the proxy's product covers (the rest score 0 logits)
};

float load(const array& a, int64_t i) {
  switch (a.dtype()) {
    case float16: return static_cast<float>(a.data<float16_t>()[i]);
    case bfloat16: return static_cast<float>(a.data<bfloat16_t>()[i]);
    default: return a.data<float>()[i];
  }
}

int64_t at(const array& a, int64_t i0, int64_t i1, int64_t i2, int64_t i3 = 0) {
  int64_t o = i0 * a.strides(0) + i1 * a.strides(1) + i2 * a.strides(2);
  return a.ndim() > 3 ? o + i3 * a.strides(3) : o;
}

// out: a row-contiguous copy of `in`
template <typename T>
void copy_store(const array& in, array& out) {
  const T* src = in.data<T>();
  T* dst = out.data<T>();
  if (in.flags().row_contiguous) {  // a store still held elsewhere (a shared prompt cache entry)
    std::memcpy(dst, src, in.nbytes());
    return;
  }
  int B = in.shape(0), H = in.shape(1), C = in.shape(2), D = in.shape(3);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < C; ++c) {
        T* row = dst + ((static_cast<int64_t>(b) * H + h) * C + c) * D;
        for (int d = 0; d < D; ++d) row[d] = src[at(in, b, h, c, d)];
      }
}

template <typename T>
void put_row(array& store, const array& row, int b, int h, int c) {
  int H = store.shape(1), C = store.shape(2), D = store.shape(3);
  T* dst = store.data<T>() + ((static_cast<int64_t>(b) * H + h) * C + c) * D;
  for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(load(row, at(row, b, h, 0, d)));
}

void store_copy(const array& in, array& out) {
  switch (in.dtype()) {
    case uint32: return copy_store<uint32_t>(in, out);
    case float16: return copy_store<float16_t>(in, out);
    case bfloat16: return copy_store<bfloat16_t>(in, out);
    default: return copy_store<float>(in, out);
  }
}

void store_row(array& store, const array& row, int b, int h, int c) {
  switch (store.dtype()) {
    case uint32: {  // mx.quantize's packed codes, as they are
      int H = store.shape(1), C = store.shape(2), D = store.shape(3);
      uint32_t* dst = store.data<uint32_t>() + ((static_cast<int64_t>(b) * H + h) * C + c) * D;
      for (int d = 0; d < D; ++d) dst[d] = row.data<uint32_t>()[at(row, b, h, 0, d)];
      return;
    }
    case float16: return put_row<float16_t>(store, row, b, h, c);
    case bfloat16: return put_row<bfloat16_t>(store, row, b, h, c);
    default: return put_row<float>(store, row, b, h, c);
  }
}

// n half-precision values as float32 (exact, however computed): F16C's 8 at a time where the
// CPU has it (asked at run time), bfloat16 as its bits moved up
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void widen_f16c(const float16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

void widen(const float16_t* src, float* dst, int64_t n) {
#if defined(__x86_64__)
  static const bool f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  if (f16c) return widen_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void widen(const bfloat16_t* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &wide, sizeof(float));
  }
}

// w[c] <- exp(w[c] - top) as mlx's softmax computes it (simd::exp, one lane on x86), returning
// their sum in order
float exp_sum_of(float* w, int C, float top) {
  float sum = 0.0f;
  for (int c = 0; c < C; ++c) {
    w[c] = simd::exp(simd::Simd<float, 1>(w[c] - top)).value;
    sum += w[c];
  }
  return sum;
}

#if defined(__x86_64__)
// simd::exp<float, 1> operation for operation (Cephes' polynomial by fma, 2^n from the exponent
// bits, NaN, > 88 and < -88 as it selects them), compiled where the CPU has FMA (asked at run
// time) so that its fma and floor are instructions instead of libm calls; both are exactly
// rounded, so every float gives the same bits (checked over all 2^32 inputs)
__attribute__((target("fma,sse4.1"))) inline float exp_fma(float in) {
  float x = in * 1.442695f;
  float ipart = static_cast<float>(std::floor(x + 0.5));  // the header adds a double 0.5
  float fpart = x - ipart;
  float y = 1.535336188319500e-4f;
  y = std::fma(y, fpart, 1.339887440266574e-3f);
  y = std::fma(y, fpart, 9.618437357674640e-3f);
  y = std::fma(y, fpart, 5.550332471162809e-2f);
  y = std::fma(y, fpart, 2.402264791363012e-1f);
  y = std::fma(y, fpart, 6.931472028550421e-1f);
  y = std::fma(y, fpart, 1.000000000000000f);
  int32_t bits = (static_cast<int32_t>(ipart) + 127) << 23;
  float two;
  std::memcpy(&two, &bits, sizeof two);
  float r = std::isnan(in) ? in : two * y;
  r = in > 88.0f ? std::numeric_limits<float>::infinity() : r;
  return in < -88.0f ? 0.0f : r;
}

__attribute__((target("fma,sse4.1"))) float exp_sum_fma(float* w, int C, float top) {
  float sum = 0.0f;
  for (int c = 0; c < C; ++c) {
    w[c] = exp_fma(w[c] - top);
    sum += w[c];
  }
  return sum;
}
#endif

float exp_sum(float* w, int C, float top) {
#if defined(__x86_64__)
  static const bool fma = __builtin_cpu_supports("fma") && __builtin_cpu_supports("sse4.1");
  if (fma) return exp_sum_fma(w, C, top);
#endif
  return exp_sum_of(w, C, top);
}

inline float exp_nonpositive(float x);
void exp_shifted(float* x, int64_t n, float top);

// h2o_fn.scoring.proxy_softmax of one row of logits w [C] in place: the slots holding no token or the
// newest one at -inf, a softmax (mlx's own with `mlx`, as h2o_fn.softmax.ranking_softmax takes up to
// MLX_UP_TO elements; else h2o_fn.softmax's: exp_nonpositive, divided by the sum), NaN as 0
void visible_softmax(float* w, const int32_t* pos, int32_t newest, int C, bool mlx) {
  const float inf = std::numeric_limits<float>::infinity();
  float top = -inf;
  for (int c = 0; c < C; ++c) {
    if (pos[c] < 0 || pos[c] == newest) w[c] = -inf;
    top = std::max(top, w[c]);  // as simd::maximum: NaN in w does not propagate
  }
  if (mlx) {
    float inv = 1 / exp_sum(w, C, top);
    for (int c = 0; c < C; ++c) w[c] *= inv;
  } else {
    exp_shifted(w, C, top);
    float sum = 0.0f;
    for (int c = 0; c < C; ++c) sum += w[c];
    for (int c = 0; c < C; ++c) w[c] /= sum;
  }
  for (int c = 0; c < C; ++c)
    if (std::isnan(w[c])) w[c] = 0.0f;  // mx.nan_to_num: no visible slot, or NaN keys
}

// the key proxy's weights of row (b, h) into w [C], as h2o_fn.scoring.proxy_weights computes them
// with mx.softmax (up to h2o_fn.softmax.MLX_UP_TO elements): the keys as float32, their product with
// q over the first N slots (the decode view's, as the attention hook multiplies them; 0 beyond, as
// view.decode_weights pads) by the cblas_sgemm call mlx's matmul makes, then mlx's CPU softmax
// (simd::exp, one lane on x86)
template <typename T>
void proxy_of(const array& keys, const std::vector<float>& q, const int32_t* pos, int32_t newest, int b, int h,
              int N, std::vector<float>& kf, std::vector<float>& w) {
  int H = keys.shape(1), C = keys.shape(2), D = keys.shape(3);
  const T* rows = keys.data<T>() + (static_cast<int64_t>(b) * H + h) * C * D;
  const float* k32 = reinterpret_cast<const float*>(rows);
  if constexpr (!std::is_same_v<T, float>) {
    if (kf.size() < static_cast<size_t>(N) * D) kf.resize(static_cast<size_t>(N) * D);
    widen(rows, kf.data(), static_cast<int64_t>(N) * D);
    k32 = kf.data();
  }
  if (N > 0) cblas_sgemm(101, 111, 112, 1, N, D, 1.0f, q.data(), D, k32, D, 0.0f, w.data(), C);  // row-major, q . K^T
  std::fill(w.begin() + N, w.end(), 0.0f);
  visible_softmax(w.data(), pos, newest, C, true);
}

void proxy(const array& keys, const std::vector<float>& q, const int32_t* pos, int32_t newest, int b, int h, int N,
           std::vector<float>& kf, std::vector<float>& w) {
  switch (keys.dtype()) {
    case float16: return proxy_of<float16_t>(keys, q, pos, newest, b, h, N, kf, w);
    case bfloat16: return proxy_of<bfloat16_t>(keys, q, pos, newest, b, h, N, kf, w);
    default: return proxy_of<float>(keys, q, pos, newest, b, h, N, kf, w);
  }
}

int first_free(const array& pos, int b, int h) {  // mx.argmax(positions == -1): slot 0 when none is free
  const int32_t* p = pos.data<int32_t>() + at(pos, b, h, 0);
  int64_t step = pos.strides(2);
  for (int c = 0, C = pos.shape(2); c < C; ++c)
    if (p[c * step] == -1) return c;
  return 0;
}

// store' = store with each (b, h)'s row written into its first free slot
void write_rows(const array& store, const array& pos, const array& row, array& out, bool copy) {
  if (copy) store_copy(store, out);
  if (out.shape(3) == 0) return;
  for (int b = 0; b < out.shape(0); ++b)
    for (int h = 0; h < out.shape(1); ++h) store_row(out, row, b, h, first_free(pos, b, h));
}

// h2o_fn.rule.evict for one (b, h) row over budget: its lowest (score, position) token that is
// neither a sink (p < n_sink) nor in the grace window (p > newest - grace) freed; NaN as -inf
void evict_one(float* sr, int32_t* pr, int C, int32_t newest, Knobs kn) {
  const float inf = std::numeric_limits<float>::infinity();
  int victim = -1;
  float low = inf;
  for (int c = 0; c < C; ++c) {
    if (pr[c] < kn.n_sink || pr[c] > newest - kn.grace) continue;
    float v = std::isnan(sr[c]) ? -inf : sr[c];
    if (victim < 0 || v < low || (v == low && pr[c] < pr[victim])) {
      victim = c;
      low = v;
    }
  }
  if (victim >= 0) {
    sr[victim] = 0.0f;
    pr[victim] = -1;
  }
}

struct Io {
  array keys, scores, pos, length, seen, key;  // inputs: keys already hold the new rows
  array s_out, p_out, l_out, n_out;  // outputs
};

void settle(Io& io, Knobs kn) {
  int B = io.scores.shape(0), H = io.scores.shape(1), C = io.scores.shape(2), Dk = io.key.shape(3);
  const float* s = io.scores.data<float>();
  const int32_t* p = io.pos.data<int32_t>();
  const int32_t* len = io.length.data<int32_t>();
  const int32_t* seen = io.seen.data<int32_t>();
  float* so = io.s_out.data<float>();
  int32_t* po = io.p_out.data<int32_t>();
  std::vector<float> q(Dk), w(C);
  static thread_local std::vector<float> kf;  // half-precision keys as float32: memory kept between calls (`attend`)
  for (int b = 0; b < B; ++b) {
    int32_t length = len[b * io.length.strides(0)] + 1, newest = seen[b * io.seen.strides(0)];
    bool over = length > kn.budget;
    io.l_out.data<int32_t>()[b] = over ? length - 1 : length;
    io.n_out.data<int32_t>()[b] = newest + 1;
    for (int h = 0; h < H; ++h) {
      int32_t* pr = po + (static_cast<int64_t>(b) * H + h) * C;
      float* sr = so + (static_cast<int64_t>(b) * H + h) * C;
      const int32_t* pin = p + at(io.pos, b, h, 0);
      const float* sin = s + at(io.scores, b, h, 0);
      int64_t ps = io.pos.strides(2), ss = io.scores.strides(2);
      for (int c = 0; c < C; ++c) pr[c] = pin[c * ps];
      pr[first_free(io.pos, b, h)] = newest;
      for (int d = 0; d < Dk; ++d) q[d] = load(io.key, at(io.key, b, h, 0, d)) * kn.scale;
      proxy(io.keys, q, pr, newest, b, h, std::min(kn.span, C), kf, w);
      for (int c = 0; c < C; ++c) {
        float decayed = kn.decay * sin[c * ss];
        sr[c] = decayed + w[c];
      }
      if (over) evict_one(sr, pr, C, newest, kn);
    }
  }
}

array weak(const array& a) {  // for a task that runs after eval_cpu returns, when the primitive may be gone
  return array::unsafe_weak_copy(a);
}

void encode(Stream s, const std::vector<array>& in, std::vector<array>& out) {
  auto& enc = cpu::get_command_encoder(s);
  for (auto& a : in) enc.set_input_array(a);
  for (auto& o : out) enc.set_output_array(o);
}

// A store with one row per (b, h) written into its first free slot: in place when nothing else
// holds the store (one output, so mlx can donate its input), else into a copy.
class H2OWriteRow : public Primitive {
 public:
  explicit H2OWriteRow(Stream s) : Primitive(s) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& out) override {
    bool copy = !(in[0].is_donatable() && in[0].flags().row_contiguous);
    if (copy) out[0].set_data(allocator::malloc(out[0].nbytes()));
    else out[0].copy_shared_buffer(in[0]);
    encode(stream(), in, out);
    cpu::get_command_encoder(stream()).dispatch(
        [st = weak(in[0]), ps = weak(in[1]), rw = weak(in[2]), o = weak(out[0]), copy]() mutable {
          write_rows(st, ps, rw, o, copy);
        });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("H2OWriteRow runs on the CPU only");
  }

  const char* name() const override { return "H2OWriteRow"; }
};

// The admitted token's positions, counts and scores: its key's proxy weights decay-added, then
// one eviction in each row over budget.
class H2OKeySettle : public Primitive {
 public:
  H2OKeySettle(Stream s, Knobs knobs) : Primitive(s), knobs_(knobs) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& out) override {
    for (auto& o : out) o.set_data(allocator::malloc(o.nbytes()));
    encode(stream(), in, out);
    Io io{weak(in[0]), weak(in[1]), weak(in[2]), weak(in[3]), weak(in[4]), weak(in[5]),
          weak(out[0]), weak(out[1]), weak(out[2]), weak(out[3])};
    cpu::get_command_encoder(stream()).dispatch([io = std::move(io), kn = knobs_]() mutable { settle(io, kn); });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("H2OKeySettle runs on the CPU only");
  }

  const char* name() const override { return "H2OKeySettle"; }

 private:
  Knobs knobs_;
};

// h2o_fn.core.settle with every batch row taking the token: an admitted state's scores decay-add
// its weights (NaN, +-inf and negative ones as 0; only slots holding a token keep a score), then
// one eviction in each row over budget. Inputs: scores, positions [B, H, C], length, seen [B],
// weights [B, H, C] float32; outputs: scores', positions', length'.
// With `logits` (1: mlx's softmax, 2: h2o_fn.softmax's) the last input is the key proxy's logits
// [B, H, 1, span] over the first span slots instead, settled as core.settle_key takes them (alive
// None): their `visible_softmax` over the slots (0 logits beyond span), scores <- decay * scores + w.
class H2OWeightSettle : public Primitive {
 public:
  H2OWeightSettle(Stream s, Knobs knobs, int logits) : Primitive(s), knobs_(knobs), logits_(logits) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& out) override {
    for (auto& o : out) o.set_data(allocator::malloc(o.nbytes()));
    encode(stream(), in, out);
    cpu::get_command_encoder(stream()).dispatch(
        [sc = weak(in[0]), ps = weak(in[1]), ln = weak(in[2]), se = weak(in[3]), wt = weak(in[4]), so = weak(out[0]),
         po = weak(out[1]), lo = weak(out[2]), kn = knobs_, logits = logits_]() mutable {
          const float inf = std::numeric_limits<float>::infinity();
          int B = sc.shape(0), H = sc.shape(1), C = sc.shape(2);
          std::vector<float> kw(logits ? C : 0);
          for (int b = 0; b < B; ++b) {
            int32_t length = ln.data<int32_t>()[b * ln.strides(0)], newest = se.data<int32_t>()[b * se.strides(0)] - 1;
            bool over = length > kn.budget;
            lo.data<int32_t>()[b] = over ? length - 1 : length;
            for (int h = 0; h < H; ++h) {
              float* sr = so.data<float>() + (static_cast<int64_t>(b) * H + h) * C;
              int32_t* pr = po.data<int32_t>() + (static_cast<int64_t>(b) * H + h) * C;
              const float* s = sc.data<float>() + at(sc, b, h, 0);
              const int32_t* p = ps.data<int32_t>() + at(ps, b, h, 0);
              const float* w = wt.data<float>() + at(wt, b, h, 0);
              int64_t ss = sc.strides(2), pst = ps.strides(2), ws = wt.strides(2);
              for (int c = 0; c < C; ++c) pr[c] = p[c * pst];
              if (logits) {
                int span = wt.shape(3);
                for (int c = 0; c < C; ++c) kw[c] = c < span ? wt.data<float>()[at(wt, b, h, 0, c)] : 0.0f;
                visible_softmax(kw.data(), pr, newest, C, logits == 1);
                for (int c = 0; c < C; ++c) {
                  float decayed = kn.decay * s[c * ss];
                  sr[c] = decayed + kw[c];
                }
                if (over) evict_one(sr, pr, C, newest, kn);
                continue;
              }
              for (int c = 0; c < C; ++c) {
                float x = w[c * ws], decayed = kn.decay * s[c * ss];
                float clean = (x > 0.0f && x < inf) ? x : 0.0f;
                sr[c] = pr[c] >= 0 ? decayed + clean : 0.0f;
              }
              if (over) evict_one(sr, pr, C, newest, kn);
            }
          }
        });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("H2OWeightSettle runs on the CPU only");
  }

  const char* name() const override { return "H2OWeightSettle"; }

 private:
  Knobs knobs_;
  int logits_;
};

// h2o_fn.softmax's exp of x <= 0 (or -inf, NaN), operation for operation as g++ compiles mlx's
// fused CPU kernels (baseline x86-64, no FMA; this file is built with -ffp-contract=off): Cephes'
// polynomial on x - n ln 2, n = x / ln 2 rounded by adding and taking 1.5 * 2^23, times 2^n from
// the exponent bits; 0 below -87.3, NaN kept. The constants are Python's floats rounded to float32.
inline float exp_nonpositive(float x) {
  if (!(x >= static_cast<float>(-87.3))) return x == x ? 0.0f : x;
  const float round = 12582912.0f;
  float n = (x * static_cast<float>(1.44269504088896341) + round) - round;
  float r = (x - n * 0.693359375f) + n * static_cast<float>(2.12194440e-4);
  float p = static_cast<float>(1.9875691500e-4) * r + static_cast<float>(1.3981999507e-3);
  p = p * r + static_cast<float>(8.3334519073e-3);
  p = p * r + static_cast<float>(4.1665795894e-2);
  p = p * r + static_cast<float>(1.6666665459e-1);
  p = p * r + static_cast<float>(5.0000001201e-1);
  float e_r = (p * r * r + r) + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two;
  std::memcpy(&two, &bits, sizeof two);
  return e_r * two;
}

// x[i] <- exp_nonpositive(x[i] - top) for n floats: the same operations 8 lanes at a time where the
// CPU has AVX2 (asked at run time; no FMA, as the scalar one: the same bits for every float, checked
// over all 2^32 inputs at three tops, scratch)
#if defined(__x86_64__)
__attribute__((target("avx2"))) void exp_shifted_avx2(float* x, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top), low = _mm256_set1_ps(static_cast<float>(-87.3)),
               l2e = _mm256_set1_ps(static_cast<float>(1.44269504088896341)), rnd = _mm256_set1_ps(12582912.0f),
               c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(static_cast<float>(2.12194440e-4)),
               p0 = _mm256_set1_ps(static_cast<float>(1.9875691500e-4)), p1 = _mm256_set1_ps(static_cast<float>(1.3981999507e-3)),
               p2 = _mm256_set1_ps(static_cast<float>(8.3334519073e-3)), p3 = _mm256_set1_ps(static_cast<float>(4.1665795894e-2)),
               p4 = _mm256_set1_ps(static_cast<float>(1.6666665459e-1)), p5 = _mm256_set1_ps(static_cast<float>(5.0000001201e-1)),
               one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), t);
    __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(d, l2e), rnd), rnd);
    __m256 r = _mm256_add_ps(_mm256_sub_ps(d, _mm256_mul_ps(k, c1)), _mm256_mul_ps(k, c2));
    __m256 p = _mm256_add_ps(_mm256_mul_ps(p0, r), p1);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), p2);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), p3);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), p4);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), p5);
    __m256 e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), one);
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    __m256 v = _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
    __m256 nan = _mm256_and_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q), d);  // NaN kept, else 0
    _mm256_storeu_ps(x + i, _mm256_blendv_ps(nan, v, _mm256_cmp_ps(d, low, _CMP_GE_OQ)));
  }
  for (; i < n; ++i) x[i] = exp_nonpositive(x[i] - top);
}
#endif

void exp_shifted(float* x, int64_t n, float top) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return exp_shifted_avx2(x, n, top);
#endif
  for (int64_t i = 0; i < n; ++i) x[i] = exp_nonpositive(x[i] - top);
}

// the (b, h) matrix [n, D] of `a` [B, H, n, D] as float32, the layout mlx's matmul multiplies
// (its `astype(float32)` copy, or the float32 rows where they lie): a pointer to its rows, their
// stride in `ld`; widened or gathered into `tmp` when needed
template <typename T>
const float* rows_f32(const array& a, int b, int h, std::vector<float>& tmp, int& ld) {
  int n = a.shape(2), D = a.shape(3);
  const T* base = a.data<T>() + at(a, b, h, 0);
  int64_t rs = a.strides(2), cs = a.strides(3);
  if constexpr (std::is_same_v<T, float>) {
    if (cs == 1 && (n == 1 || rs >= D)) {
      ld = n == 1 ? std::max(D, 1) : static_cast<int>(rs);
      return base;
    }
  }
  ld = std::max(D, 1);
  tmp.resize(static_cast<size_t>(n) * D);
  if constexpr (!std::is_same_v<T, float>) {
    if (cs == 1 && rs == D) {
      widen(base, tmp.data(), static_cast<int64_t>(n) * D);
      return tmp.data();
    }
  }
  for (int i = 0; i < n; ++i)
    for (int d = 0; d < D; ++d) tmp[static_cast<size_t>(i) * D + d] = static_cast<float>(base[i * rs + d * cs]);
  return tmp.data();
}

const float* rows_of(const array& a, int b, int h, std::vector<float>& tmp, int& ld) {
  switch (a.dtype()) {
    case float16: return rows_f32<float16_t>(a, b, h, tmp, ld);
    case bfloat16: return rows_f32<bfloat16_t>(a, b, h, tmp, ld);
    default: return rows_f32<float>(a, b, h, tmp, ld);
  }
}

void store_out(array& out, int64_t i, float x) {
  switch (out.dtype()) {
    case float16: out.data<float16_t>()[i] = static_cast<float16_t>(x); return;
    case bfloat16: out.data<bfloat16_t>()[i] = static_cast<bfloat16_t>(x); return;
    default: out.data<float>()[i] = x;
  }
}

// n bytes as float32 (exact): AVX2's 8 at a time where the CPU has it (asked at run time)
#if defined(__x86_64__)
__attribute__((target("avx2"))) void bytes_avx2(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

void bytes_to_float(const uint8_t* src, float* dst, int64_t n) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return bytes_avx2(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// the 8-bit codes of (b, h)'s rows [n, D] as float32 into `tmp` (mx.quantize packs element d of a row
// into byte d % 4 of word d / 4, little-endian: the words read as bytes are the codes in order), and
// each row's one scale and bias (a group per row) as float32 into `sc`, `bi`
void codes_of(const array& packed, const array& scales, const array& biases, int b, int h, std::vector<float>& tmp,
              std::vector<float>& sc, std::vector<float>& bi) {
  int n = packed.shape(2), D = packed.shape(3) * 4;
  tmp.resize(static_cast<size_t>(n) * D);
  sc.resize(n);
  bi.resize(n);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(packed.data<uint32_t>() + at(packed, b, h, 0));
  if (packed.strides(2) * 4 == D) {
    bytes_to_float(bytes, tmp.data(), static_cast<int64_t>(n) * D);
  } else {
    for (int i = 0; i < n; ++i) bytes_to_float(bytes + i * packed.strides(2) * 4, tmp.data() + static_cast<size_t>(i) * D, D);
  }
  for (int i = 0; i < n; ++i) {
    sc[i] = load(scales, at(scales, b, h, i, 0));
    bi[i] = load(biases, at(biases, b, h, i, 0));
  }
}

// One query per query head attending to every row, no mask, as h2o_fn.adapters.attention's
// attention_with_weights then per_kv_head(mean) compute it, per (b, h) with its R = Hq / H query
// heads as rows: logits = (q * scale) . K^T (the cblas_sgemm call mlx's matmul makes), h2o_fn's
// softmax of each row (the max subtracted, exp_nonpositive, the sum in order, divided), out =
// W . V (cblas_sgemm) cast to the queries' dtype, and the weights' mean over the R rows (their
// sum in order times float32(1 / R)). 8-bit rows with one group per row (`in` holds the keys' and
// the values' packed codes, scales and biases) as h2o_fn.storage's matmul_t and matmul take them:
// logits = (x . codes^T) * s + sum(x) * b, out = (W * s) . codes + W . b, each op rounded in turn.
// With the key proxy's rows [B, H, P, D] (float32, already scaled) as a last input, they join the
// query rows in the keys' product, as attention_with_proxy concatenates them, and their logits
// [B, H, P, L] are a third output.
// Inputs: queries [B, Hq, 1, D], keys [B, H, L, D], values [B, H, L, Dv] (or their triples);
// outputs: out [B, Hq, 1, Dv], weights [B, H, 1, L] float32.
void attend(const std::vector<array>& in, float scale, array& out, array& wm, array* lg) {
  const array& q = in[0];
  bool q8 = in.size() >= 7;
  const array& kp = in[1];
  const array& vp = in[q8 ? 4 : 2];
  int B = kp.shape(0), H = kp.shape(1), L = kp.shape(2), D = q.shape(3), Dv = vp.shape(3) * (q8 ? 4 : 1);
  int R = q.shape(1) / H, P = lg ? in.back().shape(2) : 0, M = R + P;
  std::vector<float> qr(static_cast<size_t>(M) * D), w(static_cast<size_t>(M) * L), o(static_cast<size_t>(R) * Dv);
  // the stores' float32 copies (8-bit codes, half-precision rows) keep their memory from call to call: a
  // fresh one is fresh pages, whose faults cost as much as the copy
  static thread_local std::vector<float> kt, vt;
  std::vector<float> ks, kb, vs, vb, t(static_cast<size_t>(R) * L), ob(R);
  float inv_r = static_cast<float>(1.0 / R);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      for (int r = 0; r < R; ++r)
        for (int d = 0; d < D; ++d) qr[static_cast<size_t>(r) * D + d] = load(q, at(q, b, h * R + r, 0, d)) * scale;
      for (int r = 0; r < P; ++r)  // the proxy's rows, already scaled: one product gives their logits too
        for (int d = 0; d < D; ++d) qr[static_cast<size_t>(R + r) * D + d] = load(in.back(), at(in.back(), b, h, r, d));
      int ldk = D, ldv = Dv;
      const float* k;
      const float* v;
      if (q8) {
        codes_of(in[1], in[2], in[3], b, h, kt, ks, kb);
        codes_of(in[4], in[5], in[6], b, h, vt, vs, vb);
        k = kt.data();
        v = vt.data();
      } else {
        k = rows_of(in[1], b, h, kt, ldk);
        v = rows_of(in[2], b, h, vt, ldv);
      }
      if (L > 0 && D > 0) cblas_sgemm(101, 111, 112, M, L, D, 1.0f, qr.data(), D, k, ldk, 0.0f, w.data(), L);
      else std::fill(w.begin(), w.end(), 0.0f);
      if (q8) {
        for (int r = 0; r < M; ++r) {
          float sum = 0.0f;
          for (int d = 0; d < D; ++d) sum += qr[static_cast<size_t>(r) * D + d];
          for (int c = 0; c < L; ++c) {
            float& x = w[static_cast<size_t>(r) * L + c];
            float dot = x * ks[c], bias = sum * kb[c];
            x = dot + bias;
          }
        }
      }
      if (lg)
        std::memcpy(lg->data<float>() + (static_cast<int64_t>(b) * H + h) * P * L, w.data() + static_cast<size_t>(R) * L,
                    sizeof(float) * P * L);
      float* m = wm.data<float>() + (static_cast<int64_t>(b) * H + h) * L;
      for (int r = 0; r < R; ++r) {
        float* x = w.data() + static_cast<size_t>(r) * L;
        float top = -std::numeric_limits<float>::infinity();
        for (int c = 0; c < L; ++c) top = std::max(top, x[c]);  // a NaN row ends all NaN either way
        exp_shifted(x, L, top);
        float sum = 0.0f;
        for (int c = 0; c < L; ++c) sum += x[c];
        for (int c = 0; c < L; ++c) x[c] /= sum;
      }
      for (int c = 0; c < L; ++c) {
        float sum = 0.0f;
        for (int r = 0; r < R; ++r) sum += w[static_cast<size_t>(r) * L + c];
        m[c] = sum * inv_r;
      }
      const float* ww = w.data();
      if (q8) {
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < L; ++c) t[static_cast<size_t>(r) * L + c] = w[static_cast<size_t>(r) * L + c] * vs[c];
        ww = t.data();
      }
      if (Dv > 0 && L > 0) cblas_sgemm(101, 111, 111, R, Dv, L, 1.0f, ww, L, v, ldv, 0.0f, o.data(), Dv);
      else std::fill(o.begin(), o.end(), 0.0f);
      if (q8) {
        if (L > 0) cblas_sgemm(101, 111, 111, R, 1, L, 1.0f, w.data(), L, vb.data(), 1, 0.0f, ob.data(), 1);
        else std::fill(ob.begin(), ob.end(), 0.0f);
        for (int r = 0; r < R; ++r)
          for (int d = 0; d < Dv; ++d) o[static_cast<size_t>(r) * Dv + d] += ob[r];
      }
      for (int r = 0; r < R; ++r)
        for (int d = 0; d < Dv; ++d)
          store_out(out, ((static_cast<int64_t>(b) * H * R + h * R + r)) * Dv + d, o[static_cast<size_t>(r) * Dv + d]);
    }
}

class H2OAttend : public Primitive {
 public:
  H2OAttend(Stream s, float scale) : Primitive(s), scale_(scale) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& out) override {
    for (auto& o : out) o.set_data(allocator::malloc(o.nbytes()));
    encode(stream(), in, out);
    std::vector<array> ins;
    for (auto& a : in) ins.push_back(weak(a));
    cpu::get_command_encoder(stream()).dispatch(
        [ins = std::move(ins), o = weak(out[0]), w = weak(out[1]), lg = weak(out.size() > 2 ? out[2] : out[1]),
         proxy = out.size() > 2, sc = scale_]() mutable { attend(ins, sc, o, w, proxy ? &lg : nullptr); });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("H2OAttend runs on the CPU only");
  }

  const char* name() const override { return "H2OAttend"; }

 private:
  float scale_;
};

// The key proxy's query of an admitted token read back from 8-bit rows with one group per row
// and float32 scales: each (b, h)'s row at the slot holding position seen[b] - 1, as
// h2o_fn.storage.dense then h2o_fn.scoring.proxy_rows make it: float(code) * s + b, times `scale`,
// each op rounded in turn (NaN where no slot holds it).
// Inputs: packed [B, H, C, D / 4] uint32, scales, biases [B, H, C, 1], positions [B, H, C], seen [B];
// output [B, H, 1, D] float32.
class H2ONewestRow : public Primitive {
 public:
  H2ONewestRow(Stream s, float scale) : Primitive(s), scale_(scale) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& out) override {
    out[0].set_data(allocator::malloc(out[0].nbytes()));
    encode(stream(), in, out);
    cpu::get_command_encoder(stream()).dispatch(
        [kp = weak(in[0]), ks = weak(in[1]), kb = weak(in[2]), ps = weak(in[3]), se = weak(in[4]),
         o = weak(out[0]), sc = scale_]() mutable {
          int B = kp.shape(0), H = kp.shape(1), C = kp.shape(2), D = kp.shape(3) * 4;
          for (int b = 0; b < B; ++b) {
            int32_t newest = se.data<int32_t>()[b * se.strides(0)] - 1;
            for (int h = 0; h < H; ++h) {
              float* row = o.data<float>() + (static_cast<int64_t>(b) * H + h) * D;
              const int32_t* p = ps.data<int32_t>() + at(ps, b, h, 0);
              int c = 0;
              while (c < C && p[c * ps.strides(2)] != newest) ++c;
              if (c == C) {
                std::fill(row, row + D, std::numeric_limits<float>::quiet_NaN());
                continue;
              }
              const uint8_t* codes = reinterpret_cast<const uint8_t*>(kp.data<uint32_t>() + at(kp, b, h, c));
              float s = ks.data<float>()[at(ks, b, h, c, 0)], bias = kb.data<float>()[at(kb, b, h, c, 0)];
              for (int d = 0; d < D; ++d) {
                float x = static_cast<float>(codes[d]) * s;
                x = x + bias;
                row[d] = x * sc;
              }
            }
          }
        });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("H2ONewestRow runs on the CPU only");
  }

  const char* name() const override { return "H2ONewestRow"; }

 private:
  float scale_;
};

// h2o_fn.core.admit's positions and counts for one token that every batch row takes: the first
// free slot of each (b, h) (slot 0 when none is) at position seen[b]; length and seen grow by one.
// Inputs: positions [B, H, C], length, seen [B]; outputs: positions', length', seen'.
class H2OAdmitCounts : public Primitive {
 public:
  explicit H2OAdmitCounts(Stream s) : Primitive(s) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& out) override {
    for (auto& o : out) o.set_data(allocator::malloc(o.nbytes()));
    encode(stream(), in, out);
    cpu::get_command_encoder(stream()).dispatch(
        [ps = weak(in[0]), ln = weak(in[1]), se = weak(in[2]), po = weak(out[0]), lo = weak(out[1]),
         so = weak(out[2])]() mutable {
          int B = ps.shape(0), H = ps.shape(1), C = ps.shape(2);
          for (int b = 0; b < B; ++b) {
            int32_t newest = se.data<int32_t>()[b * se.strides(0)];
            lo.data<int32_t>()[b] = ln.data<int32_t>()[b * ln.strides(0)] + 1;
            so.data<int32_t>()[b] = newest + 1;
            for (int h = 0; h < H; ++h) {
              int32_t* pr = po.data<int32_t>() + (static_cast<int64_t>(b) * H + h) * C;
              const int32_t* p = ps.data<int32_t>() + at(ps, b, h, 0);
              for (int c = 0; c < C; ++c) pr[c] = p[c * ps.strides(2)];
              pr[first_free(ps, b, h)] = newest;
            }
          }
        });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("H2OAdmitCounts runs on the CPU only");
  }

  const char* name() const override { return "H2OAdmitCounts"; }
};

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("cpu_step: " + what);
}

std::vector<array> key_step(const array& keys, const array& values, const array& scores, const array& positions,
                            const array& length, const array& seen, const array& key, const array& value,
                            float decay, float scale, int n_sink, int grace, int budget, int span) {
  auto fl = [](const array& a) { return a.dtype() == float16 || a.dtype() == bfloat16 || a.dtype() == float32; };
  need(keys.ndim() == 4 && values.ndim() == 4 && scores.ndim() == 3, "expected keys, values [B, H, C, D], scores [B, H, C]");
  int B = scores.shape(0), H = scores.shape(1), C = scores.shape(2);
  need(keys.shape(0) == B && keys.shape(1) == H && keys.shape(2) == C && values.shape(0) == B &&
           values.shape(1) == H && values.shape(2) == C && positions.shape() == scores.shape(),
       "keys, values, scores and positions disagree on [B, H, C]");
  need(key.shape() == Shape{B, H, 1, keys.shape(3)} && value.shape() == Shape{B, H, 1, values.shape(3)},
       "expected key [B, H, 1, Dk] and value [B, H, 1, Dv]");
  need(length.shape() == Shape{B} && seen.shape() == Shape{B}, "expected length and seen [B]");
  need(span >= 0 && span <= C, "expected a span of 0 to C slots");
  need(fl(keys) && fl(values) && fl(key) && fl(value) && scores.dtype() == float32 && positions.dtype() == int32 &&
           length.dtype() == int32 && seen.dtype() == int32,
       "expected float stores and rows, float32 scores, int32 positions, length and seen");
  Stream cpu_stream = default_stream(Device::cpu);
  // the values' write waits for the settle (`after`, an input it does not read), so that whatever
  // attends to the new rows evaluates the settle too: an unevaluated settle left for later would
  // still hold the keys, and the next token's write could not take their buffer
  auto write = [&](const array& store, const array& row, std::vector<array> after) {
    std::vector<array> in{store, positions, row};
    in.insert(in.end(), after.begin(), after.end());
    return array(store.shape(), store.dtype(), std::make_shared<H2OWriteRow>(cpu_stream), std::move(in));
  };
  array k2 = write(keys, key, {});
  auto rest = array::make_arrays({scores.shape(), positions.shape(), length.shape(), seen.shape()},
                                 {float32, int32, int32, int32},
                                 std::make_shared<H2OKeySettle>(cpu_stream, Knobs{decay, scale, n_sink, grace, budget, span}),
                                 {k2, scores, positions, length, seen, key});
  return {k2, write(values, value, {rest[2]}), rest[0], rest[1], rest[2], rest[3]};
}

// the H2OWeightSettle arrays (scores', positions', length') of an admitted state settled by `by`, its
// weights [B, H, C] (logits 0) or its key proxy's logits [B, H, 1, span] (logits 1 or 2)
std::vector<array> settled(const array& scores, const array& positions, const array& length, const array& seen,
                           const array& by, float decay, int n_sink, int grace, int budget, int logits) {
  need(scores.ndim() == 3 && positions.shape() == scores.shape(), "expected scores and positions [B, H, C]");
  need(length.shape() == Shape{scores.shape(0)} && seen.shape() == Shape{scores.shape(0)},
       "expected length and seen [B]");
  need(scores.dtype() == float32 && by.dtype() == float32 && positions.dtype() == int32 &&
           length.dtype() == int32 && seen.dtype() == int32,
       "expected float32 scores and weights or logits, int32 positions, length and seen");
  return array::make_arrays({scores.shape(), positions.shape(), length.shape()}, {float32, int32, int32},
                            std::make_shared<H2OWeightSettle>(default_stream(Device::cpu),
                                                              Knobs{decay, 1.0f, n_sink, grace, budget}, logits),
                            {scores, positions, length, seen, by});
}

std::vector<array> weight_settle(const array& scores, const array& positions, const array& length,
                                 const array& seen, const array& weights, float decay, int n_sink, int grace,
                                 int budget) {
  need(weights.shape() == scores.shape(), "expected scores, positions and weights [B, H, C]");
  return settled(scores, positions, length, seen, weights, decay, n_sink, grace, budget, 0);
}

// the H2OAttend arrays of `in` (queries, keys and values as one or three arrays each), with the
// proxy's rows appended when `rows` holds them
std::vector<array> attended(std::vector<array> in, int Dv, float scale, const std::vector<array>& rows) {
  const array& q = in[0];
  int B = in[1].shape(0), H = in[1].shape(1), L = in[1].shape(2);
  std::vector<Shape> shapes{{B, q.shape(1), 1, Dv}, {B, H, 1, L}};
  std::vector<Dtype> types{q.dtype(), float32};
  need(rows.size() <= 1, "expected at most one array of proxy rows");
  if (!rows.empty()) {
    const array& r = rows[0];
    need(r.ndim() == 4 && r.shape(0) == B && r.shape(1) == H && r.shape(3) == q.shape(3) && r.dtype() == float32,
         "expected proxy rows [B, H, P, D] float32");
    shapes.push_back({B, H, r.shape(2), L});
    types.push_back(float32);
    in.push_back(r);
  }
  return array::make_arrays(std::move(shapes), std::move(types),
                            std::make_shared<H2OAttend>(default_stream(Device::cpu), scale), std::move(in));
}

std::vector<array> key_settle(const array& scores, const array& positions, const array& length, const array& seen,
                              const array& logits, float decay, int n_sink, int grace, int budget, bool mlx_softmax) {
  need(scores.ndim() == 3 && logits.ndim() == 4 && logits.shape(0) == scores.shape(0) &&
           logits.shape(1) == scores.shape(1) && logits.shape(2) == 1 && logits.shape(3) <= scores.shape(2),
       "expected logits [B, H, 1, span] with span at most C");
  return settled(scores, positions, length, seen, logits, decay, n_sink, grace, budget, mlx_softmax ? 1 : 2);
}

std::vector<array> attention(const array& queries, const array& keys, const array& values, float scale,
                             const std::vector<array>& rows) {
  auto fl = [](const array& a) { return a.dtype() == float16 || a.dtype() == bfloat16 || a.dtype() == float32; };
  need(queries.ndim() == 4 && keys.ndim() == 4 && values.ndim() == 4, "expected queries [B, Hq, 1, D], keys [B, H, L, D], values [B, H, L, Dv]");
  int B = keys.shape(0), H = keys.shape(1), L = keys.shape(2);
  need(queries.shape(0) == B && queries.shape(2) == 1 && queries.shape(3) == keys.shape(3) && H > 0 &&
           queries.shape(1) % H == 0 && values.shape(0) == B && values.shape(1) == H && values.shape(2) == L,
       "expected queries [B, Hq, 1, D] with Hq a multiple of the keys' H, keys [B, H, L, D], values [B, H, L, Dv]");
  need(fl(queries) && fl(keys) && fl(values), "expected float queries, keys and values");
  return attended({queries, keys, values}, values.shape(3), scale, rows);
}

std::vector<array> attention_q8(const array& queries, const array& kp, const array& ks, const array& kb,
                                const array& vp, const array& vs, const array& vb, float scale,
                                const std::vector<array>& rows) {
  auto fl = [](const array& a) { return a.dtype() == float16 || a.dtype() == bfloat16 || a.dtype() == float32; };
  need(queries.ndim() == 4 && kp.ndim() == 4 && vp.ndim() == 4 && ks.ndim() == 4 && vs.ndim() == 4,
       "expected queries [B, Hq, 1, D] and mx.quantize's triples [B, H, L, D / 4], [B, H, L, 1]");
  int B = kp.shape(0), H = kp.shape(1), L = kp.shape(2);
  Shape one{B, H, L, 1};
  need(queries.shape(0) == B && queries.shape(2) == 1 && queries.shape(3) == kp.shape(3) * 4 && H > 0 &&
           queries.shape(1) % H == 0 && vp.shape(0) == B && vp.shape(1) == H && vp.shape(2) == L &&
           ks.shape() == one && kb.shape() == one && vs.shape() == one && vb.shape() == one,
       "expected queries [B, Hq, 1, D] with Hq a multiple of H, 8-bit keys and values [B, H, L, D / 4] with one "
       "group per row (scales, biases [B, H, L, 1])");
  need(fl(queries) && kp.dtype() == uint32 && vp.dtype() == uint32 && fl(ks) && fl(kb) && fl(vs) && fl(vb) &&
           kp.strides(3) == 1 && vp.strides(3) == 1,
       "expected float queries, scales and biases, uint32 codes with contiguous rows");
  return attended({queries, kp, ks, kb, vp, vs, vb}, vp.shape(3) * 4, scale, rows);
}

// stores: the keys' and the values' arrays (one each, or mx.quantize's three each), rows: the token's
// rows as each store holds them ([B, H, 1, *]; float rows are cast, packed codes copied)
std::vector<array> admit_rows(const std::vector<array>& stores, const array& positions, const array& length,
                              const array& seen, const std::vector<array>& rows) {
  auto fl = [](const array& a) { return a.dtype() == float16 || a.dtype() == bfloat16 || a.dtype() == float32; };
  need(positions.ndim() == 3, "expected positions [B, H, C]");
  int B = positions.shape(0), H = positions.shape(1), C = positions.shape(2);
  need(stores.size() == rows.size() && (stores.size() == 2 || stores.size() == 6),
       "expected the keys' and values' stores (1 or 3 arrays each) and as many rows");
  for (size_t i = 0; i < stores.size(); ++i) {
    const array& st = stores[i];
    const array& rw = rows[i];
    need(st.ndim() == 4 && st.shape(0) == B && st.shape(1) == H && st.shape(2) == C,
         "stores and positions disagree on [B, H, C]");
    need(rw.shape() == Shape{B, H, 1, st.shape(3)}, "expected key [B, H, 1, Dk] and value [B, H, 1, Dv]");
    need((fl(st) && fl(rw)) || (st.dtype() == uint32 && rw.dtype() == uint32),
         "expected float stores and rows, or uint32 codes both");
  }
  need(length.shape() == Shape{B} && seen.shape() == Shape{B}, "expected length and seen [B]");
  need(positions.dtype() == int32 && length.dtype() == int32 && seen.dtype() == int32,
       "expected int32 positions, length and seen");
  Stream cpu_stream = default_stream(Device::cpu);
  std::vector<array> out;
  for (size_t i = 0; i < stores.size(); ++i)
    out.push_back(array(stores[i].shape(), stores[i].dtype(), std::make_shared<H2OWriteRow>(cpu_stream),
                        {stores[i], positions, rows[i]}));
  auto counts = array::make_arrays({positions.shape(), length.shape(), seen.shape()}, {int32, int32, int32},
                                   std::make_shared<H2OAdmitCounts>(cpu_stream), {positions, length, seen});
  out.insert(out.end(), counts.begin(), counts.end());
  return out;
}

array newest_row(const array& kp, const array& ks, const array& kb, const array& positions, const array& seen,
                 float scale) {
  need(kp.ndim() == 4 && positions.ndim() == 3 && kp.shape(0) == positions.shape(0) &&
           kp.shape(1) == positions.shape(1) && kp.shape(2) == positions.shape(2),
       "expected packed codes [B, H, C, D / 4] and positions [B, H, C]");
  Shape one{kp.shape(0), kp.shape(1), kp.shape(2), 1};
  need(kp.dtype() == uint32 && kp.strides(3) == 1 && ks.shape() == one && kb.shape() == one &&
           ks.dtype() == float32 && kb.dtype() == float32,
       "expected uint32 codes with contiguous rows, float32 scales and biases [B, H, C, 1] (one group per row)");
  need(positions.dtype() == int32 && seen.dtype() == int32 && seen.shape() == Shape{kp.shape(0)},
       "expected int32 positions and seen [B]");
  return array({kp.shape(0), kp.shape(1), 1, kp.shape(3) * 4}, float32,
               std::make_shared<H2ONewestRow>(default_stream(Device::cpu), scale), {kp, ks, kb, positions, seen});
}

}  // namespace

NB_MODULE(_h2o_cpu_step, m) {
  nb::module_::import_("mlx.core");
  m.def("key_step", &key_step,
        "(keys, values, scores, positions, length, seen)' after admitting one token and settling it by its key");
  m.def("attention", &attention,
        "(out [B, Hq, 1, Dv], weights [B, H, 1, L]) of one query per head, as attention_with_weights then per_kv_head");
  m.def("attention_q8", &attention_q8, "`attention` over 8-bit rows, one group per row");
  m.def("key_settle", &key_settle, "(scores, positions, length)' of an admitted state settled by its key proxy's logits");
  m.def("admit_rows", &admit_rows, "(the stores' arrays..., positions, length, seen)' after admitting one token");
  m.def("newest_row", &newest_row, "[B, H, 1, D] float32: the key proxy's query read back from 8-bit rows");
  m.def("weight_settle", &weight_settle, "(scores, positions, length)' of an admitted state settled by its weights");
}
