"""`torch.Generator(device="npu")` on the reference: torch_npu's NPUGeneratorImpl as Python sees it.

torch makes a device generator in C++ (`PrivateUse1HooksInterface::getNewGenerator`, which torch_npu
implements and which a Python backend cannot: `torch._C._acc.PrivateUse1Hooks` exposes no generator
hook). So while the reference is importable, `torch.Generator` names a class that builds an
`NpuGenerator` for an "npu" device and a plain `torch._C.Generator` for anything else; instance checks
against it accept every generator, as before. `uninstall()` (the tests' fixture) puts torch's back.

What torch_npu 2.14.0's generator is (`include/torch_npu/csrc/aten/NPUGeneratorImpl.h` in the wheel,
a port of CUDAGeneratorImpl; messages from `lib/libtorch_npu.so`): Philox, its state a seed and a
per-thread offset. The reference keeps the same:
- `device` is `npu:N`; a new generator has torch's default seed (67280421310721) and offset 0;
  `manual_seed` sets the seed and resets the offset; `initial_seed`, `seed`, `get_offset`,
  `set_offset` (a multiple of 4, "offset must be a multiple of 4").
- `get_state()`: a 16-byte CPU uint8 tensor, the seed (uint64) then the offset (int64), little-endian;
  `set_state` takes that, or the 8-byte seed-only form (offset 0; CUDA's, assumed of the port), and
  refuses anything else as the device does ("RNG state must be a torch.ByteTensor", "RNG state must
  be contiguous", "RNG state is wrong size"). So a state saved on one engine continues the same stream on another (the PD hand-off).
- A draw on "npu" tensors with this generator runs the host kernel on a fresh CPU generator seeded from
  (seed, offset), then advances the offset by 4 * ceil(numel / 4): deterministic in the state and
  independent of anything else, as Philox is. The numbers are not the device's (its offsets depend on
  the launch grid); only the rules are.
- A draw on "npu" tensors with a CPU generator is refused, as torch_npu's kernels refuse it
  (`check_generator`: "Expected a 'npu' device type for generator but found 'cpu'"). Not modelled:
  a draw on CPU tensors with an NPU generator (the device refuses it; here the host kernel would use
  the generator's placeholder), and the graph-safe state API (`graphsafe_*`, `clone_state`).

How a draw finds its generator: the dispatcher hands the fallback a fresh Python wrapper of the C++
generator, not the `NpuGenerator` object. Each `NpuGenerator` is, underneath, a CPU generator seeded
with a unique random tag that nothing draws from; the fallback reads that seed and looks the tag up.
"""

from __future__ import annotations

import math
import random
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import _device

DEFAULT_SEED = 67280421310721  # c10::default_rng_seed_val, NPUGeneratorState's default
STATE_BYTES = 16  # uint64 seed + int64 Philox offset (CUDAGeneratorImpl::get_state's layout)
_MASK = (1 << 64) - 1
_TorchGenerator = torch._C.Generator
_ENTROPY = random.SystemRandom()  # tags and fresh seeds: independent of anyone's random.seed()
_by_tag: weakref.WeakValueDictionary[int, NpuGenerator] = weakref.WeakValueDictionary()


class NpuGenerator(_TorchGenerator):
    """A Philox generator of an "npu" device (see the module docstring)."""

    def __new__(cls, device: Any = None) -> NpuGenerator:
        return super().__new__(cls)  # a CPU generator underneath: only its seed is read, as a tag

    def __init__(self, device: Any = None) -> None:
        self._device = torch.device(_device.NAME, _device._index(device))
        self._seed, self._offset = DEFAULT_SEED, 0
        tag = _ENTROPY.getrandbits(63)
        while tag in _by_tag:
            tag = _ENTROPY.getrandbits(63)
        _TorchGenerator.manual_seed(self, tag)
        _by_tag[tag] = self

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._device

    def manual_seed(self, seed: int) -> NpuGenerator:  # type: ignore[override]
        self._seed, self._offset = int(seed) & _MASK, 0
        return self

    def initial_seed(self) -> int:
        return self._seed

    def seed(self) -> int:
        self.manual_seed(_ENTROPY.getrandbits(64))
        return self._seed

    def get_offset(self) -> int:
        return self._offset

    def set_offset(self, offset: int) -> NpuGenerator:  # type: ignore[override]
        if offset % 4:
            raise RuntimeError("offset must be a multiple of 4")
        self._offset = int(offset)
        return self

    def get_state(self) -> torch.Tensor:
        raw = self._seed.to_bytes(8, "little") + self._offset.to_bytes(8, "little", signed=True)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def set_state(self, new_state: torch.Tensor) -> NpuGenerator:  # type: ignore[override]
        if (
            not isinstance(new_state, torch.Tensor)
            or new_state.layout != torch.strided
            or new_state.device.type != "cpu"
            or new_state.dtype != torch.uint8
        ):
            raise RuntimeError("RNG state must be a torch.ByteTensor")
        if not new_state.is_contiguous():
            raise RuntimeError("RNG state must be contiguous")
        if new_state.numel() not in (STATE_BYTES - 8, STATE_BYTES):
            raise RuntimeError("RNG state is wrong size")
        raw = bytes(new_state.tolist())
        self._seed = int.from_bytes(raw[:8], "little")
        self._offset = int.from_bytes(raw[8:], "little", signed=True) if len(raw) == STATE_BYTES else 0
        return self

    def graphsafe_get_state(self) -> Any:
        raise NotImplementedError("graph-safe generator states are not modelled by the reference")

    def graphsafe_set_state(self, state: Any) -> NpuGenerator:  # type: ignore[override]
        raise NotImplementedError("graph-safe generator states are not modelled by the reference")

    def clone_state(self) -> Any:
        raise NotImplementedError("graph-safe generator states are not modelled by the reference")

    def draw(self, numel: int) -> torch.Generator:
        """The CPU generator one draw of `numel` values runs on; advances the offset past it. Its seed
        is a function of (seed, offset) alone (a tuple of ints hashes the same in every process), so
        a draw depends on the state only, as a Philox draw does."""
        host = _TorchGenerator().manual_seed(hash((self._seed, self._offset)) & _MASK)
        self._offset += 4 * math.ceil(numel / 4)
        return host

    def __repr__(self) -> str:
        return (
            f"<torch_npu reference Generator device={self._device} seed={self._seed} offset={self._offset}>"
        )


def for_host(args: Any) -> Any:
    """An aten op's arguments with each NPU generator replaced by the CPU generator of this draw;
    a CPU generator is refused (the op runs on "npu" tensors, which is why it reached the fallback)."""
    numel = max((x.numel() for x in tree_flatten(args)[0] if _device.is_npu(x)), default=0)

    def swap(x: Any) -> Any:
        if not isinstance(x, _TorchGenerator):
            return x
        npu = x if isinstance(x, NpuGenerator) else _by_tag.get(_TorchGenerator.initial_seed(x))
        if npu is None:
            raise RuntimeError(
                f"Expected a '{_device.NAME}' device type for generator but found '{x.device.type}'"
            )
        return npu.draw(numel)

    return tree_map(swap, args)


class _GeneratorType(type(_TorchGenerator)):  # type: ignore[misc]
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _TorchGenerator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _TorchGenerator)


class Generator(_TorchGenerator, metaclass=_GeneratorType):
    """`torch.Generator` while the reference is importable: an `NpuGenerator` for an "npu" device,
    torch's own generator for any other."""

    def __new__(cls, device: Any = None) -> Any:  # type: ignore[misc]
        if isinstance(device, str | torch.device) and torch.device(device).type == _device.NAME:
            return NpuGenerator(device)
        return _TorchGenerator() if device is None else _TorchGenerator(device)


def install() -> None:
    _device.GENERATORS = for_host
    torch.Generator = Generator  # type: ignore[misc]


def uninstall() -> None:
    torch.Generator = _TorchGenerator  # type: ignore[misc]
