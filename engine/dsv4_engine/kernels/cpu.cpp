// Fused CPU kernels for the decode step, registered as torch ops `dsv4::*`.
//
// Eager torch pays a Python dispatch (~5-10 us here) per op; the mHC Sinkhorn alone is ~80 ops and
// the per-expert MoE loop ~10 ops per expert in use. These kernels run the same aten sequences from
// C++ (one Python dispatch each) and the 4x4 Sinkhorn as plain loops. Each mirrors an op of the torch
// kernel set (dsv4_engine/kernels/torch_forms.py, named at each kernel) and is tested against it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "rows.h"
#include "simd.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>
#include <vector>

namespace {

// Sinkhorn-Knopp, as TorchKernels.hc_pre: columns, then (rows, columns) iters - 1 times, each
// dividing by (sum + eps). It runs on a block of `b` rows of n x n matrices stored entry-major
// (`c[(i * n + j) * b + r]` is entry (i, j) of row r), so every loop runs across rows and vectorises.
void sinkhorn_block(float* c, int64_t n, int64_t b, int64_t iters, float eps, float* sums) {
  auto normalise = [&](bool columns) {
    for (int64_t u = 0; u < n; ++u) {  // u: the column (or row) whose n entries are summed
      float* s = sums + u * b;
      auto at = [&](int64_t v) { return c + (columns ? v * n + u : u * n + v) * b; };
      std::copy(at(0), at(0) + b, s);
      for (int64_t v = 1; v < n; ++v) {
        const float* x = at(v);
        for (int64_t r = 0; r < b; ++r) s[r] += x[r];
      }
      for (int64_t r = 0; r < b; ++r) s[r] += eps;
      for (int64_t v = 0; v < n; ++v) {
        float* x = at(v);
        for (int64_t r = 0; r < b; ++r) x[r] /= s[r];
      }
    }
  };
  normalise(true);
  for (int64_t it = 1; it < iters; ++it) {
    normalise(false);
    normalise(true);
  }
}

// TorchKernels.hc_pre: (post [T, n], comb [T, n, n], collapsed [T, D]) for streams [T, n, D],
// from the map's output `mixes` [T, (2 + n) * n]; rows in blocks of 64 (see sinkhorn_block).
template <typename T>
void hc_rows(const T* streams, const float* mixes, const float* base, const float* scale, int64_t t,
             int64_t n, int64_t d, int64_t iters, float hc_eps, float* post, float* comb, T* collapsed) {
  constexpr int64_t B = 64;
  const int64_t width = (2 + n) * n;
  std::vector<float> pre(B * n), block(n * n * B), sums(n * B), acc(d);
  for (int64_t r0 = 0; r0 < t; r0 += B) {
    const int64_t b = std::min(B, t - r0);
    for (int64_t r = 0; r < b; ++r) {
      const float* m = mixes + (r0 + r) * width;
      float* po = post + (r0 + r) * n;
      for (int64_t i = 0; i < n; ++i) {
        pre[r * n + i] = 1.f / (1.f + std::exp(-(m[i] * scale[0] + base[i]))) + hc_eps;
        po[i] = 2.f / (1.f + std::exp(-(m[n + i] * scale[1] + base[n + i])));
      }
      for (int64_t i = 0; i < n; ++i) {  // softmax over each row of the n x n logits, then + eps
        const float* l = m + 2 * n + i * n;
        const float* bb = base + 2 * n + i * n;
        float e[16], mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, e[j] = l[j] * scale[2] + bb[j]);
        for (int64_t j = 0; j < n; ++j) sum += (e[j] = std::exp(e[j] - mx));
        for (int64_t j = 0; j < n; ++j) block[(i * n + j) * b + r] = e[j] / sum + hc_eps;
      }
    }
    sinkhorn_block(block.data(), n, b, iters, hc_eps, sums.data());
    for (int64_t r = 0; r < b; ++r)
      for (int64_t ij = 0; ij < n * n; ++ij) comb[(r0 + r) * n * n + ij] = block[ij * b + r];
    for (int64_t r = 0; r < b; ++r) {  // collapsed = sum_i pre_i * streams_i, in fp32
      const T* st = streams + (r0 + r) * n * d;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float p = pre[r * n + i];
        const T* si = st + i * d;
        for (int64_t k = 0; k < d; ++k) acc[k] += p * static_cast<float>(si[k]);
      }
      T* out = collapsed + (r0 + r) * d;
      for (int64_t k = 0; k < d; ++k) out[k] = static_cast<T>(acc[k]);
    }
  }
}

#if defined(__x86_64__)
// Skinny fp32 GEMM, y[i, n] = dot(x_i, w_n) for a few rows x_i (given as pointers, so the routed
// rows need no gather) against w [N, K] row-major. A decode step gives each expert ~T*k/E rows, where
// MKL's sgemm streams the expert's weights at half the memory bandwidth; tiles of 2 rows x 6 weight
// rows keep 12 accumulators in registers and read each weight once from memory. While a tile's rows
// are multiplied, the next tile's weights are prefetched a cache line per step, so the memory
// stream overlaps the arithmetic (~30% off a decode step's experts, whose weights never fit in
// cache). Every output is the same sum in the same order whatever the number of rows, so a row's
// result does not depend on its batch (MKL's kernel choice depends on M).
using dsv4::hsum;

// Lines of the next weight tile still to prefetch: [next, end).
struct Prefetch {
  const char* next;
  const char* end;
};

template <int MB, int NB>
DSV4_AVX2 void skinny_tile(const float* const* x, const float* w, int64_t k, float* y, int64_t ldy, Prefetch& pf) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = k & ~int64_t(7);
  for (int64_t c = 0; c < k8; c += 8) {
    if (pf.next < pf.end) {
      _mm_prefetch(pf.next, _MM_HINT_T0);
      pf.next += 64;
    }
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * k + c);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x[i] + c);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t c = k8; c < k; ++c) s += x[i][c] * w[j * k + c];
      y[i * ldy + j] = s;
    }
}

// One tile of NB weight rows against all m rows; prefetches the weights that follow, up to `w_end`.
template <int NB>
DSV4_AVX2 void skinny_rows(const float* const* x, int64_t m, const float* w, int64_t k, float* y, int64_t ldy,
                           const float* w_end) {
  const float* next = std::min(w + NB * k, w_end);
  Prefetch pf{reinterpret_cast<const char*>(next), reinterpret_cast<const char*>(std::min(next + NB * k, w_end))};
  int64_t i = 0;
  for (; i + 2 <= m; i += 2) skinny_tile<2, NB>(x + i, w, k, y + i * ldy, ldy, pf);
  if (i < m) skinny_tile<1, NB>(x + i, w, k, y + i * ldy, ldy, pf);
  for (; pf.next < pf.end; pf.next += 64) _mm_prefetch(pf.next, _MM_HINT_T0);
}

void skinny_gemm(const float* const* x, int64_t m, const float* w, int64_t n, int64_t k, float* y, int64_t ldy) {
  constexpr int64_t NB = 6;
  const int64_t tiles = n / NB;
  const float* w_end = w + n * k;
  at::parallel_for(0, tiles, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) skinny_rows<NB>(x, m, w + t * NB * k, k, y + t * NB, ldy, w_end);
  });
  for (int64_t j = tiles * NB; j < n; ++j) skinny_rows<1>(x, m, w + j * k, k, y + j, ldy, w_end);
}

bool skinny_supported() { return dsv4::has_avx2_fma(); }

#endif

// Below this many rows an expert's GEMMs go to skinny_gemm (x86 with AVX2): MKL streams the weights
// at half the memory bandwidth there. From it on, BLAS: its blocking wins once the weights are reused.
constexpr int64_t kSkinnyRows = 32;

// Up to this many rows hc_pre's map runs as dot-product loops: on one thread they beat the aten ops
// (~30 us of dispatches) at any row count measured, but only MKL's GEMM spreads a prefill's thousands
// of rows over threads, so those keep it.
constexpr int64_t kHcLoopRows = 32;

// dot(a, b) in 8 independent partial sums (gcc -O3 vectorises those without reassociating a float sum).
float dot8(const float* a, const float* b, int64_t k) {
  const int64_t k8 = k & ~int64_t(7);
  float acc[8] = {};
  for (int64_t c = 0; c < k8; c += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[c + l] * b[c + l];
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += acc[l];
  for (int64_t c = k8; c < k; ++c) s += a[c] * b[c];
  return s;
}

// y[i, j] = dot(x_i, w_j) for m rows against w [n, k]: skinny_gemm where AVX2 is there, else dot8.
void small_gemm(const float* const* x, int64_t m, const float* w, int64_t n, int64_t k, float* y, int64_t ldy) {
#if defined(__x86_64__)
  if (skinny_supported()) return skinny_gemm(x, m, w, n, k, y, ldy);
#endif
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) y[i * ldy + j] = dot8(x[i], w + j * k, k);
}

// The RMS norm's sum of squares, in 8 partial sums as small_gemm.
float sum_squares(const float* x, int64_t k) { return dot8(x, x, k); }

// t itself when already contiguous fp32: a dispatched to() costs ~1 us even when it returns t.
at::Tensor f32c(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(
    const at::Tensor& streams, const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale,
    int64_t iters, double hc_eps, double norm_eps) {
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  TORCH_CHECK(n <= 16, "hc_pre: at most 16 streams");
  const int64_t width = (2 + n) * n;
  TORCH_CHECK(fn.size(0) == width && fn.size(1) == n * d, "hc_pre: fn must be [(2 + n) * n, n * D]");
  auto sc = streams.contiguous();
  auto b = f32c(base), s = f32c(scale);
  auto post = at::empty({t, n}, sc.options().dtype(at::kFloat));
  auto comb = at::empty({t, n, n}, sc.options().dtype(at::kFloat));
  auto collapsed = at::empty({t, d}, sc.options());
  if (sc.scalar_type() == at::kFloat && t <= kHcLoopRows) {
    // torch_ops.stream_mixes for a few fp32 rows: the dot products, then each row times its RMS scale.
    auto w = f32c(fn);
    const float* sp = sc.data_ptr<float>();
    std::vector<float> mixes(t * width);
    std::vector<const float*> rows(t);
    for (int64_t r = 0; r < t; ++r) rows[r] = sp + r * n * d;
    small_gemm(rows.data(), t, w.data_ptr<float>(), width, n * d, mixes.data(), width);
    for (int64_t r = 0; r < t; ++r) {
      const float ms = sum_squares(rows[r], n * d) / static_cast<float>(n * d);
      const float rs = 1.f / std::sqrt(ms + static_cast<float>(norm_eps));
      for (int64_t j = 0; j < width; ++j) mixes[r * width + j] *= rs;
    }
    hc_rows<float>(sp, mixes.data(), b.data_ptr<float>(), s.data_ptr<float>(), t, n, d, iters,
                   static_cast<float>(hc_eps), post.data_ptr<float>(), comb.data_ptr<float>(),
                   collapsed.data_ptr<float>());
    return {post, comb, collapsed};
  }
  auto flat = sc.view({t, n * d}).to(at::kFloat);
  auto w = fn.to(at::kFloat);
  at::Tensor mixes;  // torch_ops.stream_mixes: fp32 scales the map's output, other dtypes its input
  if (sc.scalar_type() == at::kFloat) {
    auto sum_sq = at::linalg_vector_norm(flat, 2, {-1}, true).square_();
    mixes = at::mm(flat, w.t()).mul_(at::rsqrt(sum_sq.div_(n * d).add_(norm_eps)));
  } else {
    mixes = at::mm(flat * at::rsqrt(flat.square().mean({-1}, true) + norm_eps), w.t());
  }
  mixes = mixes.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sc.scalar_type(), "hc_pre", [&] {
    hc_rows<scalar_t>(sc.data_ptr<scalar_t>(), mixes.data_ptr<float>(), b.data_ptr<float>(),
                      s.data_ptr<float>(), t, n, d, iters, static_cast<float>(hc_eps),
                      post.data_ptr<float>(), comb.data_ptr<float>(), collapsed.data_ptr<scalar_t>());
  });
  return {post, comb, collapsed};
}

#if defined(__x86_64__)
// hc_post's sum over streams as an FMA chain from j = 0, the order in which MKL's sgemm forms
// baddbmm_ here (the loop is then bit-equal to the aten form on AVX2 machines).
DSV4_AVX2 void stream_sum_fma(const float* c, const float* st, int64_t n, int64_t k, int64_t d, float* y) {
  for (int64_t i = 0; i < d; ++i) y[i] = c[k] * st[i];
  for (int64_t j = 1; j < n; ++j)
    for (int64_t i = 0; i < d; ++i) y[i] = std::fma(c[j * n + k], st[j * d + i], y[i]);
}
#endif

// One new stream k of hc_post: y = post_k * out + sum_j comb[j, k] * streams_j, the sum first.
void hc_post_row(const float* c, const float* st, const float* o, float pk, int64_t n, int64_t k, int64_t d,
                 bool fma, float* y) {
#if defined(__x86_64__)
  if (fma) {
    stream_sum_fma(c, st, n, k, d, y);
  } else
#endif
  {
    for (int64_t i = 0; i < d; ++i) y[i] = c[k] * st[i];
    for (int64_t j = 1; j < n; ++j)
      for (int64_t i = 0; i < d; ++i) y[i] += c[j * n + k] * st[j * d + i];
  }
  // Two roundings, as the aten form (x86-64 baseline code has no FMA for gcc to contract this into).
  for (int64_t i = 0; i < d; ++i) y[i] = pk * o[i] + y[i];
}

// torch_ops.expand (TorchKernels.hc_post): new streams `post_k * out + sum_j comb[j, k] * streams_j`. fp32 [T, n, D] as
// loops (the comb sum first, then the spread added, as baddbmm_ onto the spread); otherwise the aten
// ops (fp32: the spread, then one in-place baddbmm; other dtypes HF's order: spread + matmul).
at::Tensor hc_post(const at::Tensor& post, const at::Tensor& comb, const at::Tensor& out,
                   const at::Tensor& streams) {
  const auto dtype = streams.scalar_type();
  if (dtype != at::kFloat)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + at::matmul(comb.to(dtype).transpose(-1, -2), streams);
  if (streams.dim() != 3 || post.dim() != 2 || comb.dim() != 3 || out.dim() != 2 ||
      post.scalar_type() != at::kFloat || comb.scalar_type() != at::kFloat || out.scalar_type() != at::kFloat)
    return at::mul(post.unsqueeze(-1), out.unsqueeze(-2)).baddbmm_(comb.transpose(-1, -2), streams);
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  TORCH_CHECK(post.size(0) == t && post.size(1) == n && comb.size(0) == t && comb.size(1) == n &&
              comb.size(2) == n && out.size(0) == t && out.size(1) == d, "hc_post: shape mismatch");
  auto pc = post.contiguous(), cc = comb.contiguous(), oc = out.contiguous(), sc = streams.contiguous();
  auto res = at::empty({t, n, d}, sc.options());
  const float *pp = pc.data_ptr<float>(), *cp = cc.data_ptr<float>(), *op = oc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* rp = res.data_ptr<float>();
#if defined(__x86_64__)
  const bool fma = skinny_supported();
#else
  const bool fma = false;
#endif
  for (int64_t r = 0; r < t; ++r)
    for (int64_t k = 0; k < n; ++k)
      hc_post_row(cp + r * n * n, sp + r * n * d, op + r * d, pp[r * n + k], n, k, d, fma, rp + (r * n + k) * d);
  return res;
}

// Whether dims 1.. of t are packed (its rows may sit at any stride).
bool rows_packed(const at::Tensor& t) {
  int64_t expect = 1;
  for (int64_t i = t.dim() - 1; i >= 1; --i) {
    if (t.size(i) != 1 && t.stride(i) != expect) return false;
    expect *= t.size(i);
  }
  return true;
}

// TorchKernels.masked_put: pool[slots] = rows where mask, else the sentinel (0) into slot 0. Rows
// of pool's dtype and shape are copied in a loop (rows in order: a later duplicate slot wins).
void masked_put(at::Tensor pool, const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& mask) {
  const bool direct = pool.dim() >= 1 && rows.dim() == pool.dim() && rows.scalar_type() == pool.scalar_type() &&
                      rows.sizes().slice(1) == pool.sizes().slice(1) && rows_packed(pool) &&
                      slots.dim() == 1 && mask.dim() == 1 && slots.size(0) == rows.size(0) &&
                      mask.size(0) == rows.size(0) && mask.scalar_type() == at::kBool &&
                      (slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt);
  if (!direct) {
    pool.index_put_({at::where(mask, slots, 0)}, at::where(mask.unsqueeze(1), rows.to(pool.scalar_type()), 0.0));
    return;
  }
  auto rc = rows.contiguous(), sc = slots.contiguous(), mc = mask.contiguous();
  const int64_t count = rc.size(0), size = pool.size(0);
  const int64_t bytes = (count ? rc.numel() / count : 0) * rc.element_size();
  const int64_t stride = pool.stride(0) * pool.element_size();
  char* dst = static_cast<char*>(pool.data_ptr());
  const char* src = static_cast<const char*>(rc.data_ptr());
  const bool* keep = mc.data_ptr<bool>();
  for (int64_t i = 0; i < count; ++i) {
    int64_t slot = 0;
    if (keep[i]) {
      slot = sc.scalar_type() == at::kLong ? sc.data_ptr<int64_t>()[i] : sc.data_ptr<int32_t>()[i];
      TORCH_CHECK(slot >= -size && slot < size, "masked_put: slot ", slot, " out of range for ", size, " rows");
      if (slot < 0) slot += size;
      std::memcpy(dst + slot * stride, src + i * bytes, bytes);
    } else {
      TORCH_CHECK(size > 0, "masked_put: no slot 0 for a masked row");
      std::memset(dst, 0, bytes);
    }
  }
}

// Expert ids of one row as torch.topk(values, k, sorted=False) on CPU (TopKImpl.h): the same
// (value, index) queue, comparator (NaN largest) and std algorithm, so ties and the order match.
void topk_ids(const float* values, int64_t e, int64_t k, std::vector<std::pair<float, int64_t>>& queue,
              int64_t* ids) {
  for (int64_t j = 0; j < e; ++j) queue[j] = {values[j], j};
  auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  if (k * 64 <= e)
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  else
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
  for (int64_t j = 0; j < k; ++j) ids[j] = queue[j].second;
}

// TorchKernels.route: (weights * scaling [T, k], expert ids [T, k]) from sqrt(softplus(x W^T)),
// ids by tid2eid (hash layers: `table` [V, k]) or the top-k of scores + bias (`table` [E]). fp32 runs
// as loops (x W^T by small_gemm below kSkinnyRows rows; softplus with torch's beta 1, threshold 20).
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& input_ids, const at::Tensor& weight,
                                         const at::Tensor& table, bool is_hash, int64_t top_k, double scaling) {
  const bool fp32 = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() == 2 &&
                    (is_hash ? table.dim() == 2 && table.size(1) == top_k &&
                                   (table.scalar_type() == at::kLong || table.scalar_type() == at::kInt) &&
                                   input_ids.dim() == 1 && input_ids.size(0) == x.size(0) &&
                                   input_ids.scalar_type() == at::kLong
                             : table.dim() == 1 && table.scalar_type() == at::kFloat);
  if (!fp32) {
    auto scores = at::softplus(at::linear(x, weight)).sqrt();
    auto ids = is_hash ? table.index_select(0, input_ids).to(at::kLong)
                       : std::get<1>(at::topk(scores + table, top_k, -1, true, false));
    auto w = scores.gather(1, ids);
    w = w / (w.sum(-1, true) + 1e-20);
    return {w * scaling, ids};
  }
  const int64_t t = x.size(0), e = weight.size(0), h = x.size(1);
  TORCH_CHECK(weight.size(1) == h && top_k >= 1 && top_k <= e, "route: bad shapes");
  TORCH_CHECK(is_hash || table.size(0) == e, "route: bias must have one entry per expert");
  auto xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor logits;
  std::vector<float> small;
  const float* lp;
  if (t < kSkinnyRows) {
    small.resize(t * e);
    std::vector<const float*> rows(t);
    for (int64_t r = 0; r < t; ++r) rows[r] = xc.data_ptr<float>() + r * h;
    small_gemm(rows.data(), t, wc.data_ptr<float>(), e, h, small.data(), e);
    lp = small.data();
  } else {
    logits = at::linear(xc, wc).contiguous();
    lp = logits.data_ptr<float>();
  }
  auto weights = at::empty({t, top_k}, xc.options());
  auto ids = at::empty({t, top_k}, xc.options().dtype(at::kLong));
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<float> scores(e), biased(e);
  std::vector<std::pair<float, int64_t>> queue(e);
  auto tc = table.contiguous(), ic = input_ids.contiguous();
  const float scale = static_cast<float>(scaling);
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t j = 0; j < e; ++j) {
      const float v = lp[r * e + j];
      scores[j] = std::sqrt(v > 20.f ? v : std::log1p(std::exp(v)));
    }
    int64_t* id = ip + r * top_k;
    if (is_hash) {
      const int64_t tok = ic.data_ptr<int64_t>()[r], vocab = tc.size(0);
      TORCH_CHECK(tok >= 0 && tok < vocab, "route: input id ", tok, " out of range");
      const int64_t row = tok * top_k;
      for (int64_t j = 0; j < top_k; ++j) {
        id[j] = tc.scalar_type() == at::kLong ? tc.data_ptr<int64_t>()[row + j] : tc.data_ptr<int32_t>()[row + j];
        TORCH_CHECK(id[j] >= 0 && id[j] < e, "route: expert id ", id[j], " out of range");
      }
    } else {
      const float* bias = tc.data_ptr<float>();
      for (int64_t j = 0; j < e; ++j) biased[j] = scores[j] + bias[j];
      topk_ids(biased.data(), e, top_k, queue, id);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < top_k; ++j) sum += scores[id[j]];
    const float denom = sum + 1e-20f;
    for (int64_t j = 0; j < top_k; ++j) wp[r * top_k + j] = scores[id[j]] / denom * scale;
  }
  return {weights, ids};
}

// TorchKernels.shared_expert, the packed gate/up projection: down(silu(gate <= limit) * clamp(up)).
// fp32: the two GEMMs as small_gemm below kSkinnyRows rows (else mm) and the activation in one loop.
// F.linear without bias: fp32 rows below kSkinnyRows by small_gemm (one pass over the weight, the
// next tile prefetched), otherwise at::linear. A decode step's projections are this shape, and
// MKL's sgemm streams a weight at half the bandwidth at a few rows.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t k = weight.size(1), n = weight.size(0);
  if (x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat || x.size(-1) != k || !x.is_contiguous() ||
      !weight.is_contiguous() || x.numel() / std::max<int64_t>(k, 1) >= kSkinnyRows)
    return at::linear(x, weight);
  const int64_t t = x.numel() / std::max<int64_t>(k, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  std::vector<const float*> rows(t);
  for (int64_t r = 0; r < t; ++r) rows[r] = x.data_ptr<float>() + r * k;
  small_gemm(rows.data(), t, weight.data_ptr<float>(), n, k, out.data_ptr<float>(), n);
  return out;
}

// attention.GroupedLinear: x [T, G, in] -> [T, G*R], group g through rows [g*R, (g+1)*R) of weight
// (the block-diagonal output projection); small_gemm per group under kSkinnyRows fp32 rows.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t t = x.size(0), groups = x.size(1), k = x.size(2), r = weight.size(0) / groups;
  TORCH_CHECK(x.dim() == 3 && weight.size(1) == k && r * groups == weight.size(0), "grouped_linear: bad shapes");
  if (x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat || !x.is_contiguous() ||
      !weight.is_contiguous() || t >= kSkinnyRows)
    return at::bmm(x.transpose(0, 1), weight.view({groups, r, k}).transpose(1, 2)).transpose(0, 1).flatten(1);
  auto out = at::empty({t, groups * r}, x.options());
  std::vector<const float*> rows(t);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = 0; i < t; ++i) rows[i] = x.data_ptr<float>() + (i * groups + g) * k;
    small_gemm(rows.data(), t, weight.data_ptr<float>() + g * r * k, r, k, out.data_ptr<float>() + g * r, groups * r);
  }
  return out;
}

at::Tensor shared_expert(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, double limit) {
  const bool fp32 = x.scalar_type() == at::kFloat && gate_up.scalar_type() == at::kFloat &&
                    down.scalar_type() == at::kFloat && x.dim() == 2;
  if (!fp32) {
    auto h = at::linear(x, gate_up);
    const int64_t inter = h.size(-1) / 2;
    auto act = at::silu(h.narrow(-1, 0, inter).clamp(c10::nullopt, limit)) *
               h.narrow(-1, inter, inter).clamp(-limit, limit);
    return at::linear(act, down);
  }
  const int64_t t = x.size(0), hidden = x.size(1), inter = gate_up.size(0) / 2, out_dim = down.size(0);
  TORCH_CHECK(gate_up.size(1) == hidden && down.size(1) == inter, "shared_expert: bad shapes");
  auto xc = x.contiguous(), gu = gate_up.contiguous(), dn = down.contiguous();
  auto h = at::empty({t, 2 * inter}, xc.options());
  auto out = at::empty({t, out_dim}, xc.options());
  const bool loops = t < kSkinnyRows;
  std::vector<const float*> rows(loops ? t : 0);
  if (loops) {
    for (int64_t r = 0; r < t; ++r) rows[r] = xc.data_ptr<float>() + r * hidden;
    small_gemm(rows.data(), t, gu.data_ptr<float>(), 2 * inter, hidden, h.data_ptr<float>(), 2 * inter);
  } else {
    at::mm_out(h, xc, gu.t());
  }
  const float lim = static_cast<float>(limit);
  float* hp = h.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {  // into the gate half, which the down projection reads in place
    float* hr = hp + r * 2 * inter;
    for (int64_t j = 0; j < inter; ++j) {
      const float gate = std::min(hr[j], lim), up = std::min(std::max(hr[inter + j], -lim), lim);
      hr[j] = gate / (1.f + std::exp(-gate)) * up;
    }
  }
  if (loops) {
    for (int64_t r = 0; r < t; ++r) rows[r] = hp + r * 2 * inter;
    small_gemm(rows.data(), t, dn.data_ptr<float>(), out_dim, inter, out.data_ptr<float>(), out_dim);
  } else {
    at::mm_out(out, h.narrow(1, 0, inter), dn.t());
  }
  return out;
}

// The (token, expert) pairs of `ids` [T, k] grouped by expert, in token order within each expert
// (a stable counting sort, as argsort(stable=True)): pairs `order[start[e]..start[e+1])` are expert e's.
// Id -1 marks a pair routed to another rank's expert (Experts.forward): it is skipped.
struct ExpertGroups {
  std::vector<int64_t> order, start;
};

ExpertGroups group_by_expert(const at::Tensor& ids, int64_t num_experts) {
  auto flat = ids.flatten().to(at::kLong).contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  const int64_t pairs = flat.numel();
  ExpertGroups g{std::vector<int64_t>(pairs), std::vector<int64_t>(num_experts + 1, 0)};
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= -1 && id[i] < num_experts, "moe_experts: expert id out of range");
    ++g.start[id[i] + 1];
  }
  g.start[0] = 0;  // the skipped pairs' count
  for (int64_t e = 0; e < num_experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t i = 0; i < pairs; ++i)
    if (id[i] >= 0) g.order[fill[id[i]]++] = i;
  return g;
}

// Any dtype: per expert in use, the aten ops of TorchKernels.routed_experts on its rows (bit-equal to it).
at::Tensor moe_experts_aten(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                            const ExpertGroups& g, int64_t k, const at::Tensor& weights, double limit) {
  const int64_t num_experts = gate_up.size(0), inter = down.size(2);
  auto out = at::zeros_like(x);
  auto order = at::tensor(g.order, x.options().dtype(at::kLong));
  auto tokens = at::floor_divide(order, k);
  auto flat_weights = weights.flatten().index_select(0, order);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = g.start[e + 1] - g.start[e];
    if (!count) continue;
    auto rows = tokens.narrow(0, g.start[e], count);
    auto h = at::linear(x.index_select(0, rows), gate_up[e]);
    auto gate = h.narrow(-1, 0, inter), up = h.narrow(-1, inter, inter);
    auto act = at::silu(gate.clamp_max(limit)) * up.clamp(-limit, limit);
    auto y = at::linear(act, down[e]);
    out.index_add_(0, rows, (y * flat_weights.narrow(0, g.start[e], count).unsqueeze(1)).to(out.scalar_type()));
  }
  return out;
}

// fp32 TorchKernels.routed_experts without the big gather and scatter: an expert's rows are copied into one
// buffer (BLAS) or read in place (skinny), and each weighted output row is added to its token's row in
// expert order, as index_add_ in the loop. The BLAS branch runs the loop's own ops (bit-equal to it);
// the skinny one sums in its own order (within fp32 rounding; a row's result there does not depend on
// the other rows).
at::Tensor moe_experts_f32(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                           const ExpertGroups& g, int64_t k, const at::Tensor& weights, double limit) {
  const int64_t num_experts = gate_up.size(0), inter = down.size(2), d = x.size(1);
  auto out = at::zeros_like(x);
  auto wts = weights.to(at::kFloat).contiguous();
  const float *xp = x.data_ptr<float>(), *wp = wts.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t most = 0;
  for (int64_t e = 0; e < num_experts; ++e) most = std::max(most, g.start[e + 1] - g.start[e]);
  auto xs = at::empty({most, d}, x.options());
  auto h = at::empty({most, 2 * inter}, x.options());
  auto y = at::empty({most, d}, x.options());
  std::vector<const float*> rows(most);
#if defined(__x86_64__)
  const bool skinny = skinny_supported();
  const float lim = static_cast<float>(limit);
#else
  const bool skinny = false;
#endif
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = g.start[e + 1] - g.start[e];
    if (!count) continue;
    const int64_t* pair = g.order.data() + g.start[e];
    if (skinny && count < kSkinnyRows) {
#if defined(__x86_64__)
      float* hp = h.data_ptr<float>();
      for (int64_t i = 0; i < count; ++i) rows[i] = xp + (pair[i] / k) * d;
      skinny_gemm(rows.data(), count, gate_up[e].data_ptr<float>(), 2 * inter, d, hp, 2 * inter);
      for (int64_t i = 0; i < count; ++i) {
        float* hr = hp + i * 2 * inter;
        for (int64_t j = 0; j < inter; ++j) {
          const float gate = std::min(hr[j], lim), up = std::min(std::max(hr[inter + j], -lim), lim);
          hr[j] = gate / (1.f + std::exp(-gate)) * up;
        }
        rows[i] = hr;
      }
      skinny_gemm(rows.data(), count, down[e].data_ptr<float>(), d, inter, y.data_ptr<float>(), d);
#endif
    } else {
      float* xsp = xs.data_ptr<float>();
      for (int64_t i = 0; i < count; ++i) std::copy_n(xp + (pair[i] / k) * d, d, xsp + i * d);
      auto hv = h.narrow(0, 0, count);
      at::mm_out(hv, xs.narrow(0, 0, count), gate_up[e].t());
      auto gate = hv.narrow(1, 0, inter);
      at::silu_(gate.clamp_max_(limit)).mul_(hv.narrow(1, inter, inter).clamp_(-limit, limit));
      auto yv = y.narrow(0, 0, count);
      at::mm_out(yv, gate, down[e].t());
    }
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) {
      float* o = op + (pair[i] / k) * d;
      const float* yr = yp + i * d;
      const float wt = wp[pair[i]];
      for (int64_t j = 0; j < d; ++j) o[j] += yr[j] * wt;
    }
  }
  return out;
}

// TorchKernels.routed_experts (kernels/torch_forms.py): x [T, D], gate_up [E, 2I, D], down [E, D, I], ids and
// weights [T, k]. fp32 takes moe_experts_f32; other dtypes run the loop's own aten ops (bit-equal).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                       const at::Tensor& ids, const at::Tensor& weights, double limit) {
  const auto groups = group_by_expert(ids, gate_up.size(0));
  const bool fp32 = x.scalar_type() == at::kFloat && gate_up.scalar_type() == at::kFloat &&
                    down.scalar_type() == at::kFloat;
  if (fp32 && x.dim() == 2 && x.is_contiguous() && gate_up.is_contiguous() && down.is_contiguous())
    return moe_experts_f32(x, gate_up, down, groups, ids.size(1), weights, limit);
  return moe_experts_aten(x, gate_up, down, groups, ids.size(1), weights, limit);
}

// TorchKernels.rms_norm (weight defined: fp32 weight * normalised fp32 row, cast once) or
// head_rms_norm (no weight: the fp32 scale cast to x's dtype, then the product in x's dtype).
template <typename T>
void rms_norm_rows(const T* x, const float* w, T* out, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) dsv4::rms_norm_row(x + r * d, w, out + r * d, d, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  at::Tensor w;
  if (weight.has_value()) {
    w = weight->to(at::kFloat).contiguous();
    TORCH_CHECK(w.numel() == d, "rms_norm: weight size ", w.numel(), " != ", d);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), w.defined() ? w.data_ptr<float>() : nullptr,
                            out.data_ptr<scalar_t>(), rows, d, static_cast<float>(eps));
  });
  return out;
}

// rope.rotate for x [B, ..., D] with cos/sin [B, R] (one row per batch row, broadcast over the middle
// dims): interleaved pairs of the trailing R channels rotated in fp32; `inverse` negates sin.
at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  auto xc = x.contiguous();
  auto c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  const int64_t b = x.size(0), d = x.size(-1), rd = c.size(-1);
  TORCH_CHECK(c.dim() == 2 && c.size(0) == b && rd <= d && rd % 2 == 0, "rope_rotate: cos must be [B, R]");
  const int64_t mid = b ? x.numel() / (b * d) : 0;
  auto out = at::empty_like(xc);
  const float sign = inverse ? -1.f : 1.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_rotate", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* cp = c.data_ptr<float>();
    const float* sp = s.data_ptr<float>();
    for (int64_t i = 0; i < b; ++i) {
      const float* ci = cp + i * rd;
      const float* si = sp + i * rd;
      for (int64_t m = 0; m < mid; ++m) {
        const scalar_t* xr = xp + (i * mid + m) * d;
        scalar_t* o = op + (i * mid + m) * d;
        for (int64_t j = 0; j < d - rd; ++j) o[j] = xr[j];
        dsv4::rotate_pairs(xr + d - rd, ci, si, sign, rd, o + d - rd);
      }
    }
  });
  return out;
}

// TorchKernels.sink_attention: softmax over [keys | sink] per head; q [B, H, D], keys [B, K, D], bias [B, K].
at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& bias,
                          const at::Tensor& sinks, double scaling) {
  auto logits = at::matmul(q, keys.transpose(1, 2)) * scaling + bias.unsqueeze(1).to(q.scalar_type());
  auto sink = sinks.view({1, -1, 1}).expand({q.size(0), -1, 1});
  logits = at::cat({logits, sink}, -1);  // sinks are fp32: promotes like the reference
  logits = logits - std::get<0>(logits.max(-1, true));
  auto probs = logits.softmax(-1).narrow(-1, 0, keys.size(1)).to(keys.scalar_type());
  return at::matmul(probs, keys);
}

// ---- decode metadata (attention/decode_fill.fill_decode_buffers, field for field) ----------------

// table[row, clamp(col)] of an int32 or int64 request table.
struct Table {
  const at::Tensor& t;
  int64_t at(int64_t row, int64_t col) const {
    col = std::min(std::max<int64_t>(col, 0), t.size(1) - 1);
    return t.scalar_type() == at::kInt ? t.data_ptr<int32_t>()[row * t.stride(0) + col]
                                       : t.data_ptr<int64_t>()[row * t.stride(0) + col];
  }
};

// Copy host values into a metadata buffer of any integer or bool dtype.
void put(const at::Tensor& dst, std::vector<int64_t>& values) {
  TORCH_CHECK(static_cast<int64_t>(values.size()) == dst.numel(), "fill_decode: buffer size mismatch");
  dst.copy_(at::from_blob(values.data(), dst.sizes(), at::TensorOptions().dtype(at::kLong)));
}

// The buffers fill_decode writes, by name. Python passes each list in the order fill_decode_fields()
// returns (attention/decode_fill.py reads the names from here), so the order is written once.
enum MainField { kReqIndices, kPrefixLens, kSeqLens, kExtendLens, kCuExtend, kPositions, kTokenReq,
                 kOutSwaLoc, kSwaSlots, kPageTable, kNumMain };
const char* const kMainNames[kNumMain] = {"req_indices", "prefix_lens", "seq_lens", "extend_lens",
                                          "cu_extend", "positions", "token_req", "out_swa_loc",
                                          "swa_slots", "page_table"};
enum CompressField { kBlockReq, kStateWriteToken, kBlockPositions, kBlockLoc, kBlockMask, kStateReadStart,
                     kStateReadLen, kStateReadSlots, kStateWritePos, kStateWriteLoc, kStateWriteMask,
                     kVisible, kNumCompress };
const char* const kCompressNames[kNumCompress] = {
    "block_req", "state_write_token", "block_positions", "block_loc", "block_mask", "state_read_start",
    "state_read_len", "state_read_slots", "state_write_pos", "state_write_loc", "state_write_mask",
    "visible"};

std::tuple<std::vector<std::string>, std::vector<std::string>> fill_decode_fields() {
  return {std::vector<std::string>(kMainNames, kMainNames + kNumMain),
          std::vector<std::string>(kCompressNames, kCompressNames + kNumCompress)};
}

// One slot per row (int64 [bucket]; 0, the sentinel slot, where the row writes nothing): the step's
// out-cache locations (attention/decode_fill.DecodeLocs), which say what the step writes and where.
std::vector<int64_t> slots_of(const at::Tensor& t, int64_t bs, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.numel() == bs, "fill_decode: ", what,
              " must be int64 [bucket]");
  auto c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + bs);
}

void fill_compress(at::TensorList out, const Table& state, int64_t ratio, const std::vector<int64_t>& block_loc,
                   const std::vector<int64_t>& state_loc, const std::vector<int64_t>& req,
                   const std::vector<int64_t>& pos, const std::vector<bool>& valid) {
  TORCH_CHECK(out.size() == kNumCompress, "fill_decode: ", kNumCompress, " buffers per compress ratio, got ",
              out.size());
  const int64_t bs = static_cast<int64_t>(req.size()), width = out[kStateReadSlots].size(1);
  std::vector<std::vector<int64_t>> f(kNumCompress);
  for (int64_t i = 0; i < kNumCompress; ++i) f[i].reserve(i == kStateReadSlots ? bs * width : bs);
  for (int64_t b = 0; b < bs; ++b) {
    const bool v = valid[b];
    const int64_t r = req[b], p = pos[b], seq = p + 1, block = p / ratio;
    const bool complete = block_loc[b] > 0, write = state_loc[b] > 0;
    const int64_t start = block * ratio - (ratio == 4 ? ratio : 0);  // c4 also reads the previous block
    f[kBlockReq].push_back(b);
    f[kStateWriteToken].push_back(b);
    f[kBlockPositions].push_back(v && complete ? block * ratio : 0);
    f[kBlockLoc].push_back(v ? block_loc[b] : 0);
    f[kBlockMask].push_back(v && complete);
    f[kStateReadStart].push_back(v ? start : 0);
    f[kStateReadLen].push_back(v ? p - start : 0);
    for (int64_t j = 0; j < width; ++j) {
      const int64_t col = start + j;
      f[kStateReadSlots].push_back(v && col >= 0 && col < p ? state.at(r, col) : 0);
    }
    f[kStateWritePos].push_back(v ? p : 0);
    f[kStateWriteLoc].push_back(v ? state_loc[b] : 0);
    f[kStateWriteMask].push_back(v && write);
    f[kVisible].push_back(v ? seq / ratio : 0);
  }
  for (int64_t i = 0; i < kNumCompress; ++i) put(out[i], f[i]);
}

void fill_decode(const at::Tensor& req_t, const at::Tensor& pos_t, const at::Tensor& valid_t,
                 const at::Tensor& swa_table, const at::Tensor& token_table,
                 const c10::optional<at::Tensor>& c4_state, const c10::optional<at::Tensor>& c128_state,
                 int64_t page_size, const at::Tensor& swa_loc, const at::Tensor& c4_loc,
                 const at::Tensor& c4_state_loc, const at::Tensor& c128_loc, const at::Tensor& c128_state_loc,
                 at::TensorList main, at::TensorList c4, at::TensorList c128) {
  TORCH_CHECK(main.size() == kNumMain, "fill_decode: ", kNumMain, " main buffers, got ", main.size());
  auto rq = req_t.to(at::kLong).contiguous(), ps = pos_t.to(at::kLong).contiguous();
  auto vd = valid_t.to(at::kBool).contiguous();
  const int64_t bs = rq.numel(), window = main[kSwaSlots].size(1), pages = main[kPageTable].size(1);
  std::vector<int64_t> req(bs), pos(bs);
  std::vector<bool> valid(bs);
  for (int64_t b = 0; b < bs; ++b) {
    valid[b] = vd.data_ptr<bool>()[b];
    req[b] = valid[b] ? rq.data_ptr<int64_t>()[b] : 0;
    pos[b] = valid[b] ? ps.data_ptr<int64_t>()[b] : 0;
  }
  const Table swa{swa_table}, tokens{token_table};
  const std::vector<int64_t> out_swa = slots_of(swa_loc, bs, "swa_loc");
  std::vector<std::vector<int64_t>> f(kNumMain);
  int64_t count = 0;
  f[kCuExtend].push_back(0);
  for (int64_t b = 0; b < bs; ++b) {
    const bool v = valid[b];
    const int64_t r = req[b], p = pos[b], seq = p + 1;
    f[kReqIndices].push_back(v ? r : 0);
    f[kPrefixLens].push_back(v ? p : 0);
    f[kSeqLens].push_back(v ? seq : 0);
    f[kExtendLens].push_back(v ? 1 : 0);
    count += v;
    f[kCuExtend].push_back(count);
    f[kPositions].push_back(v ? p : 0);
    f[kTokenReq].push_back(b);
    f[kOutSwaLoc].push_back(v ? out_swa[b] : 0);
    for (int64_t j = 0; j < window; ++j) {  // oldest first, -1 before position 0
      const int64_t key = p - (window - 1 - j);
      f[kSwaSlots].push_back(v && key >= 0 ? swa.at(r, key) : -1);
    }
    const int64_t held = (seq + page_size - 1) / page_size;
    for (int64_t i = 0; i < pages; ++i)
      f[kPageTable].push_back(v && i < held ? tokens.at(r, i * page_size) / page_size : 0);
  }
  for (int64_t i = 0; i < kNumMain; ++i) put(main[i], f[i]);
  if (!c4.empty())
    fill_compress(c4, Table{*c4_state}, 4, slots_of(c4_loc, bs, "c4_loc"), slots_of(c4_state_loc, bs, "c4_state_loc"),
                  req, pos, valid);
  if (!c128.empty())
    fill_compress(c128, Table{*c128_state}, 128, slots_of(c128_loc, bs, "c128_loc"),
                  slots_of(c128_state_loc, bs, "c128_state_loc"), req, pos, valid);
}

}  // namespace

TORCH_LIBRARY(dsv4, m) {
  m.def("fill_decode(Tensor req, Tensor pos, Tensor valid, Tensor swa_table, Tensor token_table, "
        "Tensor? c4_state, Tensor? c128_state, int page_size, Tensor swa_loc, Tensor c4_loc, "
        "Tensor c4_state_loc, Tensor c128_loc, Tensor c128_state_loc, Tensor(a!)[] main, Tensor(b!)[] c4, "
        "Tensor(c!)[] c128) -> ()");
  m.def("fill_decode_fields() -> (str[], str[])", &fill_decode_fields);
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("sink_attention(Tensor q, Tensor keys, Tensor bias, Tensor sinks, float scaling) -> Tensor");
  m.def("rope_rotate(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
  m.def("hc_pre(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, "
        "float norm_eps) -> (Tensor, Tensor, Tensor)");
  m.def("moe_experts(Tensor x, Tensor gate_up, Tensor down, Tensor ids, Tensor weights, float limit) "
        "-> Tensor");
  m.def("hc_post(Tensor post, Tensor comb, Tensor out, Tensor streams) -> Tensor");
  m.def("masked_put(Tensor(a!) pool, Tensor slots, Tensor rows, Tensor mask) -> ()");
  m.def("route(Tensor x, Tensor input_ids, Tensor weight, Tensor table, bool is_hash, int top_k, "
        "float scaling) -> (Tensor, Tensor)");
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.def("grouped_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("shared_expert(Tensor x, Tensor gate_up, Tensor down, float limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("fill_decode", &fill_decode);
  m.impl("rms_norm", &rms_norm);
  m.impl("sink_attention", &sink_attention);
  m.impl("rope_rotate", &rope_rotate);
  m.impl("hc_pre", &hc_pre);
  m.impl("moe_experts", &moe_experts);
  m.impl("hc_post", &hc_post);
  m.impl("masked_put", &masked_put);
  m.impl("route", &route);
  m.impl("linear", &linear);
  m.impl("grouped_linear", &grouped_linear);
  m.impl("shared_expert", &shared_expert);
}
