"""Policy: an eviction policy as one value, the core's transitions bound to it.

optax's `GradientTransformation` pairs `init` with `update`; a `Policy` pairs an
`H2OConfig` (the rule) with its eviction op (`argmin`), its prefill policy (`prompt`,
SnapKV's window and pooling) and its row storage (`kv`, `h2o_fn.Storage`), and offers
the core's transitions with all four bound:
`init`, `step`, `admit`, `settle`, `settle_key`, `absorb`, `absorb_staged`. Decode-sized calls go
through `mx.compile` (one trace per config, op, storage and shape); `absorb` stays eager,
since prompt chunks come in many lengths. A `Policy` holds no compiled function
(they are looked up in the core's caches), so it pickles and deep-copies.

Shapes: B batch rows, H KV heads, C = budget + room slots, D head_dim, N chunk tokens.

Example:
    >>> import mlx.core as mx
    >>> import h2o_fn
    >>> p = h2o_fn.policy(h2o_fn.H2OConfig(budget=4, n_sink=1, grace=1))
    >>> s = p.init(1, 1, 8)
    >>> for _ in range(6):
    ...     s = p.step(s, mx.ones((1, 1, 1, 8)), mx.ones((1, 1, 1, 8)))
    >>> s.length.tolist(), s.seen.tolist()
    ([4], [6])
"""

from typing import NamedTuple, Optional

import mlx.core as mx

from . import core, prefill, rule, storage
from .checks import check_staged_logits
from .config import H2OConfig
from .prompt import Prompt
from .state import H2OState
from .storage import DENSE, Storage


class Policy(NamedTuple):
    """`config` (the rule), `argmin` (the op that picks each victim), `prompt` (how
    oneshot prefill scores a prompt) and `kv` (how rows are stored)."""

    config: H2OConfig
    argmin: rule.Argmin = rule.protected_argmin
    prompt: Prompt = Prompt()
    kv: Storage = DENSE

    def fields(self) -> dict:
        """The config's, the prompt's and the storage's fields as one flat dict (the argmin
        is code): what a saved cache's `meta_state` and the commands' JSON record."""
        return {**self.config._asdict(), **self.prompt._asdict(), **self.kv.fields()}

    def init(self, batch: int, n_heads: int, head_dim: int, dtype=mx.float16,
             value_dim: Optional[int] = None, room: int = 1) -> H2OState:
        """An empty state `[B, H, C, D]`, C = budget + room (`core.init`)."""
        return core.init(self.config, batch, n_heads, head_dim, dtype, value_dim, room, self.kv)

    def step(self, state: H2OState, key: mx.array, value: mx.array, weights: Optional[mx.array] = None,
             alive: Optional[mx.array] = None) -> H2OState:
        """One token `[B, H, 1, D]`, compiled (`core.step`)."""
        return core.compiled_step(self.config, self.argmin, self.kv)(state, key, value, weights, alive)

    def admit(self, state: H2OState, key: mx.array, value: mx.array,
              alive: Optional[mx.array] = None) -> H2OState:
        """Write one token `[B, H, 1, D]` unscored (`core.admit`; compiled when every row takes it)."""
        if alive is None:
            return core.compiled_admit(self.kv)(state, key, value)
        return core.admit(state, key, value, self.kv, alive)

    def settle(self, admitted: H2OState, weights: mx.array, alive: Optional[mx.array] = None) -> H2OState:
        """Finish an admitted token's step with its weights `[B, H, C]`, compiled (`core.settle`)."""
        return core.compiled_settle(self.config, self.argmin)(admitted, weights, alive)

    def settle_key(self, admitted: H2OState, key: mx.array, alive: Optional[mx.array] = None,
                   logits: Optional[mx.array] = None) -> H2OState:
        """Finish an admitted token's key-scored step with its key `[B, H, 1, D]` (or the
        proxy's `logits` `[B, H, C]` where attention computed them), compiled (`core.settle_key`)."""
        return core.compiled_settle_key(self.config, self.argmin, self.kv)(admitted, key, alive, logits)

    def absorb(self, state: H2OState, keys: mx.array, values: mx.array, weights: Optional[mx.array] = None,
               n_alive: Optional[mx.array] = None) -> H2OState:
        """A chunk `[B, H, N, D]` evicted down to budget (`prefill.absorb`, eager)."""
        return prefill.absorb(state, keys, values, self.config, weights, self.argmin, n_alive, self.prompt, self.kv)

    def admit_chunk(self, state: H2OState, keys: mx.array, values: mx.array, start: int) -> H2OState:
        """A chunk `[B, H, N, D]` written into free slots [start, start + N), unscored
        (`prefill.admit_chunk`: in place when nothing else holds the state)."""
        return prefill.admit_chunk(state, keys, values, start, self.kv)

    def settle_chunk(self, admitted: H2OState, keys: mx.array, start: int,
                     weights: Optional[mx.array] = None) -> H2OState:
        """An admitted chunk's scores, `absorb`'s when nothing is evicted (`prefill.settle_chunk`)."""
        return prefill.settle_chunk(admitted, keys, self.config, start, weights, self.prompt, self.kv)

    def absorb_staged(self, state: H2OState, keys: mx.array, values: mx.array,
                      weights: Optional[mx.array] = None, logits: Optional[mx.array] = None) -> H2OState:
        """The state's N newest tokens `[B, H, N, D]`, admitted unscored, judged as one chunk:
        `prefill.absorb_staged` (rows move only above budget; compiled; the key proxy's
        `logits` `[B, H, N, C]` where attention computed them) for oneshot prefill, N exact
        steps from the state before them for greedy."""
        if self.config.prefill == "greedy":
            if logits is not None:
                check_staged_logits(state, keys, self.config, logits)  # refuses greedy
            return self.absorb(core.rewind(state, keys.shape[2]), keys, values, weights)
        return prefill.compiled_absorb_staged(self.config, self.prompt, self.kv)(state, keys, values, weights,
                                                                                   logits)


def policy(config: Optional[H2OConfig] = None, argmin: rule.Argmin = rule.protected_argmin,
           prompt: Optional[Prompt] = None, kv: Optional[Storage] = None) -> Policy:
    """The `Policy` of `config` (default `H2OConfig()`) evicting with `argmin`, scoring
    prompts by `prompt` (default `Prompt()`: every query, no pooling), storing rows as
    `kv` (default `Storage()`: the model's dtype)."""
    if config is not None and not isinstance(config, H2OConfig):
        raise TypeError(f"config is a {type(config).__name__}: expected an H2OConfig")
    if prompt is not None and not isinstance(prompt, Prompt):
        raise TypeError(f"prompt is a {type(prompt).__name__}: expected an h2o_fn.Prompt")
    return Policy(config or H2OConfig(), argmin, prompt or Prompt(), DENSE if kv is None else storage.check(kv))
