"""Paged-cache writes: npu_scatter_nd_update(_) and scatter_update(_).

Sources (torch_npu 2.14.0 wheel, `_op_plugin_docs.py`):
- npu_scatter_nd_update_: self 1-8 dims, on A2/A3 float32, float16, bool, bfloat16, int64, int8 —
  *not int32*; updates of self's dtype; indices int32 or int64, at least 2-D, its last dim a <=
  self.dim(); updates.shape == indices.shape[:-1] + self.shape[a:]; "indices中的索引数据不支持越界"
  (out-of-range indices are not supported: the device does not check them, the reference raises).
  sglang uses it where aclnnIndexPut was slow or refused (sgl-project/sglang#27752, swa.py).
- scatter_update_: data 2-8 dims, updates of the same rank; on A2/A3 int8, float16, float32,
  bfloat16, int32; indices int32 or int64, 1-D or 2-D; no empty tensors; "不支持索引越界, 索引越界
  不校验". Semantics (CANN ScatterUpdate, the KV-cache form vllm-ascend uses): for each batch row b,
  data[b, ..., indices[b] + j (along axis), ...] = updates[b, ..., j, ...] for j < updates.shape[axis].
  2-D indices are documented without their layout: the reference rejects them rather than guess.
"""

from __future__ import annotations

import torch

from ._registry import check, dtype_in, op

DOC = "torch_npu 2.14.0 _op_plugin_docs.py"
ND_DTYPES = (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8)
UPDATE_DTYPES = (torch.int8, torch.float16, torch.float32, torch.bfloat16, torch.int32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _nd_check(name: str, self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> None:
    dtype_in(name, "self", self, ND_DTYPES, DOC)
    check(
        updates.dtype == self.dtype,
        name,
        f"updates dtype {updates.dtype} must equal self's {self.dtype}",
        DOC,
    )
    dtype_in(name, "indices", indices, INDEX_DTYPES, DOC)
    check(1 <= self.dim() <= 8, name, f"self must have 1-8 dims, got {self.dim()}", DOC)
    check(indices.dim() >= 2, name, f"indices must be at least 2-D, got {indices.dim()}-D", DOC)
    a = indices.shape[-1]
    check(a <= self.dim(), name, f"indices' last dim {a} exceeds self's {self.dim()} dims", DOC)
    want = tuple(indices.shape[:-1]) + tuple(self.shape[a:])
    check(tuple(updates.shape) == want, name, f"updates shape {tuple(updates.shape)} must be {want}", DOC)
    for d in range(a):
        col = indices[..., d]
        check(
            bool(((col >= 0) & (col < self.shape[d])).all()),
            name,
            f"indices[..., {d}] out of range [0, {self.shape[d]})",
            DOC + " (out-of-range indices unsupported)",
        )


def _nd_apply(self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> None:
    a = indices.shape[-1]
    flat = indices.reshape(-1, a).long()
    self[tuple(flat[:, d] for d in range(a))] = updates.reshape(-1, *self.shape[a:])


@op("npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)")
def npu_scatter_nd_update_(self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """self[indices[i]] = updates[i] for each index tuple (the last dim of indices), in place."""
    _nd_check("npu_scatter_nd_update_", self, indices, updates)
    _nd_apply(self, indices, updates)
    return self


@op("npu_scatter_nd_update(Tensor self, Tensor indices, Tensor updates) -> Tensor")
def npu_scatter_nd_update(self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """npu_scatter_nd_update_ on a copy of self."""
    _nd_check("npu_scatter_nd_update", self, indices, updates)
    out = self.clone()
    _nd_apply(out, indices, updates)
    return out


def _update_check(
    name: str, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor, axis: int
) -> int:
    dtype_in(name, "data", data, UPDATE_DTYPES, DOC)
    check(
        updates.dtype == data.dtype,
        name,
        f"updates dtype {updates.dtype} must equal data's {data.dtype}",
        DOC,
    )
    dtype_in(name, "indices", indices, INDEX_DTYPES, DOC)
    check(2 <= data.dim() <= 8, name, f"data must have 2-8 dims, got {data.dim()}", DOC)
    check(updates.dim() == data.dim(), name, "updates must have data's rank", DOC)
    check(
        data.numel() > 0 and indices.numel() > 0 and updates.numel() > 0,
        name,
        "empty tensors are unsupported",
        DOC,
    )
    check(indices.dim() == 1, name, "indices must be 1-D here (the 2-D form is not modelled)", DOC)
    axis = axis % data.dim()
    check(axis > 0, name, "axis must not be the batch dim 0", DOC)
    check(
        indices.shape[0] == data.shape[0] == updates.shape[0],
        name,
        "indices, data and updates need one batch size",
        DOC,
    )
    end = indices.long() + updates.shape[axis]
    check(
        bool(((indices >= 0) & (end <= data.shape[axis])).all()),
        name,
        f"indices out of range along axis {axis}",
        DOC,
    )
    return axis


def _update_apply(data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor, axis: int) -> None:
    n = updates.shape[axis]
    for b, start in enumerate(indices.tolist()):
        data[b].narrow(axis - 1, start, n).copy_(updates[b])


@op("scatter_update_(Tensor(a!) self, Tensor indices, Tensor updates, int axis) -> Tensor(a!)")
def scatter_update_(
    self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor, axis: int
) -> torch.Tensor:
    """For each batch row b: self[b] at indices[b] along `axis` takes updates[b], in place."""
    axis = _update_check("scatter_update_", self, indices, updates, axis)
    _update_apply(self, indices, updates, axis)
    return self


@op("scatter_update(Tensor self, Tensor indices, Tensor updates, int axis) -> Tensor")
def scatter_update(
    self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor, axis: int
) -> torch.Tensor:
    """scatter_update_ on a copy of self."""
    axis = _update_check("scatter_update", self, indices, updates, axis)
    out = self.clone()
    _update_apply(out, indices, updates, axis)
    return out
