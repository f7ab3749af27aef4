"""Device and dtype selection: Ascend NPU (torch_npu, imported only there), CUDA, CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import sys

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def npu_available() -> bool:
    """True if torch_npu imports and sees a device; the import happens only when asked."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def select_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` picks NPU, then CUDA, then CPU; an explicit `npu` imports torch_npu first."""
    name = device.type if isinstance(device, torch.device) else device.split(":")[0]
    if name == "auto":
        if npu_available():
            return torch.device("npu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "npu" and not npu_available():
        raise RuntimeError("device 'npu' requested but torch_npu is not installed or sees no NPU")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    if name not in ("cpu", "cuda", "npu"):
        raise ValueError(f"device must be auto, cpu, cuda or npu, got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: fp32 on CPU (no fast bf16 there), bf16 on accelerators."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


class GraphApi:
    """The device-graph calls the decode graph runner needs, for one backend (CUDA or NPU)."""

    def __init__(self, module: object, graph_cls: type, graph_ctx: object) -> None:
        self._m = module
        self.graph = graph_cls
        self.capture = graph_ctx  # capture(graph) -> context manager

    def stream(self) -> object:
        return self._m.Stream()  # type: ignore[attr-defined]

    def current_stream(self) -> object:
        return self._m.current_stream()  # type: ignore[attr-defined]

    def use_stream(self, stream: object) -> object:
        return self._m.stream(stream)  # type: ignore[attr-defined]


# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_host_memory() -> bool:
    """Let glibc keep freed heap memory for reuse rather than unmap it (process-wide; idempotent).

    A CPU forward allocates and frees many multi-MB temporaries. By default glibc serves part of them
    with fresh mmaps and trims the heap when they are freed, so the next step faults the same pages in
    again: on the small preset's 2048-token prefill steps, 0 to 90k faults and up to 0.25 s of kernel
    time in a 2.3 s step, depending on how glibc's adaptive thresholds have moved. Blocks up to 32 MB
    now come from the heap, which returns memory only when more than 1 GiB at its top is free.
    False where the C library has no `mallopt` (not glibc), which changes nothing.
    """
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def graph_api(device: torch.device) -> GraphApi:
    """CUDA graphs on GPU, aclgraph (torch_npu's NPUGraph) on Ascend; torch_npu is imported only here."""
    if device.type == "cuda":
        return GraphApi(torch.cuda, torch.cuda.CUDAGraph, torch.cuda.graph)
    if device.type == "npu":
        importlib.import_module("torch_npu")
        npu = torch.npu  # type: ignore[attr-defined]
        return GraphApi(npu, npu.NPUGraph, npu.graph)
    raise ValueError(
        f"device graphs need a cuda or npu device, got {device}; use decode mode eager or compiled"
    )
