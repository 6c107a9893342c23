"""H2OState: the cache of one attention layer as a NamedTuple of MLX arrays.

C = capacity = budget + 1 slots per (batch row b, KV head h). Slots are
unordered: a token keeps its slot until it is evicted, and the next token is
written into the freed slot. Free slots have position -1 and score 0; their
key and value rows hold stale data that nothing reads.

Layout invariant: while `length < budget` the valid slots are exactly
`[0, length)`; from the first eviction on, `length == budget` after every
token, with one free slot somewhere.
"""

from typing import NamedTuple

import mlx.core as mx


class H2OState(NamedTuple):
    keys: mx.array  # [B, H, C, D] model dtype, as rotated by the model (absolute positions)
    values: mx.array  # [B, H, C, D] model dtype
    scores: mx.array  # [B, H, C] float32, accumulated (decayed) attention mass; 0 for free slots
    positions: mx.array  # [B, H, C] int32, absolute token position; -1 for free slots
    length: mx.array  # [] int32, valid slots per (b, h) (the same for every row and head)
    seen: mx.array  # [] int32, tokens absorbed so far = the next token's position
