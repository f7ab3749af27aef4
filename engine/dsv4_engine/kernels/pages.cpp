// Page staging for PD transfers, registered as torch ops `dsv4::gather_pages` / `dsv4::scatter_pages`.
//
// Mooncake's TCP transport pays ~20-37 us per entry whatever its size, so a request whose pages are
// scattered (one entry per page per layer buffer) moves at a fraction of the link's rate. Staging
// packs those pages into one contiguous buffer and sends it as one entry; these two ops are that
// packing, one call for every buffer of a state type instead of an index_select per buffer.
//
// Staged layout (TorchKernels.gather_pages writes the same with torch): buffer-major, then page order, each
// page the buffer's whole row block: staged[sum_{b' < b} n * item(b') + i * item(b)] = buffers[b][pages[i]].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

struct Span {
  char* page;    // page 0 of one buffer
  int64_t item;  // bytes of one page of it
  int64_t staged;  // where its pages start in the staged bytes
};

// Every check the copy relies on, named by op: the buffers are dense CPU tensors, the page ids lie
// inside every one of them, and the staged bytes are exactly their pages' size.
std::vector<Span> spans(const char* op, const std::vector<at::Tensor>& buffers, const at::Tensor& pages,
                        const at::Tensor& staged) {
  TORCH_CHECK(pages.dim() == 1 && pages.scalar_type() == at::kLong && pages.is_contiguous(), op,
              ": pages must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(staged.dim() == 1 && staged.scalar_type() == at::kByte && staged.is_contiguous() &&
                  staged.device().is_cpu(),
              op, ": staged must be a contiguous 1-D uint8 CPU tensor");
  const int64_t n = pages.size(0);
  const int64_t* ids = pages.data_ptr<int64_t>();
  std::vector<Span> out;
  out.reserve(buffers.size());
  int64_t offset = 0;
  for (size_t b = 0; b < buffers.size(); ++b) {
    const at::Tensor& buf = buffers[b];
    TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous() && buf.dim() >= 1, op, ": buffer ", b,
                " must be a contiguous CPU tensor");
    const int64_t rows = buf.size(0);
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(ids[i] >= 0 && ids[i] < rows, op, ": page ", ids[i], " outside buffer ", b, "'s ", rows, " pages");
    const int64_t item = rows ? buf.nbytes() / rows : 0;
    out.push_back({static_cast<char*>(buf.data_ptr()), item, offset});
    offset += n * item;
  }
  TORCH_CHECK(staged.numel() == offset, op, ": staged holds ", staged.numel(), " bytes, ", n, " pages of ",
              buffers.size(), " buffers are ", offset);
  return out;
}

template <typename Copy>
void each_page(const std::vector<Span>& layout, const at::Tensor& pages, Copy copy) {
  const int64_t n = pages.size(0), total = n * static_cast<int64_t>(layout.size());
  const int64_t* ids = pages.data_ptr<int64_t>();
  // ~64 KiB per task: a page of the small preset's SWA buffer is 64 KiB, of its state buffers 512 KiB.
  at::parallel_for(0, total, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Span& s = layout[k / n];
      const int64_t i = k % n;
      copy(s.page + ids[i] * s.item, s.staged + i * s.item, s.item);
    }
  });
}

void gather_pages(const std::vector<at::Tensor>& buffers, const at::Tensor& pages, at::Tensor staged) {
  const auto layout = spans("gather_pages", buffers, pages, staged);
  char* out = static_cast<char*>(staged.data_ptr());
  each_page(layout, pages, [out](const char* page, int64_t at, int64_t n) { std::memcpy(out + at, page, n); });
}

void scatter_pages(std::vector<at::Tensor> buffers, const at::Tensor& pages, const at::Tensor& staged) {
  const auto layout = spans("scatter_pages", buffers, pages, staged);
  const char* in = static_cast<const char*>(staged.data_ptr());
  each_page(layout, pages, [in](char* page, int64_t at, int64_t n) { std::memcpy(page, in + at, n); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv4, m) {
  m.def("gather_pages(Tensor[] buffers, Tensor pages, Tensor(a!) staged) -> ()");
  m.def("scatter_pages(Tensor(a!)[] buffers, Tensor pages, Tensor staged) -> ()");
}

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("gather_pages", &gather_pages);
  m.impl("scatter_pages", &scatter_pages);
}
