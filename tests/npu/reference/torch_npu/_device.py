"""The "npu" device of the reference: real torch tensors on device `npu:N` whose memory is host memory.

How a tensor can live on "npu" with no NPU and no C++:

- torch's PrivateUse1 backend is renamed "npu" and given Python hooks
  (`torch.utils.backend_registration._setup_privateuseone_for_python_backend`).
- Memory: a PrivateUse1 backend normally brings a C++ allocator. Instead, every "npu" tensor is made
  from a CPU tensor by DLPack: `torch.utils.dlpack.to_dlpack(cpu)` gives a capsule whose device field
  says kDLCPU; it is rewritten to kDLExtDev, which `from_dlpack` maps to PrivateUse1. The result is an
  ordinary `torch.Tensor` on `npu:N`, with a real storage whose `data_ptr()` is the CPU tensor's
  (which the capsule keeps alive). The reverse rewrite gives a CPU *alias* of any "npu" tensor: same
  memory, no copy. So `data_ptr()`, `untyped_storage()`, strides, views and in-place writes are all
  real, and Mooncake can register the pointer as it would device memory.
- Ops: one `torch.library` fallback on the PrivateUse1 key receives every aten op that has no
  composite kernel. Metadata-only ops (views, `set_`, a `resize_` that fits) are redispatched to the
  CPU kernel on the "npu" tensors themselves, so views share the "npu" storage. Every other op runs
  on CPU aliases of its arguments, and its fresh outputs become "npu" tensors (no copies); in-place
  and `out=` ops write through the aliases into the "npu" memory. (Redispatching compute kernels
  directly does not work: their DispatchStubs have no entry for the "npu" device type.)

What the fallback rejects, as the hardware stack would: a compute op mixing "npu" tensors with
non-scalar CPU tensors (torch's own message), and, while a graph is being captured, any host
synchronisation (`.item()`, `.tolist()`, device-to-host and host-to-device copies) and any op whose
output shape depends on data (aclgraph records tasks with fixed shapes and cannot read device memory
on the host). Rules on specific aten ops are in `RULES` (added by `rules.py`). A random op's generator
goes through `GENERATORS` (`_generator.py`): an NPU generator's draw runs on a host generator made
from its state, and a host generator is refused, as torch_npu's kernels refuse it.

Every op, aten or torch_npu, runs through `execute`, which also records it into the graph being
captured (see `graphs.py`).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
import torch.utils.dlpack as dlpack
from torch.utils._pytree import tree_map

from . import _streams
from ._streams import CaptureError

NAME = "npu"
_kDLCPU, _kDLExtDev = 1, 12  # DLDeviceType values (dlpack.h)
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class _DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int), ("device_id", ctypes.c_int))


class _DLTensorHead(ctypes.Structure):  # the leading fields of DLManagedTensor.dl_tensor
    _fields_ = (("data", ctypes.c_void_p), ("device", _DLDevice))


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)


def _moved(t: torch.Tensor, device_type: int, index: int) -> torch.Tensor:
    """`t`'s memory as a tensor of another DLPack device type: same pointer, same strides."""
    capsule = dlpack.to_dlpack(t)
    head = _DLTensorHead.from_address(_capsule_pointer(capsule, b"dltensor"))
    head.device.device_type, head.device.device_id = device_type, index
    return dlpack.from_dlpack(capsule)


def is_npu(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == NAME


def to_npu(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    """A CPU tensor's memory as an "npu" tensor (no copy; the new tensor keeps `t` alive)."""
    if t.numel() == 0:  # DLPack of an empty tensor has no data pointer: view a one-element one
        one = _moved(torch.empty(1, dtype=t.dtype), _kDLExtDev, index)
        return torch.ops.aten.as_strided.default.redispatch(_CPU_KEYS, one, t.shape, t.stride(), 0)
    return _moved(t, _kDLExtDev, index)


def host_alias(t: torch.Tensor) -> torch.Tensor:
    """An "npu" tensor's memory as a CPU tensor (no copy; the alias keeps `t` alive)."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return _moved(t, _kDLCPU, 0)


_allocated = [0]  # bytes held by "npu" tensors made by factories (empty, empty_strided)


def allocated_bytes() -> int:
    return _allocated[0]


def _release(nbytes: int) -> None:
    _allocated[0] -= nbytes


def _device_empty(size: list[int], stride: list[int] | None, dtype: torch.dtype, index: int) -> torch.Tensor:
    """A factory's "npu" memory: a numpy buffer, whose lifetime is the storage's (torch.from_numpy
    keeps the array alive), so a finalizer on it tracks what the device holds."""
    stride = list(stride) if stride is not None else list(torch.empty(size, device="meta").stride())
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    buffer = numpy.empty(max(1, extent) * itemsize, dtype=numpy.uint8)
    _allocated[0] += buffer.nbytes
    weakref.finalize(buffer, _release, buffer.nbytes)
    flat = torch.from_numpy(buffer).view(dtype)
    return to_npu(flat, index).as_strided(size, stride)


def _index(device: torch.device | str | int | None) -> int:
    if device is None:
        return current_device()
    d = torch.device(NAME, device) if isinstance(device, int) else torch.device(device)
    return d.index if d.index is not None else current_device()


def current_device() -> int:
    return _state.thread.device or 0


@dataclass
class TapeEntry:
    """One op recorded during capture; replay runs `fn(*args, **kwargs)` again."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any
    stream: int = 0  # the stream it was issued to (a capture may fork side streams)


class _Thread(threading.local):
    device: int | None = None  # set by torch.npu.set_device in this thread (aclrtSetDevice)


@dataclass
class _State:
    device_count: int = 8
    thread: _Thread = field(default_factory=_Thread)
    # Threads that ran device work before set_device: CANN gives each such thread a context on
    # device 0, an extra context when the process works on another device (the seed's fix).
    implicit_contexts: list[str] = field(default_factory=list)
    capturing: Any = None  # the NPUGraph being captured
    updating: Any = None  # the task group being updated (graphs.graph_task_update_begin)
    update_calls: list[TapeEntry] = field(default_factory=list)
    quiet: int = 0  # >0 while a reference op runs its own host-side checks and aten calls


_state = _State()

# Rules on aten ops, by overload name ("aten::index_put_"): fn(args, kwargs) raises what the device
# would. Filled by rules.py.
RULES: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], None]] = {}

# Replaces the generators of an op's (args, kwargs) by the host generators its draw runs on, and
# refuses a host generator with "npu" tensors. Set by _generator.py.
GENERATORS: Callable[[Any], Any] | None = None
_TAKES_GENERATOR: dict[Any, bool] = {}

# Ops whose output shape depends on values: aclgraph cannot capture them (host must read the count).
_DATA_DEPENDENT = {
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::_unique",
    "aten::unique_dim",
    "aten::repeat_interleave",
    "aten::bincount",
}
_ALLOCATIONS = {"aten::empty", "aten::empty_strided"}
# Ops allowed to mix devices: copies, and indexing with host indices (which torch moves).
_CROSS_DEVICE = {
    "aten::_to_copy",
    "aten::copy_",
    "aten::_copy_from",
    "aten::_copy_from_and_resize",
    "aten::index",
    "aten::index_put_",
    "aten::_index_put_impl_",
    "aten::set_",
}


def execute(
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    written: list[torch.Tensor] = (),  # type: ignore[assignment]
) -> Any:
    """Run one device op now on the current stream (`_streams` checks its ordering; written: the
    arguments it writes in place) and, while a graph is being captured, append it to the tape."""
    if _state.updating is not None and not _state.quiet:
        return _state.updating.take(name, fn, args, kwargs)  # graph-task update: no launch
    if _state.thread.device is None and threading.current_thread() is not threading.main_thread():
        _state.implicit_contexts.append(threading.current_thread().name)
        _state.thread.device = 0
    # An allocation is not a task: capture keeps its memory (the graph's pool), replay does not redo it.
    recording = _state.capturing is not None and not _state.quiet and name not in _ALLOCATIONS
    if recording:
        if name in _DATA_DEPENDENT:
            raise CaptureError(f"{name} has a data-dependent output shape and cannot be captured")
        args, kwargs = tree_map(_frozen, (args, kwargs))
    launch = None if _state.quiet or name in _ALLOCATIONS else _streams.issue(name, (args, kwargs), written)
    result = fn(*args, **kwargs)
    if launch is not None:
        _streams.done(launch, written, result)
    elif name in _ALLOCATIONS:
        _streams.allocated(result)  # new memory: what used the address before is not its history
    if recording:
        _state.capturing.record(TapeEntry(name, fn, args, kwargs, result, _streams.current_id()))
    elif _state.capturing is not None and name in _ALLOCATIONS:
        _state.capturing.allocated(result)  # from the graph's pool: not an input of the graph
    return result


def written_slots(schema: torch._C.FunctionSchema) -> list[tuple[int, str]]:
    """(position, name) of the arguments an op writes in place: those its schema marks `(a!)`."""
    return [
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def written_args(
    slots: list[tuple[int, str]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The "npu" tensors in an op's written `slots` (`written_slots`)."""
    out: list[torch.Tensor] = []
    for i, name in slots:
        value = args[i] if i < len(args) else kwargs.get(name)
        tree_map(lambda x: out.append(x) if is_npu(x) else None, value)
    return out


_WRITTEN: dict[torch._ops.OpOverload, list[tuple[int, str]]] = {}  # aten op -> its written slots


def _frozen(x: Any) -> Any:
    """Host tensors are read at capture time: a replay sees these values, never later ones."""
    return x.clone() if isinstance(x, torch.Tensor) and not is_npu(x) else x


def _device_index_of(args: Any) -> int | None:
    found: list[int] = []
    tree_map(lambda x: found.append(x.device.index or 0) if is_npu(x) else None, args)
    return found[0] if found else None


def _check_same_device(name: str, args: Any) -> None:
    if name in _CROSS_DEVICE:
        return
    devices: set[str] = set()

    def seen(x: Any) -> None:
        if isinstance(x, torch.Tensor) and (is_npu(x) or x.dim() > 0):  # 0-dim CPU tensors are scalars
            devices.add(str(x.device))

    tree_map(seen, args)
    if len(devices) > 1 and any(d.startswith(NAME) for d in devices):
        a, b = sorted(devices)[:2]
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! ({name})"
        )


def _is_metadata_op(op: torch._ops.OpOverload) -> bool:
    """Views (outputs alias an input without writing it) and `set_`: their CPU kernels only touch
    sizes, strides and storage, so they run on the "npu" tensors themselves."""
    if op._schema.name in ("aten::set_", "aten::as_strided_"):
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def _out_names(op: torch._ops.OpOverload) -> list[str]:
    return [
        a.name
        for a in op._schema.arguments
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
    ]


def _on_host(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """An aten op on the host: its rules, then `on_host`."""
    name = op._schema.name  # without the overload: "aten::index_put_"
    _check_same_device(name, (args, kwargs))
    if name in RULES and not _state.quiet:
        RULES[name](args, kwargs)
    if GENERATORS is not None and _takes_generator(op):
        args, kwargs = GENERATORS((args, kwargs))
    if name == "aten::_local_scalar_dense" and _state.capturing is not None and not _state.quiet:
        raise CaptureError("reading a device value on the host (.item(), .tolist()) during graph capture")
    return on_host(op, args, kwargs, out_names=_out_names(op))


def _takes_generator(op: torch._ops.OpOverload) -> bool:
    known = _TAKES_GENERATOR.get(op)
    if known is None:
        known = _TAKES_GENERATOR[op] = any("Generator" in str(a.type) for a in op._schema.arguments)
    return known


def on_host(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out_names: list[str] | None = None
) -> Any:
    """Run `fn` on CPU aliases of its "npu" arguments: in-place writes land in "npu" memory, and
    fresh outputs become "npu" tensors (on the arguments' device, or `device=` if given)."""
    index = _device_index_of((args, kwargs))
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == NAME:
        index = _index(device)
        kwargs = {**kwargs, "device": torch.device("cpu")}
    elif device is not None:
        index = None  # an explicit host device: the result stays on the host
    if fn in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default) and index is not None:
        stride = args[1] if fn is torch.ops.aten.empty_strided.default else None
        return _device_empty(list(args[0]), stride, kwargs.get("dtype") or torch.get_default_dtype(), index)
    # id(alias) -> (alias, its "npu" tensor). The alias is kept: an `out=` argument's alias is
    # replaced below and would otherwise die, and a fresh output reusing its id would be mapped back
    # to that argument (torch.sort's values returned as its indices).
    aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def down(x: Any) -> Any:
        if not is_npu(x):
            return x
        alias = host_alias(x)
        aliases[id(alias)] = (alias, x)
        return alias

    cargs, ckwargs = tree_map(down, (args, kwargs))
    outs = {k: kwargs[k] for k in out_names or () if is_npu(kwargs.get(k))}
    for k, out in outs.items():  # the kernel may resize `out`; an alias's storage cannot grow
        ckwargs[k] = torch.empty(0, dtype=out.dtype)
    result = fn(*cargs, **ckwargs)
    for k, out in outs.items():
        fresh = ckwargs[k]
        if out.shape != fresh.shape:
            out.resize_(fresh.shape)
        host_alias(out).copy_(fresh)

    def up(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in aliases:  # in-place ops return their own argument
            return aliases[id(x)][1]
        for k, out in outs.items():
            if x is ckwargs[k]:
                return out
        return to_npu(x, index) if index is not None else x

    return tree_map(up, result)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`dst.copy_(src)` across devices (aten::_copy_from is the external-backend copy)."""
    if _state.capturing is not None and not _state.quiet and (not is_npu(src) or not is_npu(dst)):
        raise CaptureError(
            f"a copy between host and device ({src.device} -> {dst.device}) during graph capture: "
            "copy inputs into the static buffers before replay"
        )
    host_alias(dst).copy_(host_alias(src) if is_npu(src) else src)
    return dst


def _resize_(self: torch.Tensor, size: list[int], memory_format: Any = None) -> torch.Tensor:
    numel = 1
    for s in size:
        numel *= s
    need = (numel + self.storage_offset()) * self.element_size()
    if need <= self.untyped_storage().nbytes():
        return torch.ops.aten.resize_.default.redispatch(_CPU_KEYS, self, size, memory_format=memory_format)
    # A storage made by DLPack cannot grow: point the tensor at a new one, keeping the old bytes.
    grown = to_npu(torch.zeros(need, dtype=torch.uint8), self.device.index or 0)
    if _state.capturing is not None:  # from the graph's pool: not an input of the graph
        _state.capturing.allocated(grown)
    old = self.untyped_storage().nbytes()
    if old:
        old_bytes = torch.empty(0, dtype=torch.uint8, device=self.device)
        torch.ops.aten.set_.source_Storage.redispatch(_CPU_KEYS, old_bytes, self.untyped_storage())
        host_alias(grown)[:old].copy_(host_alias(old_bytes))
    offset = self.storage_offset()
    stride = torch.empty(size, device="meta").stride()
    return torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, self, grown.untyped_storage(), offset, size, stride
    )


def _rewrap_numbers(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """A Python number an op's Tensor argument took (`x % 4` runs `remainder.Tensor_out` with a
    wrapped-number tensor) reaches a Python fallback as the plain number; the op wants it back as a
    0-dim tensor. A real backend's C++ kernel sees the tensor."""
    out = list(args)
    for i, arg in enumerate(op._schema.arguments):
        if str(arg.type) != "Tensor":
            continue
        if i < len(out) and isinstance(out[i], bool | int | float | complex):
            out[i] = torch.tensor(out[i])
        elif isinstance(kwargs.get(arg.name), bool | int | float | complex):
            kwargs[arg.name] = torch.tensor(kwargs[arg.name])
    return tuple(out)


def _fallback(keyset: torch._C.DispatchKeySet, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    name = op._schema.name  # without the overload: "aten::index_put_"
    args = _rewrap_numbers(op, args, kwargs)
    if name == "aten::resize_":
        return _resize_(*args, **kwargs)
    if name in ("aten::_copy_from", "aten::_copy_from_and_resize"):
        src, dst = args[0], args[1]
        if name.endswith("_and_resize") and dst.shape != src.shape:
            dst.resize_(src.shape)
        return execute(name, _copy_from, (src, dst), {}, [dst])
    if name == "aten::record_stream":  # kept for tests; the allocator's reuse is not modelled
        return _streams.record_stream(*args)
    if _is_metadata_op(op):
        return op.redispatch(_CPU_KEYS, *args, **kwargs)
    if op not in _WRITTEN:
        _WRITTEN[op] = written_slots(op._schema)
    written = written_args(_WRITTEN[op], args, kwargs)
    return execute(name, lambda *a, **k: _on_host(op, *a, **k), args, kwargs, written)


_libraries: list[torch.library.Library] = []  # kept alive: a Library deregisters when collected


def install(backend_module: object) -> None:
    """Rename PrivateUse1 to "npu", register `backend_module` as `torch.npu`, and the fallback.
    Once per process: torch allows one rename, and this module is never re-imported."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() == NAME:
        return
    _setup_privateuseone_for_python_backend(rename=NAME, backend_module=backend_module)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_fallback, "PrivateUse1", with_keyset=True)
    _libraries.append(lib)


class quiet:
    """Inside a reference op: its own aten calls are neither recorded nor checked as the engine's."""

    def __enter__(self) -> None:
        _state.quiet += 1

    def __exit__(self, *exc: object) -> None:
        _state.quiet -= 1
