"""Defining a reference op: its torch_npu 2.14.0 schema, its rules, its plain-torch semantics.

`@op(SCHEMA)` defines `torch.ops.npu.<name>` with the schema copied from the wheel
(`torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`), so the dispatcher enforces the real
argument names, types, defaults and keyword-only markers. The decorated function is the host
implementation: it receives CPU aliases of the "npu" arguments (`_device.on_host`), checks what the
hardware would reject (raising `OpError`, whose message names the op, the argument and the
documented rule), and computes in plain torch. In-place ops write through the aliases.

Only "npu" tensors reach these kernels (the only kernel registered is PrivateUse1's), so calling an
op with host tensors fails in the dispatcher, as it does with torch_npu. Each call the caller issues
is counted in `reference.op_calls`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _device, reference

_lib = torch.library.Library("npu", "DEF")  # torch_npu's ops live in torch.ops.npu

# torch_npu passes dtypes of quantised ops as these ints (TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP
# in torch_npu/op_plugin/meta/_meta_registrations.py); the values are c10::ScalarType's.
DTYPE_ENUM = {
    0: torch.uint8,
    1: torch.int8,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    15: torch.bfloat16,
}
ENUM_OF = {v: k for k, v in DTYPE_ENUM.items()}


class OpError(RuntimeError):
    """What the op's parameter check (aclnn...GetWorkspaceSize or the op's meta) rejects."""


def check(ok: bool, op: str, what: str, source: str) -> None:
    if not ok:
        raise OpError(f"{op}: {what} [rule: {source}]")


def dtype_in(
    op: str, name: str, t: torch.Tensor | None, allowed: tuple[torch.dtype, ...], source: str
) -> None:
    if t is not None:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        check(t.dtype in allowed, op, f"{name} has dtype {t.dtype}; supported: {names}", source)


def contiguous(op: str, name: str, t: torch.Tensor | None, source: str) -> None:
    if t is not None:
        check(
            t.is_contiguous(), op, f"{name} must be contiguous (non-contiguous tensors unsupported)", source
        )


def op(schema: str, *, capturable: bool = True) -> Callable[[Callable[..., Any]], Any]:
    """Define `torch.ops.npu.<name>` with `schema`; the decorated function is its host kernel.
    capturable=False: the op documents no aclgraph support, so a graph capture refuses it."""
    name = schema.split("(", 1)[0]

    def register(host: Callable[..., Any]) -> Any:
        _lib.define(schema)
        slots = _device.written_slots(torch._C.parse_schema(schema))

        def run(*args: Any, **kwargs: Any) -> Any:
            return _device.on_host(host, args, kwargs)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            _device._check_same_device(f"npu::{name}", (args, kwargs))
            if not capturable and _device._state.capturing is not None and not _device._state.quiet:
                raise _device.CaptureError(f"npu::{name} does not support aclgraph capture")
            reference.op_calls[name] += 1
            written = _device.written_args(slots, args, kwargs)
            return _device.execute(f"npu::{name}", run, args, kwargs, written)

        _lib.impl(name, kernel, "PrivateUse1")
        packet = getattr(torch.ops.npu, name.split(".")[0])
        packet.__doc__ = host.__doc__
        return packet

    return register
