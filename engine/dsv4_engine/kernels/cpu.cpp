// Fused CPU kernels for the decode step, registered as torch ops `dsv4::*`.
//
// Eager torch pays a Python dispatch (~5-10 us here) per op; the mHC Sinkhorn alone is ~80 ops and
// the per-expert MoE loop ~10 ops per expert in use. These kernels run the same aten sequences from
// C++ (one Python dispatch each) and the 4x4 Sinkhorn as plain loops. Each mirrors a torch function
// in dsv4_engine.model (named at each kernel) and is tested against it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Dispatch.h>

#include <algorithm>
#include <limits>
#include <cmath>
#include <vector>

namespace {

// Sinkhorn-Knopp on [M, n, n] fp32 in place: columns, then (rows, columns) iters - 1 times,
// each dividing by (sum + eps), as HyperConnection.forward.
void sinkhorn_(at::Tensor& comb, int64_t iters, double eps) {
  TORCH_CHECK(comb.scalar_type() == at::kFloat && comb.is_contiguous(), "sinkhorn: contiguous fp32");
  const int64_t n = comb.size(-1);
  const int64_t m = comb.numel() / (n * n);
  const float e = static_cast<float>(eps);
  float* p = comb.data_ptr<float>();
  std::vector<float> sums(n);
  auto columns = [&](float* c) {
    for (int64_t j = 0; j < n; ++j) {
      float s = 0.f;
      for (int64_t i = 0; i < n; ++i) s += c[i * n + j];
      sums[j] = s + e;
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * n + j] /= sums[j];
  };
  auto rows = [&](float* c) {
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < n; ++j) s += c[i * n + j];
      s += e;
      for (int64_t j = 0; j < n; ++j) c[i * n + j] /= s;
    }
  };
  for (int64_t b = 0; b < m; ++b) {
    float* c = p + b * n * n;
    columns(c);
    for (int64_t it = 1; it < iters; ++it) {
      rows(c);
      columns(c);
    }
  }
}

// HyperConnection.forward: (post [T, n], comb [T, n, n], collapsed [T, D]) for streams [T, n, D].
// The map's GEMM goes to BLAS; everything after it is per-row loops (a few hundred flops a row).
// fp32 streams scale the GEMM's output by the row's RMS factor, other dtypes scale its input, as
// hyper.stream_mixes does.
template <typename T>
void hc_rows(const T* streams, const float* mixes, const float* base, const float* scale, int64_t t,
             int64_t n, int64_t d, int64_t iters, float hc_eps, float* post, float* comb, T* collapsed) {
  const int64_t width = (2 + n) * n;
  std::vector<float> pre(n);
  for (int64_t r = 0; r < t; ++r) {
    const float* m = mixes + r * width;
    float* po = post + r * n;
    float* c = comb + r * n * n;
    for (int64_t i = 0; i < n; ++i) {
      pre[i] = 1.f / (1.f + std::exp(-(m[i] * scale[0] + base[i]))) + hc_eps;
      po[i] = 2.f / (1.f + std::exp(-(m[n + i] * scale[1] + base[n + i])));
    }
    for (int64_t i = 0; i < n; ++i) {  // softmax over each row of the n x n logits, then + eps
      const float* l = m + 2 * n + i * n;
      const float* bb = base + 2 * n + i * n;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, l[j] * scale[2] + bb[j]);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) sum += (c[i * n + j] = std::exp(l[j] * scale[2] + bb[j] - mx));
      for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / sum + hc_eps;
    }
    const T* st = streams + r * n * d;
    T* out = collapsed + r * d;
    for (int64_t k = 0; k < d; ++k) {
      float acc = 0.f;
      for (int64_t i = 0; i < n; ++i) acc += pre[i] * static_cast<float>(st[i * d + k]);
      out[k] = static_cast<T>(acc);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(
    const at::Tensor& streams, const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale,
    int64_t iters, double hc_eps, double norm_eps) {
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  auto sc = streams.contiguous();
  auto flat = sc.view({t, n * d}).to(at::kFloat);
  auto inv_rms = at::rsqrt(flat.square().mean({-1}, true) + norm_eps);
  auto w = fn.to(at::kFloat);
  auto mixes = sc.scalar_type() == at::kFloat ? at::mm(flat, w.t()) * inv_rms : at::mm(flat * inv_rms, w.t());
  mixes = mixes.contiguous();
  auto b = base.to(at::kFloat).contiguous(), s = scale.to(at::kFloat).contiguous();
  auto post = at::empty({t, n}, flat.options());
  auto comb = at::empty({t, n, n}, flat.options());
  auto collapsed = at::empty({t, d}, sc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sc.scalar_type(), "hc_pre", [&] {
    hc_rows<scalar_t>(sc.data_ptr<scalar_t>(), mixes.data_ptr<float>(), b.data_ptr<float>(),
                      s.data_ptr<float>(), t, n, d, iters, static_cast<float>(hc_eps),
                      post.data_ptr<float>(), comb.data_ptr<float>(), collapsed.data_ptr<scalar_t>());
  });
  sinkhorn_(comb, iters, hc_eps);
  return {post, comb, collapsed};
}

// model.hyper.expand: post_k * out + sum_j comb[j, k] * streams_j.
at::Tensor hc_post(const at::Tensor& post, const at::Tensor& comb, const at::Tensor& out,
                   const at::Tensor& streams) {
  const auto dtype = streams.scalar_type();
  return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) +
         at::matmul(comb.to(dtype).transpose(-1, -2), streams);
}

// Experts.forward: routed experts grouped by expert (one gather, two GEMMs, one index_add each),
// in the same expert order, so the result equals the torch loop; the output shape is static.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                       const at::Tensor& ids, const at::Tensor& weights, double limit) {
  const int64_t num_experts = gate_up.size(0), k = ids.size(1), inter = down.size(2);
  auto out = at::zeros_like(x);
  auto flat = ids.flatten().to(at::kLong).contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  const int64_t pairs = flat.numel();
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, "moe_experts: expert id out of range");
    ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  // Stable counting sort: pairs of each expert in token order, as argsort(stable=True).
  auto order = at::empty({pairs}, flat.options());
  int64_t* ord = order.data_ptr<int64_t>();
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) ord[fill[id[i]]++] = i;
  auto tokens = at::floor_divide(order, k);
  auto flat_weights = weights.flatten().index_select(0, order);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (!count) continue;
    auto rows = tokens.narrow(0, start[e], count);
    auto h = at::linear(x.index_select(0, rows), gate_up[e]);
    auto gate = h.narrow(-1, 0, inter), up = h.narrow(-1, inter, inter);
    auto act = at::silu(gate.clamp_max(limit)) * up.clamp(-limit, limit);
    auto y = at::linear(act, down[e]);
    out.index_add_(0, rows, (y * flat_weights.narrow(0, start[e], count).unsqueeze(1)).to(out.scalar_type()));
  }
  return out;
}

// RMSNorm (weight defined: fp32 weight * normalised fp32 row, cast once, as ops.RMSNorm) or
// unweighted_rms_norm (no weight: the fp32 scale cast to x's dtype, then the product in x's dtype).
template <typename T>
void rms_norm_rows(const T* x, const float* w, T* out, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    T* o = out + r * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) {
      const float v = static_cast<float>(xr[i]);
      ss += v * v;
    }
    const float scale = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    if (w) {
      for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(w[i] * (static_cast<float>(xr[i]) * scale));
    } else {
      const float s = static_cast<float>(static_cast<T>(scale));
      for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(static_cast<float>(xr[i]) * s);
    }
  }
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
        const scalar_t* xq = xr + d - rd;
        scalar_t* oq = o + d - rd;
        for (int64_t j = 0; j < rd; j += 2) {
          const float a = static_cast<float>(xq[j]), e = static_cast<float>(xq[j + 1]);
          const float s0 = sign * si[j], s1 = sign * si[j + 1];
          const float p0 = a * ci[j], q0 = -e * s0;  // (rope * cos) + (swapped * sin), two roundings
          const float p1 = e * ci[j + 1], q1 = a * s1;
          oq[j] = static_cast<scalar_t>(p0 + q0);
          oq[j + 1] = static_cast<scalar_t>(p1 + q1);
        }
      }
    }
  });
  return out;
}

// paged_decode._attend: softmax over [keys | sink] per head; q [B, H, D], keys [B, K, D], bias [B, K].
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

void fill_compress(const std::vector<at::Tensor>& out, const Table& state, const Table& rows, int64_t ratio,
                   int64_t tail_block, const std::vector<int64_t>& req, const std::vector<int64_t>& pos,
                   const std::vector<bool>& valid) {
  const int64_t bs = static_cast<int64_t>(req.size()), width = out[7].size(1);
  std::vector<std::vector<int64_t>> f(12);
  for (int64_t i = 0; i < 12; ++i) f[i].reserve(i == 7 ? bs * width : bs);
  for (int64_t b = 0; b < bs; ++b) {
    const bool v = valid[b];
    const int64_t r = req[b], p = pos[b], seq = p + 1, block = p / ratio;
    const bool complete = seq % ratio == 0;
    const int64_t start = block * ratio - (ratio == 4 ? ratio : 0);  // c4 also reads the previous block
    int64_t tail = seq % tail_block;
    if (ratio == 4 && tail <= 3 && seq >= tail_block) tail += tail_block;
    const bool write = p >= seq - tail;
    f[0].push_back(b);                                               // block_req
    f[1].push_back(b);                                               // state_write_token
    f[2].push_back(v && complete ? block * ratio : 0);               // block_positions
    f[3].push_back(v && complete ? rows.at(r, block) : 0);           // block_loc
    f[4].push_back(v && complete);                                   // block_mask
    f[5].push_back(v ? start : 0);                                   // state_read_start
    f[6].push_back(v ? p - start : 0);                               // state_read_len
    for (int64_t j = 0; j < width; ++j) {                            // state_read_slots
      const int64_t col = start + j;
      f[7].push_back(v && col >= 0 && col < p ? state.at(r, col) : 0);
    }
    f[8].push_back(v ? p : 0);                                       // state_write_pos
    f[9].push_back(v && write ? state.at(r, p) : 0);                 // state_write_loc
    f[10].push_back(v && write);                                     // state_write_mask
    f[11].push_back(v ? seq / ratio : 0);                            // visible
  }
  for (int64_t i = 0; i < 12; ++i) put(out[i], f[i]);
}

void fill_decode(const at::Tensor& req_t, const at::Tensor& pos_t, const at::Tensor& valid_t,
                 const at::Tensor& swa_table, const at::Tensor& token_table,
                 const c10::optional<at::Tensor>& c4_state, const c10::optional<at::Tensor>& c4_rows,
                 const c10::optional<at::Tensor>& c128_state, const c10::optional<at::Tensor>& c128_rows,
                 int64_t page_size, int64_t tail_block, at::TensorList main, at::TensorList c4,
                 at::TensorList c128) {
  TORCH_CHECK(main.size() == 10, "fill_decode: 10 main buffers");
  auto rq = req_t.to(at::kLong).contiguous(), ps = pos_t.to(at::kLong).contiguous();
  auto vd = valid_t.to(at::kBool).contiguous();
  const int64_t bs = rq.numel(), window = main[8].size(1), pages = main[9].size(1);
  std::vector<int64_t> req(bs), pos(bs);
  std::vector<bool> valid(bs);
  for (int64_t b = 0; b < bs; ++b) {
    valid[b] = vd.data_ptr<bool>()[b];
    req[b] = valid[b] ? rq.data_ptr<int64_t>()[b] : 0;
    pos[b] = valid[b] ? ps.data_ptr<int64_t>()[b] : 0;
  }
  const Table swa{swa_table}, tokens{token_table};
  std::vector<std::vector<int64_t>> f(10);
  int64_t count = 0;
  f[4].push_back(0);  // cu_extend
  for (int64_t b = 0; b < bs; ++b) {
    const bool v = valid[b];
    const int64_t r = req[b], p = pos[b], seq = p + 1;
    f[0].push_back(v ? r : 0);    // req_indices
    f[1].push_back(v ? p : 0);    // prefix_lens
    f[2].push_back(v ? seq : 0);  // seq_lens
    f[3].push_back(v ? 1 : 0);    // extend_lens
    count += v;
    f[4].push_back(count);
    f[5].push_back(v ? p : 0);    // positions
    f[6].push_back(b);            // token_req
    f[7].push_back(v ? swa.at(r, p) : 0);  // out_swa_loc
    for (int64_t j = 0; j < window; ++j) {  // swa_slots: oldest first, -1 before position 0
      const int64_t key = p - (window - 1 - j);
      f[8].push_back(v && key >= 0 ? swa.at(r, key) : -1);
    }
    const int64_t held = (seq + page_size - 1) / page_size;
    for (int64_t i = 0; i < pages; ++i) f[9].push_back(v && i < held ? tokens.at(r, i * page_size) / page_size : 0);
  }
  for (int64_t i = 0; i < 10; ++i) put(main[i], f[i]);
  if (!c4.empty()) fill_compress(c4.vec(), Table{*c4_state}, Table{*c4_rows}, 4, tail_block, req, pos, valid);
  if (!c128.empty())
    fill_compress(c128.vec(), Table{*c128_state}, Table{*c128_rows}, 128, tail_block, req, pos, valid);
}

}  // namespace

TORCH_LIBRARY(dsv4, m) {
  m.def("fill_decode(Tensor req, Tensor pos, Tensor valid, Tensor swa_table, Tensor token_table, "
        "Tensor? c4_state, Tensor? c4_rows, Tensor? c128_state, Tensor? c128_rows, int page_size, "
        "int tail_block, Tensor(a!)[] main, Tensor(b!)[] c4, Tensor(c!)[] c128) -> ()");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("sink_attention(Tensor q, Tensor keys, Tensor bias, Tensor sinks, float scaling) -> Tensor");
  m.def("rope_rotate(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
  m.def("hc_pre(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, "
        "float norm_eps) -> (Tensor, Tensor, Tensor)");
  m.def("hc_post(Tensor post, Tensor comb, Tensor out, Tensor streams) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor gate_up, Tensor down, Tensor ids, Tensor weights, float limit) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("fill_decode", &fill_decode);
  m.impl("rms_norm", &rms_norm);
  m.impl("sink_attention", &sink_attention);
  m.impl("rope_rotate", &rope_rotate);
  m.impl("hc_pre", &hc_pre);
  m.impl("hc_post", &hc_post);
  m.impl("moe_experts", &moe_experts);
}
