"""What the device rejects in plain aten ops the engine calls on "npu" tensors.

- aten::index_put_ (`t[idx] = v`, aclnnIndexPut): values must be on the device (indices may be host
  tensors, which torch copies), as with CUDA. The seed (SGLang's DSV4 NPU PR) rewrote
  `full_to_swa_index_mapping[...] = ...` because aclnnIndexPut would not take int32 values there,
  and sglang#27752 replaced the same write with npu_scatter_nd_update_ on int64. The current
  aclnnIndexPutImpl page (hicann/ops-nn `index/index_put_v2/docs/aclnnIndexPutImpl.md`) lists INT32
  for selfRef/values, so this is a limit of the CANN the seed ran, kept here so the engine stays on
  the form that works everywhere: int64 tables, or npu_scatter_nd_update_ (which itself refuses
  int32). The same page requires values of self's dtype (torch checks that too).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _device
from ._registry import OpError

INDEX_PUT_SOURCE = (
    "seed PR (swa.py full_to_swa_index_mapping: aclnnIndexPut int32 values), sglang#27752; "
    "hicann/ops-nn aclnnIndexPutImpl.md (values dtype = self dtype)"
)


def index_put(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    self, values = args[0], args[2]
    if isinstance(values, torch.Tensor) and not _device.is_npu(values) and values.dim() > 0:
        # Indices may live on the host (torch copies them); values must be on the device.
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {self.device} "
            "and cpu! (aten::index_put_ values)"
        )
    if isinstance(values, torch.Tensor) and values.dtype == torch.int32:
        raise OpError(
            "aten::index_put_ (aclnnIndexPut): int32 values are refused on the seed's CANN; use an int64 "
            f"table or torch_npu.npu_scatter_nd_update_ on int64 [rule: {INDEX_PUT_SOURCE}]"
        )
    if isinstance(values, torch.Tensor) and values.dtype != self.dtype:
        raise OpError(
            f"aten::index_put_: values dtype {values.dtype} must equal self's {self.dtype} [rule: {INDEX_PUT_SOURCE}]"
        )


_device.RULES["aten::index_put_"] = index_put
_device.RULES["aten::_index_put_impl_"] = index_put
