"""Attention metadata over the paged DSV4 pools: extend (chunked prefill), decode, static decode buffers."""

from .decode_buffers import DEFAULT_BUCKETS, DecodeBuffers, buckets_for
from .metadata import (
    AttentionMetadata,
    CompressMetadata,
    build_decode_metadata,
    build_extend_metadata,
    row_slots,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "AttentionMetadata",
    "CompressMetadata",
    "DecodeBuffers",
    "buckets_for",
    "build_decode_metadata",
    "build_extend_metadata",
    "row_slots",
]
