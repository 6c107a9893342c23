"""`python -m h2o_fn serve`: mlx-lm's OpenAI-compatible server (`mlx_lm.server`) with H2O caches.

What it does and where it stops (flags, batching, the prompt cache with H2O, long
prompts, refused requests, failures, `GET /v1/h2o/stats`, measured limits) is described
once, in docs/serve.md. Here: `H2OModelProvider` (loads with `common.load_model` and
applies `use_h2o`, so every cache the server builds is H2O), `H2OPromptCache` (mlx-lm's
LRU prompt cache with H2O's trimming rule and the stats), `PromptReader` (the repeat pass
for long prompts) and `H2OAPIHandler` (plus the stats endpoint); every override of
mlx-lm's own server is in `serve_compat.py`, request checks in `serve_requests.py`.

Example:
    h2o-fn serve --budget 256 --port 8080
    curl localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}'
    curl localhost:8080/v1/h2o/stats
"""

import argparse
import copy
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from queue import Queue
from typing import Any, Deque, Dict, List, NamedTuple, Optional

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from h2o_fn import H2OConfig

from .. import allocation
from ..at_rest import PackedH2OKVCache, h2o_layers, pack_layers, unpack_layers
from ..cache import H2OKVCache, cache_of
from ..mlx_lm import h2o_caches, keep_views, shares_kv, use_h2o
from ..retention import SHARE, WIDTH, cache_prompt, check_share, repeat_prefix
from . import common, serve_compat, serve_requests

STATS_PATH = "/v1/h2o/stats"
RETENTIONS = ("repeat", "window")

log = logging.getLogger("h2o_fn.serve")

# mlx_lm.server flags this command defines itself (--model, H2O's --kv-bits/--kv-group-size)
REPLACED = ("help", "model", "kv_bits", "kv_group_size", "quantized_kv_start")
# mlx_lm.server flags it cannot honour, and why (an error when given)
REFUSED = {
    "adapter_path": "h2o-fn's --model loader does not apply LoRA adapters",
    "draft_model": "speculative decoding trims the cache after rejected drafts, which H2O cannot "
    "do once it has evicted",
    "num_draft_tokens": "there is no draft model (see --draft-model)",
    "trust_remote_code": "h2o-fn's --model loader does not pass it on",
    "pipeline": "h2o-fn serve runs in one process (no distributed serving)",
}

# mlx_lm.server flags whose default or meaning h2o-fn serve changes: (default, help)
CHANGED = {
    "max_tokens": (512, "the most tokens a request may ask for (max_tokens or max_completion_tokens; a larger "
                   "value is answered 400), and the number generated when it asks for none (default: 512)"),
    "prompt_cache_bytes": (None, "the most bytes the prompt cache's entries may hold (e.g. 512M; default: no "
                           "bound): past it the oldest are dropped, when an entry is stored and when a request "
                           "starts (then the bound less what the running requests' caches hold). An H2O entry "
                           "counts what it really holds: its kept rows (packed with --kv-bits), their scores and "
                           "positions"),
    "prefill_step_size": (512, "prompt tokens read per step (default: 512; mlx-lm's is 2048): a long prompt is "
                          "read in slices this long on a thread beside the other requests' decode steps, and H2O's "
                          "prompt scoring holds attention weights for one slice at a time; a client that "
                          "leaves stops its prompt's reading at the end of the slice"),
}

# ---------------------------------------------------------------- flags


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m h2o_fn serve",
        description="mlx-lm's OpenAI-compatible server (mlx_lm.server) with H2O caches on the model: "
        "continuous batching and streaming as mlx-lm does them, the prompt cache reused (an entry "
        "that has evicted is continued, never trimmed; --prompt-cache-size 0 switches reuse off), "
        f"and GET {STATS_PATH} for the budget and the tokens kept and seen per layer.",
        epilog="Not offered: mlx_lm.server's --quantized-kv-start (its quantized cache would replace "
        "H2O's; --kv-bits here stores H2O's kept rows quantized), and, refused with the reason: "
        + "; ".join(f"--{d.replace('_', '-')} ({why})" for d, why in REFUSED.items()) + ".",
    )
    common.add_model_flag(parser)
    common.add_policy_flags(parser)
    common.add_allocation_flag(parser)
    parser.add_argument("--prompt-retention", choices=RETENTIONS, default="repeat",
                        help="repeat (default): a prompt whose tokens would overflow the budget is read with "
                        "cache_prompt's repeat pass up to its last --window tokens, so the entry the prompt "
                        "cache stores answers later questions too (a next turn, another question about the same "
                        "document); window: the adapter's own chunk scoring only (the prompt's last --window "
                        "queries choose what stays)")
    parser.add_argument("--prompt-share", type=float, default=None, metavar="SHARE",
                        help="with --prompt-retention repeat: the share of a head's budget (0-1) for the prompt's "
                        f"best windows of {WIDTH} tokens, kept whole in every layer and head (cache_prompt's share; "
                        f"default: cache_prompt's, {SHARE} where the budget is spread over every layer, 0 "
                        "otherwise; 0: none, which kept more codes of 2k-token documents: BENCHMARKS, Serve)")
    parser.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                        help="keep the prompt cache's entries as files in DIR too (the cache-prompt format), "
                        "written atomically when stored, removed when dropped, and loaded at start: a "
                        "conversation continues after a restart as a cache hit. DIR holds what the prompt "
                        "cache holds, so --prompt-cache-size and --prompt-cache-bytes bound it; a file that "
                        "does not fit this server (another model or policy, corrupt, partial) is skipped "
                        "with a log line")
    parser.add_argument("--full-cache", action="store_true",
                        help="serve with mlx-lm's own full caches instead of H2O (a baseline for comparisons: "
                        "the policy flags are ignored, the stats report no H2O layer)")
    parser.add_argument("--dequantize", action="store_true",
                        help="expand quantized weights to float32 (the same values, 4x the memory of 4-bit "
                        "weights): on a CPU, mlx's quantized matmuls cost per token even in a prompt, so "
                        "prompts are read far faster dequantized, most with OpenBLAS preloaded (README: serve)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="the longest prompt a request may send, in tokens (default: the model's context, "
                        "e.g. 8192 for SmolLM2); a longer one is answered 413")
    group = parser.add_argument_group("mlx_lm.server (its own flags, passed through)")
    for action in serve_compat.parser_actions(serve_compat.server_parser()):
        if action.dest in REPLACED:
            continue
        if action.dest in REFUSED:
            action.help = argparse.SUPPRESS
        if action.dest in CHANGED:
            action.default, action.help = CHANGED[action.dest]
        serve_compat.add_action(group, action)
    return parser


def server_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """The namespace mlx_lm.server's classes read (`ModelProvider.cli_args`): our flags, with
    mlx-lm's own KV quantization off (H2O's `--kv-bits` lives in the policy) and `model`
    the path or id served as `default_model`."""
    out = argparse.Namespace(**vars(args))
    out.model = model
    out.kv_bits, out.kv_group_size = None, 64
    out.quantized_kv_start = mlx_server.DEFAULT_QUANTIZED_KV_START
    return out


# ---------------------------------------------------------------- the model


class H2OModelProvider(serve_compat.FixedModelProvider):
    """mlx_lm.server's ModelProvider for one model, loaded with h2o-fn's `--model` loader
    (GGUF files too) and `use_h2o(model, config)` applied, so every cache mlx-lm builds is H2O."""

    def __init__(self, cli_args: argparse.Namespace, config: H2OConfig,
                 allocation_policy: str = allocation.DEFAULT_ALLOCATION, options: Optional[dict] = None):
        super().__init__(cli_args)
        self.config = config
        self.allocation = allocation_policy
        self.options = dict(options or {})  # use_h2o's prompt, evict_every, storage (common.cache_options)

    policy = property(lambda self: common.policy_of(self.config, self.options),
                      doc="The config, how the caches score a prompt chunk and store rows, as one value.")

    full_cache = property(lambda self: bool(getattr(self.cli_args, "full_cache", False)),
                          doc="mlx-lm's own caches instead of H2O (`--full-cache`, a baseline).")

    def stored_policy(self) -> Optional[dict]:
        """What a stored entry was made under: the policy's fields, None with `--full-cache`."""
        return None if self.full_cache else self.policy.fields()

    def load_model(self, model_path: str):
        model, tokenizer = common.load_model(model_path, getattr(self.cli_args, "dequantize", False))
        if self.full_cache:
            log.info("--full-cache: %s keeps mlx-lm's own caches (%s), no H2O", model_path,
                     sorted({type(c).__name__ for c in make_prompt_cache(model)}))
            return model, tokenizer
        budgets = allocation.budgets_for(model, self.allocation, self.config, tokenizer)
        use_h2o(model, self.config, budgets, **self.options)
        caches = make_prompt_cache(model)
        layers = h2o_caches(caches)
        budgets = [c.config.budget for c in layers]
        log.info("H2O on %d of %d layers of %s: %s; budgets (%s) %s", len(layers), len(caches),
                 model_path, ", ".join(f"{k}={v}" for k, v in self.policy.fields().items()), self.allocation,
                 budgets if len(set(budgets)) > 1 else f"{budgets[0]} in every layer")
        return model, tokenizer

    def limits(self) -> serve_requests.Limits:
        """What a request may ask of the loaded model (names, max_tokens, vocabulary)."""
        path, name = self.model_key[0], served_id(self.model_key[0])
        local = Path(path).expanduser()
        aliases = {path, local.name} | ({str(local.resolve())} if local.exists() else set())
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None) or len(self.tokenizer.vocab)
        return serve_requests.Limits(name, tuple(sorted(aliases - {name})), self.cli_args.max_tokens, int(vocab))

    def context(self) -> Optional[int]:
        """The model's context (tokens), when its config states one."""
        return getattr(getattr(self.model, "args", None), "max_position_embeddings", None)

    def h2o_budgets(self) -> List[int]:
        """The budget of each H2O layer, read from a cache list built for the model."""
        if self.model is None:
            return []
        return [c.config.budget for c in h2o_caches(make_prompt_cache(self.model))]


# ---------------------------------------------------------------- the prompt cache


class _Totals:
    """Per layer maxima of tokens kept and seen over the caches stored so far."""

    def __init__(self):
        self.caches = 0
        self.by_type: Dict[str, int] = {}  # mlx-lm's cache_type of each
        self.kept: List[int] = []
        self.seen: List[int] = []
        self.per_head = 0.0  # the most tokens kept per KV head, averaged over an entry's layers and heads

    def add(self, kept: List[int], seen: List[int], cache_type: str = "", per_head: float = 0.0) -> None:
        self.caches += 1
        self.by_type[cache_type] = self.by_type.get(cache_type, 0) + 1
        self.kept = _max(self.kept, kept)
        self.seen = _max(self.seen, seen)
        self.per_head = max(self.per_head, per_head)


def mean_per_head(layers: List[Any]) -> float:
    """Tokens kept per KV head, averaged over every H2O layer and head of one cache list: what
    a budget spread over layers and heads (the repeat pass's reading) holds to on average."""
    counts = [n for c in layers for row in c.tokens_per_head for n in row]
    return sum(counts) / len(counts) if counts else 0.0


def _max(a: List[int], b: List[int]) -> List[int]:
    return [max(x, y) for x, y in zip(a, b)] if a else list(b)


class H2OPromptCache(LRUPromptCache):
    """mlx-lm's LRU prompt cache, safe to read from the HTTP threads, with H2O figures.

    Bounded like mlx-lm's (`max_size` entries, `max_bytes` bytes: `--prompt-cache-size`,
    `--prompt-cache-bytes`, enforced whenever an entry is stored); an entry's bytes are
    its caches' `nbytes`, for H2O what the kept rows (packed with `--kv-bits`), their
    scores and positions really take.

    Held entries are packed (`at_rest.pack_layers`): an H2O layer whose slots mostly hold
    nothing (a selection's reserved slots, a short chat's free ones) keeps only its tokens'
    rows, and counts only those; it is unpacked into new arrays when fetched.

    Fetching is mlx-lm's search without its deep copy:
    - an H2O entry's immutable state is shared (`share`): a request's first write makes
      its own arrays, the entry is never changed;
    - a conversation's entry (mlx-lm's cache type "assistant") that the prompt extends and
      that cannot be trimmed (H2O has evicted) is handed to the request itself and leaves
      the prompt cache: the request's turn, stored when it ends, supersedes it, and
      continuing it allocates no second copy of it;
    - a longer entry is trimmed back only when trimmable (an H2O entry that has evicted
      never is);
    - when a request's cache is stored ("assistant"), the entries mlx-lm stored for its
      prompt on the way ("user": the prompt less its last token) are dropped, as mlx-lm
      drops them for its trimmable caches: a conversation holds one entry, its last turn
      (regenerating an answer then reads the prompt again);
    - an exact hit steps back one token (mlx-lm 0.32 would hand its batch generator
      nothing to feed): trimmed when trimmable, else the nearest shorter entry.
    `hand_over(tokens, cache, rest)` makes the next fetch of `tokens` return that (what a
    request's reading prepared). Every fetch counts as a hit (an entry reused) or a miss.
    With `store` (`serve_store.PromptCacheDir`) every entry held is also a file, written
    when stored and removed when dropped; `load(model)` files them again at start.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, store=None):
        super().__init__(max_size, max_bytes)
        self._lock = threading.RLock()
        self._totals: Dict[Any, _Totals] = {}
        self._handed: Optional[tuple] = None  # (tokens, cache, rest) for the next fetch of tokens
        self.store = store
        self._lent: Dict[tuple, Any] = {}  # tokens of entries handed to requests -> their model (file kept)
        self.hits = self.misses = self.hit_tokens = self.lent = self.superseded = 0

    # ------------------------------------------------------------ fetching

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        with self._lock:
            handed, self._handed = self._handed, None
            if handed is not None and handed[0] == tokens:
                return handed[1], handed[2]
            cache, rest = self._nearest(model, tokens)
            if cache is None:
                self.misses += 1
            else:
                self.hits += 1
                self.hit_tokens += len(tokens) - len(rest)
            return cache, rest

    def hand_over(self, tokens: List[int], cache, rest: List[int]) -> None:
        """The next fetch of `tokens` returns `(cache, rest)` (not counted again)."""
        with self._lock:
            self._handed = (list(tokens), cache, list(rest))

    def _nearest(self, model: Any, tokens: List[int]):
        cache, rest = self._fetch(model, tokens)
        if cache is None or rest or not tokens:
            return cache, rest
        if can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, 1)
            return cache, tokens[-1:]
        if len(tokens) < 2:
            return None, tokens
        cache, rest = self._nearest(model, tokens[:-1])
        return cache, rest + tokens[-1:]

    def _fetch(self, model: Any, tokens: List[int]):
        """mlx-lm's `fetch_nearest_cache` (0.32), sharing or taking entries instead of copying them."""
        found = serve_compat.search(self, model, tokens)
        if found.exact is not None:
            return share(serve_compat.entry(self, model, found.exact).prompt_cache), []
        short = len(found.shorter) if found.shorter is not None else 0
        if found.longer is not None and found.common_prefix > short:
            longer = serve_compat.entry(self, model, found.longer)
            if can_trim_prompt_cache(longer.prompt_cache):
                cache = share(longer.prompt_cache)
                prefix = min(len(tokens) - 1, found.common_prefix)
                trim_prompt_cache(cache, len(found.longer) - prefix)
                return cache, tokens[prefix:]
        if short > 0:
            shorter = serve_compat.entry(self, model, found.shorter)
            if shorter.cache_type == "assistant" and not can_trim_prompt_cache(shorter.prompt_cache):
                serve_compat.take(self, model, found.shorter)  # the conversation's next turn supersedes it
                self.lent += 1
                if self.store is not None:
                    self._lent[tuple(found.shorter)] = model
                return unpack_layers(shorter.prompt_cache, in_place=True), tokens[short:]
            return share(shorter.prompt_cache), tokens[short:]
        return None, tokens

    # ------------------------------------------------------------ storing

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *,
                     cache_type: str = "assistant", persist: bool = True):
        layers = h2o_caches(prompt_cache)
        kept, seen = [c.tokens_kept for c in layers], [c.tokens_seen for c in layers]
        with self._lock:
            before = serve_compat.held_keys(self)
            if cache_type == "assistant":  # the request's own prompt entry: superseded by its answer's
                for n in serve_compat.prefixes(self, model, tokens):
                    if serve_compat.entry(self, model, tokens[:n]).cache_type == "user":
                        serve_compat.take(self, model, tokens[:n])
                        self.superseded += 1
            held = pack_layers(prompt_cache)
            super().insert_cache(model, tokens, held, cache_type=cache_type)
            if layers:  # logged before `stats` can count it
                log.info("H2O cache stored (%s, %d tokens): %d layers, tokens kept per layer %s "
                         "(budget %s), seen %s; %d bytes (%d packed of %d)", cache_type, len(tokens), len(layers),
                         _span(kept), _span([c.config.budget for c in layers]), _span(seen),
                         sum(c.nbytes for c in held), sum(isinstance(c, PackedH2OKVCache) for c in held),
                         len(layers))
                self._totals.setdefault(model, _Totals()).add(kept, seen, cache_type, mean_per_head(layers))
            if self.store is not None:
                self._persist(model, tokens, held, cache_type, before, persist)

    def trim_to(self, **kwargs):
        with self._lock:
            before = serve_compat.held_keys(self)
            super().trim_to(**kwargs)
            self._drop_files(before)

    def _persist(self, model, tokens, prompt_cache, cache_type, before, write: bool) -> None:
        key = (model, tuple(tokens))
        # a request's prompt entry ("user") lives until its answer's is stored: not written
        if write and cache_type != "user" and key in serve_compat.held_keys(self):
            try:
                self.store.write(tokens, prompt_cache, cache_type)
            except (OSError, ValueError) as e:  # a full disk must not stop serving
                log.error("prompt-cache dir: the entry of %d tokens was not written: %s: %s", len(tokens),
                          type(e).__name__, e)
        for lent in [t for t, m in self._lent.items() if m == model and tuple(tokens[: len(t)]) == t]:
            del self._lent[lent]  # its continuation is stored: the lent entry's file goes
            self.store.remove(lent)
        self._drop_files(before | {key})

    def _drop_files(self, before: set) -> None:
        if self.store is None:
            return
        for _, tokens in before - serve_compat.held_keys(self):
            if tokens not in self._lent:
                self.store.remove(tokens)

    def load(self, model: Any, provider_model) -> int:
        """File again the entries `store` holds (oldest first, so the bounds drop the oldest);
        returns how many are held."""
        if self.store is None:
            return 0
        shared = shares_kv(provider_model)  # the model's caches are built to count them: once, not per entry
        for loaded in self.store.load(provider_model):
            keep_views(loaded.cache, shared)
            self.insert_cache(model, loaded.tokens, loaded.cache, cache_type=loaded.cache_type, persist=False)
        held = len(serve_compat.held_entries(self, model))
        files, size = self.store.usage()
        log.info("prompt-cache dir %s: %d entries loaded (%d files, %d bytes)", self.store.path, held, files, size)
        return held

    # ------------------------------------------------------------ figures

    def stats(self, model: Any) -> dict:
        """Tokens kept and seen per H2O layer: maxima over every cache stored for `model`
        since the start, and over the entries held now; the prompt cache's entries, bytes,
        bounds, hits and misses, and its directory."""
        with self._lock:
            totals = self._totals.get(model, _Totals())
            held = serve_compat.held_entries(self, model)
            now = _Totals()
            for entry in held:
                layers = h2o_layers(entry.prompt_cache)
                now.add([c.tokens_kept for c in layers], [c.tokens_seen for c in layers])
            out = {
                "stored": {"caches": totals.caches, "by_type": dict(totals.by_type),
                           "max_kept_per_layer": list(totals.kept),
                           "max_seen_per_layer": list(totals.seen),
                           "max_mean_kept_per_head": round(totals.per_head, 2)},
                "held": {"caches": len(held), "bytes": sum(e.nbytes for e in held),
                         "trimmable": sum(can_trim_prompt_cache(e.prompt_cache) for e in held),
                         "max_kept_per_layer": now.kept, "max_seen_per_layer": now.seen},
                "prompt_cache": {"entries": len(held), "bytes": sum(e.nbytes for e in held),
                                 "max_entries": self.max_size,
                                 "max_bytes": None if self.max_bytes >= 1 << 62 else self.max_bytes,
                                 "hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
                                 "lent": self.lent, "superseded": self.superseded},
            }
            if self.store is not None:
                files, size = self.store.usage()
                out["prompt_cache"]["dir"] = {"path": str(self.store.path), "files": files, "bytes": size,
                                              "writes": self.store.writes,
                                              "write_seconds": round(self.store.write_seconds, 3)}
            return out


def share(prompt_cache: List[Any]) -> List[Any]:
    """A cache list continuing `prompt_cache` without copying it: each H2O layer a new cache
    around the same immutable state (a write makes new arrays; the original never
    changes); a packed one (`at_rest.PackedH2OKVCache`) unpacked into new arrays; any other
    layer (mutable) deep-copied, as mlx-lm does."""
    def continued(c):
        if isinstance(c, PackedH2OKVCache):
            return c.unpack()
        if isinstance(c, H2OKVCache):
            return cache_of(type(c), c.policy, c.layer_state, c.keeps_view)
        return copy.deepcopy(c)

    return [continued(c) for c in prompt_cache]


class Reading(NamedTuple):
    """A long prompt being read before mlx-lm's generator sees it (`PromptReader`).

    item: mlx-lm's (response queue, request, arguments); prompt: all its tokens; cache:
    what the prompt cache found (or a fresh list), read into slice by slice; head: the
    tokens to read; tail: the tokens left to the generator (the question); done: tokens
    of head read so far (a one-element list, advanced in place).
    """

    item: tuple
    prompt: List[int]
    cache: List[Any]
    head: List[int]
    tail: List[int]
    cached: int  # tokens the prompt cache held (its hit)
    done: List[int]
    started: float


class PromptReader:
    """Reads the bulk of a long prompt before mlx-lm's generator sees it, query-agnostically,
    one slice at a time.

    `plan(cache, rest)`: given what the prompt cache found for a prompt (a cache or None,
    and the tokens it still lacks), None when mlx-lm's prefill keeps every token anyway
    (the rest fits the smallest budget) or the rest is no longer than `tail`; else
    `(cache, head, tail)`: all but the last `tail` tokens are read with `cache_prompt`'s
    repeat pass and mlx-lm feeds only the tail (the question, scored by its own queries
    as usual). `read(reading)` reads the next `slice` tokens of the head (one
    `cache_prompt` call, `chunk_size=slice`: cache_prompt continues a cache that holds
    tokens), which leaves every layer's state evaluated (it may run on another thread:
    nothing lazy crosses back). What mlx-lm stores at the end of the request kept what a
    later question can ask for, not only what this one asked. `share`: cache_prompt's share
    of each head's budget for the prompt's best windows (None: its default; `--prompt-share`).
    """

    def __init__(self, provider: "H2OModelProvider", tail: int, slice_tokens: int = 512,
                 share: Optional[float] = None):
        check_share(share)
        if tail < 1:
            raise ValueError(f"tail={tail} is invalid: expected >= 1 (mlx-lm feeds at least one token)")
        if slice_tokens < 1:
            raise ValueError(f"slice_tokens={slice_tokens} is invalid: expected >= 1")
        self.provider, self.tail, self.slice, self.share = provider, tail, slice_tokens, share
        self.prompts_read = 0  # prompts compressed so far (the log says each)

    def plan(self, cache: Optional[List[Any]], rest: List[int]):
        model = self.provider.model
        if model is None or len(rest) <= self.tail:
            return None
        cache = make_prompt_cache(model) if cache is None else cache
        layers = h2o_caches(cache)
        if not layers or max(c.tokens_kept for c in layers) + len(rest) <= min(c.config.budget for c in layers):
            return None  # nothing would be evicted: mlx-lm's prefill keeps every token anyway
        return cache, rest[: -self.tail], rest[-self.tail :]

    def read(self, reading: Reading) -> bool:
        """Read the next slice of `reading.head` into its cache; True once all of it is read."""
        done = reading.done[0]
        part = reading.head[done : done + self.slice]
        # tail: each head takes the generator's tail (the question) after its selection before evicting;
        # within: each slice is spread, and shares windows, as the whole head read in one call would be
        cache_prompt(self.provider.model, part, reading.cache, repeat_prefix=repeat_prefix(self.provider.tokenizer),
                     chunk_size=self.slice, tail=self.tail, share=self.share, within=(done, len(reading.head)))
        reading.done[0] = done + len(part)
        if reading.done[0] < len(reading.head):
            return False
        self.prompts_read += 1
        log.info("H2O prompt read with the repeat pass: %d tokens in %.1f s, %d left to the generator; kept per "
                 "layer %s", len(reading.head), time.monotonic() - reading.started, len(reading.tail),
                 _span([c.tokens_kept for c in h2o_caches(reading.cache)]))
        return True


class H2OResponseGenerator(serve_compat.GuardedGenerator):
    """The guarded generator that reads long prompts beside the other requests' decode steps.

    Each request is tokenized and looked up in the prompt cache as it arrives (`admit`).
    When `reader` plans a read (the prompt overflows the budget), the request waits in a
    queue of readings, oldest first. Their slices (`--prefill-step-size` tokens, one
    `cache_prompt` call each) are read one at a time on a thread of their own (MLX gives
    each thread its own stream; `cache_prompt` leaves the caches it reads into evaluated),
    so mlx-lm's loop keeps decoding the other requests meanwhile instead of waiting for a
    slice. `work`, called at each turn of that loop, collects a slice that ended and
    starts the next. A streaming client gets its status line and a keep-alive comment as
    soon as its reading is queued, then one per slice read; a reading whose client left is
    dropped before its next slice. When its head is read, the request goes to mlx-lm's loop
    with the cache and its tail (`H2OPromptCache.hand_over`), and its usage counts as cached
    only what the prompt cache held.
    """

    def __init__(self, model_provider, prompt_cache: H2OPromptCache, max_prompt_tokens: Optional[int] = None,
                 reader: Optional[PromptReader] = None):
        self.reader = reader
        self._readings: Deque[Reading] = deque()
        self._cached: Dict[int, int] = {}  # id(response queue) -> tokens the prompt cache held
        self._slice: Optional[Future] = None  # _readings[0]'s slice being read; result: whether it was the last
        self._slices: "Queue[tuple]" = Queue()  # (reading, future) for the reading thread
        self._reading_thread: Optional[threading.Thread] = None
        self.readings_dropped = 0
        super().__init__(model_provider, prompt_cache, max_prompt_tokens)

    def has_work(self) -> bool:
        """Readings wait, and none is being read: mlx-lm's loop waits for requests meanwhile."""
        return bool(self._readings) and (self._slice is None or self._slice.done())

    def forget_work(self) -> None:
        self._readings.clear()
        self._cached.clear()
        self._slice = None  # a slice being read ends unseen

    def admit(self, item):
        rqueue, request, args = item
        provider = self.model_provider
        if self.reader is None or provider.model is None:
            return item
        try:
            tokenized = self.tokenize_ahead(request, args)
        except Exception as e:  # noqa: BLE001 - what mlx-lm's loop does with it: the request's error
            rqueue.put(e)
            return None
        prompt = tokenized[0]
        if tokenized[4] is not None:  # images: mlx-lm serves them alone, with its own lookup
            return item
        cache, rest = self.prompt_cache.fetch_nearest_cache(provider.model_key, prompt)
        plan = self.reader.plan(cache, rest)
        if plan is None:
            self.prompt_cache.hand_over(prompt, cache, rest)
            return item
        cache, head, tail = plan
        reading = Reading(item, prompt, cache, head, tail, len(prompt) - len(rest), [0], time.monotonic())
        self._readings.append(reading)
        log.info("H2O prompt of %d tokens (%d cached): %d to read in slices of %d, %d reading(s) queued",
                 len(prompt), reading.cached, len(head), self.reader.slice, len(self._readings))
        rqueue.put((0, len(head)))  # a streaming client's status line and first keep-alive
        return None

    def work(self, busy: bool):
        if self._slice is not None:
            if not self._slice.done():
                return None
            done, self._slice = self._slice, None
            reading = self._readings[0]
            try:
                finished = done.result()
            except Exception as e:  # noqa: BLE001 - this request fails, the others are served
                log.error("reading a prompt failed (%s: %s): the request is answered with the error",
                          type(e).__name__, e, exc_info=e)
                self._readings.popleft()
                self.forget_tokens(reading.item[1])
                reading.item[0].put(e)
                return None
            for other in self._readings:  # one keep-alive per slice, to every reading waiting
                other.item[0].put((other.done[0], len(other.head)))
            if finished:
                self._readings.popleft()
                self._cached[id(reading.item[0])] = reading.cached
                self.prompt_cache.hand_over(reading.prompt, reading.cache, reading.tail)
                return reading.item
        while self._readings and self.left(self._readings[0].item[0]):
            reading = self._readings.popleft()
            self._drop(reading, f"the client left: its prompt's reading stopped after {reading.done[0]} of "
                       f"{len(reading.head)} tokens")
        if self._readings:
            self._slice = Future()
            self._slices.put((self._readings[0], self._slice))
            if self._reading_thread is None:
                self._reading_thread = threading.Thread(target=self._read_slices, name="h2o-reader", daemon=True)
                self._reading_thread.start()
        return None

    def _read_slices(self) -> None:
        """The reading thread: reads each slice it is given into its reading's cache."""
        while True:
            reading, done = self._slices.get()
            try:
                done.set_result(self.reader.read(reading))
            except BaseException as e:  # noqa: BLE001 - handed to the loop, which fails the request
                done.set_exception(e)

    def _drop(self, reading: Reading, why: str) -> None:
        log.info("%s", why)
        self.readings_dropped += 1
        self.forget_tokens(reading.item[1])
        reading.item[0].put(None)  # ends the waiting request's stopper

    def started(self, q, ctx) -> None:
        cached = self._cached.pop(id(q), None)
        if cached is not None:  # the tokens read here were not cached: usage says what the cache held
            ctx.prompt_cache_count = cached


def _span(xs: List[int]) -> str:
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def server_stats(response_generator) -> dict:
    """What `GET /v1/h2o/stats` returns (see the module docstring)."""
    provider = response_generator.model_provider
    model_key = provider.model_key
    budgets = provider.h2o_budgets()
    out = {
        "model": None if model_key is None else model_key[0],
        "policy": provider.stored_policy(),
        "h2o_layers": len(budgets),
        "budget_per_layer": budgets,
    }
    out.update(response_generator.prompt_cache.stats(model_key))
    # a long prompt read with the repeat pass spreads the budgets over layers and heads (a layer
    # may keep more than its budget), and each head then takes the generator's tail
    tail = response_generator.reader.tail if getattr(response_generator, "reader", None) else 0
    mean = out["stored"]["max_mean_kept_per_head"]
    out["within_budget"] = mean <= sum(budgets) / len(budgets) + tail if out["stored"]["caches"] else None
    return out


# ---------------------------------------------------------------- HTTP


def served_id(model_path: str) -> str:
    """The model's id in `/v1/models` and in answers: a GGUF file's stem, a model directory's
    name, else the id given (a hub id). Requests may also give the path itself."""
    path = Path(model_path).expanduser()
    if path.is_file():
        return path.stem
    return path.resolve().name if path.is_dir() else model_path


class H2OAPIHandler(serve_compat.GuardedHandler):
    """mlx_lm.server's handler with every request checked first, plus `GET /v1/h2o/stats`."""

    def do_GET(self):
        if self.path.split("?", 1)[0].rstrip("/") == STATS_PATH:
            return self.send_json(200, server_stats(self.response_generator))
        super().do_GET()


def serve(host: str, port: int, provider: H2OModelProvider, max_prompt_tokens: Optional[int] = None) -> None:
    """mlx_lm.server's `run` with the H2O prompt cache, the guarded generator and the checked
    handler; blocks until Ctrl-C, or exits with EXIT_CODE when generation keeps dying."""
    args = provider.cli_args
    reader = None
    if getattr(args, "prompt_retention", "window") == "repeat" and provider.h2o_budgets():
        reader = PromptReader(provider, max(provider.policy.prompt.window, 1), args.prefill_step_size,
                              getattr(args, "prompt_share", None))
    store = None
    if getattr(args, "prompt_cache_dir", None):
        from .serve_store import PromptCacheDir

        store = PromptCacheDir(args.prompt_cache_dir, served_id(provider.model_key[0]), provider.stored_policy())
    max_bytes = args.prompt_cache_bytes if args.prompt_cache_bytes is not None else 1 << 63
    prompt_cache = H2OPromptCache(args.prompt_cache_size, max_bytes, store=store)
    prompt_cache.load(provider.model_key, provider.model)
    generator = H2OResponseGenerator(provider, prompt_cache, max_prompt_tokens, reader)
    limits = provider.limits()
    provider.alias(limits.model_id)
    handler = serve_compat.handler_class(H2OAPIHandler, limits)
    serve_compat.run_http_server(host, port, generator, handler)
    if generator.deaths and not generator.generation_available():
        raise SystemExit(serve_compat.EXIT_CODE)


MALLOC_ARENAS = 2  # glibc's default is 8 per core


def bound_malloc_arenas(n: int = MALLOC_ARENAS) -> Optional[int]:
    """Cap glibc's malloc arenas at `n` (mallopt M_ARENA_MAX), unless MALLOC_ARENA_MAX is set.

    mlx_lm.server answers each request on a new thread; glibc gives threads their own
    arenas, up to 8 per core, and keeps what they freed. On the test server (2 cores)
    that was 25-33 MiB of RSS, reached in steps at random points of a soak; with 2
    arenas RSS stays within 1 MiB from the 30th request on, at the same speed
    (tests/test_serve.py's soak). The cap applied, or None (not glibc, or the user chose).
    """
    import ctypes
    import os

    if os.environ.get("MALLOC_ARENA_MAX"):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    return n if mallopt(-8, n) == 1 else None  # -8: M_ARENA_MAX in glibc's malloc.h


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    for dest, why in REFUSED.items():
        if getattr(args, dest) != parser.get_default(dest):
            parser.error(f"--{dest.replace('_', '-')} is not available with h2o-fn serve: {why}")
    config = common.policy_or_error(parser, args, args.budget)
    if mx.distributed.init().size() > 1:
        parser.error(REFUSED["pipeline"])
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    arenas = bound_malloc_arenas()
    if arenas:
        log.info("malloc: at most %d arenas (MALLOC_ARENA_MAX overrides)", arenas)
    if args.model is None:
        from ..gguf import INSTALL_HINT, default_gguf_path

        try:
            model = str(default_gguf_path())
        except FileNotFoundError as e:
            raise SystemExit(f"h2o-fn serve: {e} ({INSTALL_HINT})") from None
    else:
        model = str(Path(args.model).expanduser()) if Path(args.model).expanduser().exists() else args.model
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        parser.error(f"--max-prompt-tokens {args.max_prompt_tokens} is invalid: expected >= 1")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens} is invalid: expected >= 1")
    if args.prompt_share is not None and not 0 <= args.prompt_share <= 1:
        parser.error(f"--prompt-share {args.prompt_share} is invalid: expected 0 <= share <= 1")
    gone, installed = serve_compat.missing(), mlx_version()
    if gone or installed != serve_compat.MLX_LM_VERSION:
        log.warning("mlx-lm %s is installed; h2o-fn serve was written against %s%s", installed,
                    serve_compat.MLX_LM_VERSION, f" and misses: {'; '.join(gone)}" if gone else "")
    options = common.cache_options(parser, args)
    provider = H2OModelProvider(server_args(args, model), config, args.allocation, options)
    try:  # load here, so that a bad --model stops the command instead of the serving thread
        provider.load_default()
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"h2o-fn serve: {e}") from None
    max_prompt = args.max_prompt_tokens or provider.context()
    log.info("limits: prompts of at most %s tokens, at most %d new tokens per request, %d prompt tokens "
             "per prefill step", max_prompt or "any number of", args.max_tokens, args.prefill_step_size)
    log.info("prompt cache: %s", "off (--prompt-cache-size 0)" if args.prompt_cache_size <= 0 else
             f"on, at most {args.prompt_cache_size} entries and "
             f"{'any number of' if args.prompt_cache_bytes is None else args.prompt_cache_bytes} bytes"
             f"{'' if not args.prompt_cache_dir else ', kept in ' + args.prompt_cache_dir}: a stored H2O "
             "cache is continued when a prompt extends it (shared, never copied), and trimmed back only while "
             "it has evicted nothing")
    log.info("H2O stats: GET http://%s:%d%s", args.host, args.port, STATS_PATH)
    serve(args.host, args.port, provider, max_prompt)


def mlx_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")


if __name__ == "__main__":
    main()
