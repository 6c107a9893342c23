"""H2OState: the cache of one attention layer as a NamedTuple of MLX arrays.

C = capacity = budget + room slots per (batch row b, KV head h): room for the tokens
about to be judged (one for a step; k for k staged decode tokens, `init(room=k)`). Slots are
unordered: a token keeps its slot until it is evicted, and the next token is
written into the freed slot. Free slots have position -1 and score 0; their
key and value rows hold stale data that nothing reads.

Rows are counted per batch row: `length[b]` tokens kept, `seen[b]` tokens
absorbed (row b's next position). Rows of a batch may differ (prompts of
different lengths, padding that never counts); all heads of a row agree.

Layout invariant, per row b: while `length[b] < budget` the valid slots are
exactly `[0, length[b])`; from the first eviction on, `length[b] == budget`
after every token, with one free slot somewhere. So the first `length[b] + 1`
slots always hold the kept tokens plus the slot the next token takes.

A slot is free (position `FREE` = -1), holds a token (position >= 0), or is reserved
(position `RESERVED` = -2): a reserved slot holds nothing but counts toward `length`,
so a head with r reserved slots keeps at most budget - r tokens. It is never attended,
scored, written or evicted. Reserved slots give the heads of one layer, and the rows of
one batch, budgets of their own inside one `[B, H, C]` layout (`h2o_fn.budgets`);
without them every head's budget is the config's, as before. Per row b, the occupied
slots (tokens and reserved) obey the layout invariant above in place of the tokens.

Keys and values are stores (`h2o_fn.storage`): one array, or with `Storage(bits)`
the (packed, scales, biases) triple of mx.quantize. Keys and values may have
different widths (multi-head latent attention: Dk != Dv).

Example:
    >>> from h2o_fn import H2OConfig, init
    >>> s = init(H2OConfig(budget=4, n_sink=1, grace=1), batch=2, n_heads=3, head_dim=8)
    >>> s.keys.shape, s.scores.shape, s.length.tolist()
    ((2, 3, 5, 8), (2, 3, 5), [0, 0])
"""

from typing import NamedTuple

import mlx.core as mx

from . import storage
from .storage import Store


FREE = -1  # the position of a free slot
RESERVED = -2  # the position of a reserved slot: counted in `length`, holds no token


class H2OState(NamedTuple):
    keys: Store  # [B, H, C, Dk] model dtype (rotated by the model), or its quantized triple
    values: Store  # [B, H, C, Dv] model dtype, or its quantized triple
    scores: mx.array  # [B, H, C] float32, accumulated (decayed) attention mass; 0 for free slots
    positions: mx.array  # [B, H, C] int32, absolute token position in its row; FREE (-1), RESERVED (-2)
    length: mx.array  # [B] int32, occupied slots per (b, h): tokens + reserved (the same for every head of a row)
    seen: mx.array  # [B] int32, tokens absorbed per row = the row's next position


def capacity(state: H2OState) -> int:
    """C: slots per (b, h), the budget plus the room `init` gave the state."""
    return state.positions.shape[-1]


def state_nbytes(state: H2OState) -> int:
    """Bytes really held: key and value stores, scores, positions and the counters (all C
    slots, reserved and free ones included: they are allocated)."""
    return (storage.nbytes(state.keys) + storage.nbytes(state.values)
            + sum(x.nbytes for x in (state.scores, state.positions, state.length, state.seen)))
