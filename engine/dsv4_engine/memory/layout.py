"""What the paged DSV4 memory holds, independent of how much of it: layer types, row widths, dtypes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

COMPRESS_RATIOS = (0, 4, 128)
# Bytes the state pools use per element: compressor state is accumulated in fp32.
STATE_DTYPE = torch.float32


class StateType(enum.StrEnum):
    """PD state types (the seed's AscendStateType, without the DSV4_ prefix), in registration order."""

    SWA = "SWA"
    C4 = "C4"
    C128 = "C128"
    INDEXER = "INDEXER"
    C4_STATE = "C4_STATE"
    C128_STATE = "C128_STATE"


STATE_TYPE_ORDER: tuple[StateType, ...] = tuple(StateType)


@dataclass(frozen=True)
class Dsv4MemoryLayout:
    """The memory-relevant slice of a DSV4 config.

    compress_ratios has one entry per decoder layer (the MTP entry of the HF list is dropped by
    from_config). head_dim is the shared MQA latent (K = V); index_head_dim the indexer key width.
    """

    compress_ratios: tuple[int, ...]
    head_dim: int
    index_head_dim: int
    window: int
    page_size: int = 128
    kv_dtype: torch.dtype = torch.bfloat16
    index_dtype: torch.dtype | None = None  # None: same as kv_dtype
    state_dtype: torch.dtype = field(default=STATE_DTYPE)

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size % 128:
            raise ValueError(f"page_size must be a positive multiple of 128, got {self.page_size}")
        bad = [r for r in self.compress_ratios if r not in COMPRESS_RATIOS]
        if bad:
            raise ValueError(f"compress_ratios may hold only {COMPRESS_RATIOS}, got {bad}")
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        page_size: int = 128,
        kv_dtype: torch.dtype = torch.bfloat16,
        index_dtype: torch.dtype | None = None,
    ) -> Dsv4MemoryLayout:
        """Build from a Dsv4Config or an HF config (dict or object) by HF key names."""

        def get(name: str, *alts: str) -> Any:
            for key in (name, *alts):
                value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
                if value is not None:
                    return value
            raise KeyError(f"config has no {name!r}")

        num_layers = int(get("num_hidden_layers", "n_layers"))
        ratios = tuple(int(r) for r in get("compress_ratios")[:num_layers])
        if len(ratios) < num_layers:
            ratios = ratios + (0,) * (num_layers - len(ratios))
        return cls(
            compress_ratios=ratios,
            head_dim=int(get("head_dim")),
            index_head_dim=int(get("index_head_dim")),
            window=int(get("sliding_window", "window_size")),
            page_size=page_size,
            kv_dtype=kv_dtype,
            index_dtype=index_dtype,
        )

    # Layer groups, in layer order.
    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))  # every layer keeps its sliding window

    @property
    def c4_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == 4)

    @property
    def c128_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == 128)

    # Rows per page in each pool family: one page id addresses the same page in every compressed pool.
    def rows_per_page(self, ratio: int) -> int:
        return self.page_size // ratio if ratio else self.page_size

    @property
    def resolved_index_dtype(self) -> torch.dtype:
        return self.index_dtype or self.kv_dtype

    # Row widths (elements). A state row per raw position holds [kv | score], coff*D each, where
    # coff = 2 for the overlapping ratio-4 compressors and 1 for ratio 128.
    @property
    def c4_state_width(self) -> int:
        return 2 * 2 * self.head_dim

    @property
    def c4_index_state_width(self) -> int:
        return 2 * 2 * self.index_head_dim

    @property
    def c128_state_width(self) -> int:
        return 2 * self.head_dim

    def describe(self) -> dict[str, Any]:
        """Everything that must match between PD peers (part of the layout fingerprint)."""
        return {
            "compress_ratios": list(self.compress_ratios),
            "head_dim": self.head_dim,
            "index_head_dim": self.index_head_dim,
            "window": self.window,
            "page_size": self.page_size,
            "kv_dtype": str(self.kv_dtype),
            "index_dtype": str(self.resolved_index_dtype),
            "state_dtype": str(self.state_dtype),
        }
