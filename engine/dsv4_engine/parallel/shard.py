"""Which part of each full weight a rank holds, so the loader reads only that part.

A `Shard` lists, per sharded dimension of the full tensor, the index ranges the rank keeps, in the
order it stores them: one range for a plain split, two for `gate_up_proj`, whose gate and up halves
are split alike. Which tensors split how (`shard_for`) follows the modules (model/attention.py,
model/moe.py): query heads and their sinks, the output projections, the shared expert and the
routed experts are split; everything else (the MQA latent, compressor, indexer, router, norms,
embedding, lm_head) is replicated and has no shard.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4_engine.config import Dsv4Config
from dsv4_engine.parallel.groups import Parallel, local_o_groups

Range = tuple[int, int]


@dataclass(frozen=True)
class Shard:
    ranges: dict[int, tuple[Range, ...]]  # full-tensor dim -> kept [start, stop) ranges, in order

    def local_shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(
            sum(b - a for a, b in self.ranges[d]) if d in self.ranges else n for d, n in enumerate(full)
        )

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor in memory."""
        return self.read(lambda box: full[box], full.dim())

    def read(self, get: Callable[[tuple[slice, ...]], torch.Tensor], ndim: int) -> torch.Tensor:
        """This rank's part, from `get(box)` of full-tensor boxes (a safetensors slice reads only those
        bytes): one box per range of the one dim that keeps several, concatenated along it."""
        multi = [d for d, rs in self.ranges.items() if len(rs) > 1]
        if len(multi) > 1:
            raise ValueError("a shard keeps several ranges along one dim at most")
        box = [slice(None)] * ndim
        for d, rs in self.ranges.items():
            box[d] = slice(*rs[0])
        if not multi:
            return get(tuple(box))
        (dim,) = multi
        parts = []
        for a, b in self.ranges[dim]:
            box[dim] = slice(a, b)
            parts.append(get(tuple(box)))
        return torch.cat(parts, dim=dim)

    def piece(self, index: tuple) -> tuple[tuple, Shard] | None:
        """For a checkpoint tensor that fills `full[index]` (an expert's weight: int indices on the
        leading dims, maybe a slice for one half of gate_up_proj): where its kept part goes in the
        local tensor and the shard of the piece itself; None when this rank keeps none of it."""
        local: list = []
        rest: dict[int, tuple[Range, ...]] = {}
        for d, i in enumerate(index):
            rs = self.ranges.get(d)
            if isinstance(i, int):
                if rs is None:
                    local.append(i)
                    continue
                offset = 0
                for a, b in rs:
                    if a <= i < b:
                        local.append(offset + i - a)
                        break
                    offset += b - a
                else:
                    return None
            else:  # a slice [lo, hi) of dim d: the kept ranges inside it, relative to lo
                lo, hi = i.start, i.stop
                if rs is None:
                    local.append(i)
                    continue
                offset, kept, inside = 0, [], []
                for a, b in rs:
                    a2, b2 = max(a, lo), min(b, hi)
                    if a2 < b2:
                        kept.append((offset + a2 - a, offset + b2 - a))
                        inside.append((a2 - lo, b2 - lo))
                    offset += b - a
                if not kept:
                    return None
                if any(k1[1] != k2[0] for k1, k2 in itertools.pairwise(kept)):
                    raise ValueError("a piece's kept part must be contiguous in the shard")
                local.append(slice(kept[0][0], kept[-1][1]))
                rest[d - _ints_before(index, d)] = tuple(inside)
        for d, rs in self.ranges.items():
            if d >= len(index):
                rest[d - _ints_before(index, len(index))] = rs
        return tuple(local), Shard(rest)


def _ints_before(index: tuple, d: int) -> int:
    """Dims an integer index removes before dim d."""
    return sum(isinstance(i, int) for i in index[:d])


def _split(n: int, parts: int, part: int) -> Range:
    size = n // parts
    return (part * size, (part + 1) * size)


# A decoder layer's tensors: the main layers' and the MTP layer's (a decoder layer split the same way).
_LAYER = re.compile(r"^(?:model\.layers|mtp)\.\d+\.(.+)$")


def shard_for(name: str, full: tuple[int, ...], config: Dsv4Config, parallel: Parallel) -> Shard | None:
    """The shard rank `parallel.rank` keeps of the model tensor `name` of full shape `full`; None:
    replicated."""
    if parallel.tp_size == 1:
        return None
    m = _LAYER.match(name)
    if m is None:
        return None
    rest, tp, r = m.group(1), parallel.tp_size, parallel.rank
    if rest in ("self_attn.q_b_proj.weight", "self_attn.sinks"):
        return Shard({0: (_split(full[0], tp, r),)})
    if rest in ("self_attn.o_a_proj.weight", "self_attn.o_b_proj.weight"):
        groups = config.o_groups
        local = local_o_groups(groups, tp)
        rows = config.o_lora_rank
        if groups >= tp:  # whole groups: this rank's rows of o_a, its columns of o_b
            span = (r * local * rows, (r + 1) * local * rows)
            return Shard({0: (span,)} if rest.startswith("self_attn.o_a") else {1: (span,)})
        share = tp // groups  # ranks per group: this rank holds a share of group g's heads
        g, sub = divmod(r, share)
        span = (g * rows, (g + 1) * rows)
        if rest.startswith("self_attn.o_a"):
            return Shard({0: (span,), 1: (_split(full[1], share, sub),)})
        return Shard({1: (span,)})
    if rest in ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"):
        return Shard({0: (_split(full[0], tp, r),)})
    if rest == "mlp.shared_experts.down_proj.weight":
        return Shard({1: (_split(full[1], tp, r),)})
    experts = _split(full[0], parallel.ep_size, parallel.ep_rank)
    if rest == "mlp.experts.gate_up_proj":
        inter = full[1] // 2
        a, b = _split(inter, parallel.moe_tp_size, parallel.moe_tp_rank)
        return Shard({0: (experts,), 1: ((a, b), (inter + a, inter + b))})
    if rest == "mlp.experts.down_proj":
        return Shard({0: (experts,), 2: (_split(full[2], parallel.moe_tp_size, parallel.moe_tp_rank),)})
    return None


def check_sizes(config: Dsv4Config, tp_size: int, ep_size: int) -> None:
    """Raise ValueError naming what does not split over tp_size ranks and ep_size expert groups: every
    rank's model is built (shapes only) as it will be."""
    from dsv4_engine.model import Dsv4ForCausalLM

    for rank in range(tp_size):
        with torch.device("meta"):
            Dsv4ForCausalLM(config, max_positions=1, parallel=Parallel(rank, tp_size, ep_size))


def model_shards(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], Shard]]:
    """Per sharded tensor of a rank's model: (full shape, shard), checked against the local shape."""
    parallel: Parallel = model.parallel  # type: ignore[assignment]
    if parallel.tp_size == 1:
        return {}
    from dsv4_engine.model import Dsv4ForCausalLM

    with torch.device("meta"):
        full_model = Dsv4ForCausalLM(
            model.config,  # type: ignore[arg-type]
            max_positions=1,
            mtp=getattr(model, "mtp", None) is not None,
        )
    full_shapes = {k: tuple(v.shape) for k, v in full_model.state_dict(keep_vars=True).items()}
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shard = shard_for(name, full_shapes[name], model.config, parallel)  # type: ignore[arg-type]
        if shard is None:
            continue
        if shard.local_shape(full_shapes[name]) != tuple(t.shape):
            raise AssertionError(
                f"{name}: shard {shard} of {full_shapes[name]} does not fit {tuple(t.shape)}"
            )
        out[name] = (full_shapes[name], shard)
    return out
