// Decode attention over the paged pools as plain loops, registered as `dsv4::*` beside cpu.cpp's.
//
// The torch form of a decode layer's attention (kernels/torch_forms.py, TorchKernels: compress_paged,
// index_topk, paged_attention) gathers keys and state rows into temporaries, masks, concatenates and
// sorts: ~50 small ops a layer, each ~5-20 us of dispatch on a CPU whatever its size. These kernels
// read the pools in place through the step's slots, one call per concern, fp32 only (the CPU kernel
// set, kernels/cpu.py, falls back to the torch form for other dtypes). Each is tested against its
// torch form.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "rows.h"
#include "simd.h"

#include <algorithm>
#include <initializer_list>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// An integer (or bool) tensor of up to 2 dims read in place, strides honoured (metadata buffers are
// int64 and bool, page tables int32 and sliced to the step's pages).
struct Ints {
  const void* data;
  at::ScalarType dtype;
  int64_t s0, s1;
  explicit Ints(const at::Tensor& t)
      : data(t.data_ptr()), dtype(t.scalar_type()), s0(t.dim() ? t.stride(0) : 0), s1(t.dim() > 1 ? t.stride(1) : 0) {
    TORCH_CHECK(dtype == at::kLong || dtype == at::kInt || dtype == at::kBool, "expected an integer tensor");
  }
  int64_t at(int64_t i, int64_t j = 0) const {
    const int64_t k = i * s0 + j * s1;
    switch (dtype) {
      case at::kInt: return static_cast<const int32_t*>(data)[k];
      case at::kBool: return static_cast<const bool*>(data)[k];
      default: return static_cast<const int64_t*>(data)[k];
    }
  }
  int64_t operator[](int64_t i) const { return at(i); }
};

// ---- inner loops: q . key for every head, and sum_j p_j key_j --------------------------------
// At a 64-request step the attention is ~0.2 GFLOP, so these run at AVX2+FMA width where the CPU has
// it (checked once at run time); the scalar forms are the fallback and the definition.

void head_dots_scalar(const float* q, int64_t heads, const float* key, int64_t d, float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * d;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int64_t i = 0;
    for (; i + 4 <= d; i += 4) {
      s0 += qh[i] * key[i];
      s1 += qh[i + 1] * key[i + 1];
      s2 += qh[i + 2] * key[i + 2];
      s3 += qh[i + 3] * key[i + 3];
    }
    for (; i < d; ++i) s0 += qh[i] * key[i];
    out[h] = (s0 + s1) + (s2 + s3);
  }
}

// out[i] = sum_j p[j * stride] * keys[j][i]
void weighted_sum_scalar(const float* const* keys, const float* p, int64_t stride, int64_t m, int64_t d,
                         float* out) {
  std::fill(out, out + d, 0.f);
  for (int64_t j = 0; j < m; ++j) {
    const float pj = p[j * stride];
    const float* key = keys[j];
    for (int64_t i = 0; i < d; ++i) out[i] += pj * key[i];
  }
}

#if defined(__x86_64__)

// HB heads at once: each key vector is loaded once for all of them.
template <int HB>
DSV4_AVX2 void head_dots_block(const float* q, const float* key, int64_t d, float* out) {
  __m256 acc[HB];
  for (int h = 0; h < HB; ++h) acc[h] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 k = _mm256_loadu_ps(key + i);
    for (int h = 0; h < HB; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), k, acc[h]);
  }
  for (int h = 0; h < HB; ++h) out[h] = dsv4::hsum(acc[h]);
}

DSV4_AVX2 void head_dots_avx2(const float* q, int64_t heads, const float* key, int64_t d, float* out) {
  int64_t h = 0;
  for (; h + 8 <= heads; h += 8) head_dots_block<8>(q + h * d, key, d, out + h);
  for (; h + 2 <= heads; h += 2) head_dots_block<2>(q + h * d, key, d, out + h);
  for (; h < heads; ++h) head_dots_block<1>(q + h * d, key, d, out + h);
}

DSV4_AVX2 void weighted_sum_avx2(const float* const* keys, const float* p, int64_t stride, int64_t m, int64_t d,
                                 float* out) {
  int64_t i = 0;
  for (; i + 64 <= d; i += 64) {  // 8 accumulators: one load and one FMA per 8 products
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j * stride]);
      const float* key = keys[j] + i;
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(key + 8 * u), acc[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + i + 8 * u, acc[u]);
  }
  for (; i < d; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j * stride]), _mm256_loadu_ps(keys[j] + i), acc);
    _mm256_storeu_ps(out + i, acc);
  }
}
#endif

struct Loops {
  void (*head_dots)(const float*, int64_t, const float*, int64_t, float*);
  void (*weighted_sum)(const float* const*, const float*, int64_t, int64_t, int64_t, float*);
};

// The AVX2 forms need d % 8 == 0 (every DSV4 head width is).
Loops loops_for(int64_t d) {
#if defined(__x86_64__)
  if (dsv4::has_avx2_fma() && d % 8 == 0) return {head_dots_avx2, weighted_sum_avx2};
#endif
  return {head_dots_scalar, weighted_sum_scalar};
}

void check_f32(const char* what, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), what, ": tensors must be contiguous fp32");
}

// The compressed row of slot j of ratio r: page_table[b, j / (P/r)] * (P/r) + j % (P/r).
struct RowSlots {
  Ints table;
  int64_t per_page;
  int64_t at(int64_t b, int64_t row) const { return table.at(b, row / per_page) * per_page + row % per_page; }
};

// TorchKernels.compress_paged: advance one compressor by the decode token of each row. The token's state row
// [kv | gate + position_bias[pos % r]] goes to `write_loc` where `write_mask` (else the sentinel,
// kv 0 / score -inf, to slot 0); where `block_mask`, the window of coff*r state rows (the token's own
// in its column) is softmax-pooled per channel, RMS-normed, RoPE'd at the block's position and
// written to `rows[block_loc]`.
void compress_decode(const at::Tensor& kv, const at::Tensor& gate, const at::Tensor& position_bias,
                     const at::Tensor& positions, const at::Tensor& write_mask, const at::Tensor& write_loc,
                     const at::Tensor& read_start, const at::Tensor& read_slots, const at::Tensor& block_mask,
                     const at::Tensor& block_loc, const at::Tensor& block_positions, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& norm_weight, double norm_eps, at::Tensor state,
                     at::Tensor rows) {
  check_f32("compress_decode", {&position_bias, &cos, &sin, &norm_weight, &state, &rows});
  TORCH_CHECK(kv.scalar_type() == at::kFloat && gate.scalar_type() == at::kFloat && kv.stride(1) == 1 &&
                  gate.stride(1) == 1, "compress_decode: kv and gate must be fp32 rows");  // views of one GEMM
  const int64_t bsz = kv.size(0), half = kv.size(1), ratio = position_bias.size(0);
  const int64_t d = rows.size(1), coff = half / d, width = read_slots.size(1), rd = cos.size(1);
  TORCH_CHECK(coff * d == half && state.size(1) == 2 * half && width == coff * ratio && rd <= d,
              "compress_decode: shapes");
  const Ints pos(positions), wmask(write_mask), wloc(write_loc), start(read_start), slots(read_slots);
  const Ints bmask(block_mask), bloc(block_loc), bpos(block_positions);
  const int64_t ks = kv.stride(0), gs = gate.stride(0);
  const float *kvp = kv.data_ptr<float>(), *gp = gate.data_ptr<float>(), *pb = position_bias.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>(), *nw = norm_weight.data_ptr<float>();
  float *st = state.data_ptr<float>(), *out = rows.data_ptr<float>();
  std::vector<float> own(2 * half), pooled(d), mx(d), sum(d), e(width * d);
  std::vector<const float*> win(width);
  for (int64_t b = 0; b < bsz; ++b) {
    const int64_t p = pos[b];
    const float* bias = pb + (p % ratio) * half;
    for (int64_t i = 0; i < half; ++i) {
      own[i] = kvp[b * ks + i];
      own[half + i] = gp[b * gs + i] + bias[i];
    }
    if (wmask[b]) {
      std::copy(own.begin(), own.end(), st + wloc[b] * 2 * half);
    } else {
      std::fill(st, st + half, 0.f);
      std::fill(st + half, st + 2 * half, kNegInf);
    }
    if (!bmask[b]) continue;
    for (int64_t c = 0; c < width; ++c)
      win[c] = c == p - start[b] ? own.data() : st + slots.at(b, c) * 2 * half;
    // Column c's kv and score for channel i: at ratio 4 (coff 2) the older block gives its first
    // half, the newer its second.
    auto offset = [&](int64_t c) { return coff == 2 && c >= ratio ? d : 0; };
    std::fill(mx.begin(), mx.end(), kNegInf);
    for (int64_t c = 0; c < width; ++c) {
      const float* s = win[c] + half + offset(c);
      for (int64_t i = 0; i < d; ++i) mx[i] = std::max(mx[i], s[i]);
    }
    std::fill(sum.begin(), sum.end(), 0.f);
    for (int64_t c = 0; c < width; ++c) {
      const float* s = win[c] + half + offset(c);
      float* ec = e.data() + c * d;
      for (int64_t i = 0; i < d; ++i) sum[i] += (ec[i] = std::exp(s[i] - mx[i]));
    }
    std::fill(pooled.begin(), pooled.end(), 0.f);
    for (int64_t c = 0; c < width; ++c) {
      const float *v = win[c] + offset(c), *ec = e.data() + c * d;
      for (int64_t i = 0; i < d; ++i) pooled[i] += v[i] * (ec[i] / sum[i]);
    }
    float* o = out + bloc[b] * d;
    dsv4::rms_norm_row(pooled.data(), nw, o, d, static_cast<float>(norm_eps));
    dsv4::rotate_pairs(o + d - rd, cp + bpos[b] * rd, sp + bpos[b] * rd, 1.f, rd, o + d - rd);
  }
}

// One query row's sink attention, every head: softmax over [keys | sink] of q_h . key * scale (+ bias
// per key where given), then the probability-weighted sum of the keys (K = V) into out [heads, d].
void attend_row(const Loops& loops, const float* q, int64_t heads, int64_t d, const std::vector<const float*>& keys,
                const float* key_bias, const float* sinks, float scale, std::vector<float>& logits, float* out) {
  const int64_t m = static_cast<int64_t>(keys.size());
  logits.resize(m * heads);  // [m, heads]
  for (int64_t j = 0; j < m; ++j) loops.head_dots(q, heads, keys[j], d, &logits[j * heads]);
  for (int64_t h = 0; h < heads; ++h) {
    float* l = logits.data() + h;
    float mx = sinks[h];
    for (int64_t j = 0; j < m; ++j) {
      l[j * heads] *= scale;
      if (key_bias != nullptr) l[j * heads] += key_bias[j];
      mx = std::max(mx, l[j * heads]);
    }
    float denom = std::exp(sinks[h] - mx);
    for (int64_t j = 0; j < m; ++j) denom += (l[j * heads] = std::exp(l[j * heads] - mx));
    for (int64_t j = 0; j < m; ++j) l[j * heads] /= denom;
    loops.weighted_sum(keys.data(), l, heads, m, d, out + h * d);
  }
}

// TorchKernels.index_topk: per row, the top-k compressed rows by sum_h w_h * relu(q_h . key_j) * scale
// over rows j < visible, ties to the lower row; every visible row when there are at most k. Rows
// [B, k] int64, -1 where fewer than k are visible.
at::Tensor index_topk(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& keys,
                      const at::Tensor& page_table, const at::Tensor& visible, int64_t ratio, int64_t page_size,
                      double softmax_scale, int64_t k) {
  check_f32("index_topk", {&q, &weights, &keys});
  const int64_t bsz = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(keys.size(1) == d && weights.size(1) == heads, "index_topk: shapes");
  const RowSlots slot{Ints(page_table), page_size / ratio};
  const Ints vis(visible);
  auto picked = at::full({bsz, k}, -1, at::TensorOptions().dtype(at::kLong));
  int64_t* out = picked.data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *wp = weights.data_ptr<float>(), *kp = keys.data_ptr<float>();
  const float scale = static_cast<float>(softmax_scale);
  const Loops loops = loops_for(d);
  std::vector<float> score, dots(heads);
  std::vector<int64_t> order;
  for (int64_t b = 0; b < bsz; ++b) {
    const int64_t n = vis[b];
    int64_t* o = out + b * k;
    if (n <= k) {
      std::iota(o, o + n, 0);
      continue;
    }
    score.assign(n, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      loops.head_dots(qp + b * heads * d, heads, kp + slot.at(b, j) * d, d, dots.data());
      float s = 0.f;
      for (int64_t h = 0; h < heads; ++h) s += std::max(dots[h], 0.f) * scale * wp[b * heads + h];
      score[j] = s;
    }
    order.resize(n);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t x, int64_t y) {
      return score[x] > score[y] || (score[x] == score[y] && x < y);
    });
    std::copy(order.begin(), order.begin() + k, o);
  }
  return picked;
}

// TorchKernels.index_bias's selection, on scores it computed: per query row, 0 on the top-k of
// scores[i, j] over rows j < visible[i] (ties to the lower row; every visible row when at most k), -inf
// elsewhere. Selection only, no arithmetic, so the picks are the torch form's, in one pass per row (a
// stable sort of every whole row was ~15% of a prefill step resuming 2k cached tokens, 4x this).
at::Tensor topk_bias(const at::Tensor& scores, const at::Tensor& visible, int64_t k) {
  check_f32("topk_bias", {&scores});
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous(), "topk_bias: scores must be a contiguous [n, N]");
  TORCH_CHECK(visible.dim() == 1 && visible.size(0) == scores.size(0), "topk_bias: visible must be [n]");
  TORCH_CHECK(k > 0, "topk_bias: k must be positive");
  const int64_t n = scores.size(0), width = scores.size(1);
  auto bias = at::full({n, width}, kNegInf, scores.options());
  const float* sp = scores.data_ptr<float>();
  float* bp = bias.data_ptr<float>();
  const Ints vis(visible);
  // One pass per row over a heap of the best k so far, its worst on top: a later row displaces it
  // only with a strictly greater score (on a tie the earlier row ranks first).
  const auto ranks_before = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<std::pair<float, int64_t>> best;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t m = std::min(std::max<int64_t>(vis[i], 0), width);
    float* row = bp + i * width;
    if (m <= k) {
      std::fill(row, row + m, 0.f);
      continue;
    }
    const float* s = sp + i * width;
    best.clear();
    for (int64_t j = 0; j < k; ++j) best.emplace_back(s[j], j);
    std::make_heap(best.begin(), best.end(), ranks_before);
    for (int64_t j = k; j < m; ++j) {
      if (s[j] > best.front().first) {
        std::pop_heap(best.begin(), best.end(), ranks_before);
        best.back() = {s[j], j};
        std::push_heap(best.begin(), best.end(), ranks_before);
      }
    }
    for (const auto& [score, j] : best) row[j] = 0.f;
  }
  return bias;
}

// TorchKernels.paged_attention: per row and head, softmax over [window | compressed | sink] of q . key *
// scaling, and the probability-weighted sum of the keys (K = V). Window keys are `swa[swa_slots]`
// (-1 masked); compressed keys are rows `comp_rows` (or 0..visible-1 when absent) of `comp`, through
// the page table; rows outside [0, visible) are ignored.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& swa, const at::Tensor& swa_slots,
                           const c10::optional<at::Tensor>& comp, const at::Tensor& page_table,
                           const c10::optional<at::Tensor>& comp_rows, const c10::optional<at::Tensor>& visible, int64_t ratio,
                           int64_t page_size, const at::Tensor& sinks, double scaling) {
  check_f32("paged_attention", {&q, &swa, &sinks});
  const int64_t bsz = q.size(0), heads = q.size(1), d = q.size(2), window = swa_slots.size(1);
  TORCH_CHECK(swa.size(1) == d && sinks.numel() == heads, "paged_attention: shapes");
  if (comp) check_f32("paged_attention", {&*comp});
  TORCH_CHECK(!comp || visible, "paged_attention: compressed keys need `visible`");
  auto out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *sw = swa.data_ptr<float>(), *sk = sinks.data_ptr<float>();
  const float* cp = comp ? comp->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const Ints wslots(swa_slots), vis(visible ? *visible : swa_slots);
  const RowSlots slot{Ints(page_table), page_size / std::max<int64_t>(ratio, 1)};
  const bool listed = comp_rows.has_value();
  const Ints crow(listed ? *comp_rows : swa_slots);
  const int64_t width = listed ? comp_rows->size(1) : 0;
  const float scale = static_cast<float>(scaling);
  const Loops loops = loops_for(d);
  std::vector<const float*> keys;
  std::vector<float> logits;
  for (int64_t b = 0; b < bsz; ++b) {
    keys.clear();
    for (int64_t j = 0; j < window; ++j)
      if (const int64_t s = wslots.at(b, j); s >= 0) keys.push_back(sw + s * d);
    if (cp) {
      const int64_t n = vis[b], count = listed ? width : n;
      for (int64_t j = 0; j < count; ++j)
        if (const int64_t row = listed ? crow.at(b, j) : j; row >= 0 && row < n)
          keys.push_back(cp + slot.at(b, row) * d);
    }
    attend_row(loops, qp + b * heads * d, heads, d, keys, nullptr, sk, scale, logits, op + b * heads * d);
  }
  return out;
}

// TorchKernels.block_attention: each query of a block over its block's keys with a finite bias (the
// extend step's masks are 0 / -inf, and an indexer's picks leave a handful of a C4 layer's compressed
// rows), as `paged_attention` reads a decode row's; the dense products it replaces computed every
// masked key too. q [nb, b, H, D], keys [nb, K, D], bias [nb, b, K]; out [nb * b, H, D].
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& bias,
                           const at::Tensor& sinks, double scaling) {
  check_f32("block_attention", {&q, &keys, &bias, &sinks});
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 3 && bias.dim() == 3, "block_attention: shapes");
  const int64_t nb = q.size(0), b = q.size(1), heads = q.size(2), d = q.size(3), width = keys.size(1);
  TORCH_CHECK(keys.size(0) == nb && keys.size(2) == d && sinks.numel() == heads, "block_attention: shapes");
  TORCH_CHECK(bias.size(0) == nb && bias.size(1) == b && bias.size(2) == width, "block_attention: bias shape");
  auto out = at::empty({nb * b, heads, d}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *bp = bias.data_ptr<float>();
  const float* sk = sinks.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const Loops loops = loops_for(d);
  std::vector<const float*> picked;
  std::vector<float> picked_bias, logits;
  for (int64_t r = 0; r < nb * b; ++r) {
    const float* row_bias = bp + r * width;
    const float* block_keys = kp + (r / b) * width * d;
    picked.clear();
    picked_bias.clear();
    for (int64_t j = 0; j < width; ++j) {
      if (row_bias[j] == kNegInf) continue;
      picked.push_back(block_keys + j * d);
      picked_bias.push_back(row_bias[j]);
    }
    attend_row(loops, qp + r * heads * d, heads, d, picked, picked_bias.data(), sk, scale, logits,
               op + r * heads * d);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv4, m) {
  m.def("compress_decode(Tensor kv, Tensor gate, Tensor position_bias, Tensor positions, Tensor write_mask, "
        "Tensor write_loc, Tensor read_start, Tensor read_slots, Tensor block_mask, Tensor block_loc, "
        "Tensor block_positions, Tensor cos, Tensor sin, Tensor norm_weight, float norm_eps, "
        "Tensor(a!) state, Tensor(b!) rows) -> ()");
  m.def("index_topk(Tensor q, Tensor weights, Tensor keys, Tensor page_table, Tensor visible, int ratio, "
        "int page_size, float softmax_scale, int k) -> Tensor");
  m.def("topk_bias(Tensor scores, Tensor visible, int k) -> Tensor");
  m.def("block_attention(Tensor q, Tensor keys, Tensor bias, Tensor sinks, float scaling) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor swa, Tensor swa_slots, Tensor? comp, Tensor page_table, "
        "Tensor? comp_rows, Tensor? visible, int ratio, int page_size, Tensor sinks, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("compress_decode", &compress_decode);
  m.impl("index_topk", &index_topk);
  m.impl("topk_bias", &topk_bias);
  m.impl("block_attention", &block_attention);
  m.impl("paged_attention", &paged_attention);
}
