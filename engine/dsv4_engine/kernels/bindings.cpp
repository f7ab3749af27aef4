// The kernels' one translation unit: the three sources, their `torch.ops.dsv4` registrations, and the
// same per-layer functions bound directly for eager calls (`kernels.build.module()`, which the CPU
// kernel set calls).
//
// Why both: an op called through `torch.ops` pays the dispatcher's boxed call (~1.5-2 us from Python
// here) where a pybind call pays ~0.5-1 us, and an eager decode step calls these a hundred times;
// a compiler needs the registered ops (their fake implementations keep them opaque). The bindings
// take the schema's argument names (tests/decode/test_kernels.py checks them against the schemas) and
// release the GIL while they run, as the dispatcher's Python entry does. The once-a-step and PD-only
// ops (fill_decode, gather_pages, scatter_pages) are called through `torch.ops` only.
#include <torch/extension.h>

#include "cpu.cpp"
#include "attention.cpp"
#include "pages.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, arg("x"), arg("weight"), arg("eps"), nogil);
  m.def("sink_attention", &sink_attention, arg("q"), arg("keys"), arg("bias"), arg("sinks"), arg("scaling"), nogil);
  m.def("rope_rotate", &rope_rotate, arg("x"), arg("cos"), arg("sin"), arg("inverse"), nogil);
  m.def("hc_pre", &hc_pre, arg("streams"), arg("fn"), arg("base"), arg("scale"), arg("iters"), arg("hc_eps"),
        arg("norm_eps"), nogil);
  m.def("moe_experts", &moe_experts, arg("x"), arg("gate_up"), arg("down"), arg("ids"), arg("weights"),
        arg("limit"), nogil);
  m.def("hc_post", &hc_post, arg("post"), arg("comb"), arg("out"), arg("streams"), nogil);
  m.def("masked_put", &masked_put, arg("pool"), arg("slots"), arg("rows"), arg("mask"), nogil);
  m.def("route", &route, arg("x"), arg("input_ids"), arg("weight"), arg("table"), arg("is_hash"), arg("top_k"),
        arg("scaling"), nogil);
  m.def("linear", &linear, arg("x"), arg("weight"), nogil);
  m.def("grouped_linear", &grouped_linear, arg("x"), arg("weight"), nogil);
  m.def("shared_expert", &shared_expert, arg("x"), arg("gate_up"), arg("down"), arg("limit"), nogil);
  m.def("compress_decode", &compress_decode, arg("kv"), arg("gate"), arg("position_bias"), arg("positions"),
        arg("write_mask"), arg("write_loc"), arg("read_start"), arg("read_slots"), arg("block_mask"),
        arg("block_loc"), arg("block_positions"), arg("cos"), arg("sin"), arg("norm_weight"), arg("norm_eps"),
        arg("state"), arg("rows"), nogil);
  m.def("index_topk", &index_topk, arg("q"), arg("weights"), arg("keys"), arg("page_table"), arg("visible"),
        arg("ratio"), arg("page_size"), arg("softmax_scale"), arg("k"), nogil);
  m.def("topk_bias", &topk_bias, arg("scores"), arg("visible"), arg("k"), nogil);
  m.def("block_attention", &block_attention, arg("q"), arg("keys"), arg("bias"), arg("sinks"), arg("scaling"), nogil);
  m.def("paged_attention", &paged_attention, arg("q"), arg("swa"), arg("swa_slots"), arg("comp"),
        arg("page_table"), arg("comp_rows"), arg("visible"), arg("ratio"), arg("page_size"), arg("sinks"),
        arg("scaling"), nogil);
}
