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
import logging
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from h2o_fn import H2OConfig

from .. import allocation
from ..mlx_lm import h2o_caches, use_h2o
from ..retention import cache_prompt, repeat_prefix
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
    "prefill_step_size": (512, "prompt tokens read per step (default: 512; mlx-lm's is 2048): a long prompt is "
                          "read between the other requests' decode steps in slices this long, and H2O's "
                          "prompt scoring holds attention weights for one slice at a time"),
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

    def load_model(self, model_path: str):
        model, tokenizer = common.load_model(model_path, getattr(self.cli_args, "dequantize", False))
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

    def add(self, kept: List[int], seen: List[int], cache_type: str = "") -> None:
        self.caches += 1
        self.by_type[cache_type] = self.by_type.get(cache_type, 0) + 1
        self.kept = _max(self.kept, kept)
        self.seen = _max(self.seen, seen)


def _max(a: List[int], b: List[int]) -> List[int]:
    return [max(x, y) for x, y in zip(a, b)] if a else list(b)


class H2OPromptCache(LRUPromptCache):
    """mlx-lm's LRU prompt cache, safe to read from the HTTP threads, with H2O figures.

    Fetching is mlx-lm's (deep copies; a longer entry is trimmed only when trimmable, so
    an H2O entry that has evicted is never trimmed), except an exact hit: mlx-lm 0.32
    returns it with no token left to feed, which its batch generator rejects ("empty
    prompt"); here it steps back one token (trimmed when trimmable, else the nearest
    shorter entry). Every stored cache adds its tokens kept and seen per H2O layer to the
    totals `stats` reports, and is logged.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, reader: Optional["PromptReader"] = None):
        super().__init__(max_size, max_bytes)
        self._lock = threading.RLock()
        self._totals: Dict[Any, _Totals] = {}
        self.reader = reader

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        cache, rest = self._nearest(model, tokens)
        if self.reader is None:
            return cache, rest
        return self.reader.read(model, cache, rest)

    def _nearest(self, model: Any, tokens: List[int]):
        with self._lock:
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if cache is None or rest or not tokens:
                return cache, rest
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                return cache, tokens[-1:]
            if len(tokens) < 2:
                return None, tokens
            cache, rest = self._nearest(model, tokens[:-1])
            return cache, rest + tokens[-1:]

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *,
                     cache_type: str = "assistant"):
        layers = h2o_caches(prompt_cache)
        kept, seen = [c.tokens_kept for c in layers], [c.tokens_seen for c in layers]
        with self._lock:
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            if layers:  # logged before `stats` can count it
                log.info("H2O cache stored (%s, %d tokens): %d layers, tokens kept per layer %s "
                         "(budget %s), seen %s", cache_type, len(tokens), len(layers), _span(kept),
                         _span([c.config.budget for c in layers]), _span(seen))
                self._totals.setdefault(model, _Totals()).add(kept, seen, cache_type)

    def trim_to(self, **kwargs):
        with self._lock:
            super().trim_to(**kwargs)

    def stats(self, model: Any) -> dict:
        """Tokens kept and seen per H2O layer: maxima over every cache stored for `model`
        since the start, and over the entries held now."""
        with self._lock:
            totals = self._totals.get(model, _Totals())
            held = serve_compat.held_entries(self, model)
            now = _Totals()
            for entry in held:
                layers = h2o_caches(entry.prompt_cache)
                now.add([c.tokens_kept for c in layers], [c.tokens_seen for c in layers])
            return {
                "stored": {"caches": totals.caches, "by_type": dict(totals.by_type),
                           "max_kept_per_layer": list(totals.kept),
                           "max_seen_per_layer": list(totals.seen)},
                "held": {"caches": len(held), "bytes": sum(e.nbytes for e in held),
                         "trimmable": sum(can_trim_prompt_cache(e.prompt_cache) for e in held),
                         "max_kept_per_layer": now.kept, "max_seen_per_layer": now.seen},
            }


class PromptReader:
    """Reads the bulk of a long prompt before mlx-lm's generator sees it, query-agnostically.

    Called (on the generation thread) with what the prompt cache found for a prompt: a
    cache (or None) and the tokens it still lacks. When those tokens would overflow the
    smallest budget, all but the last `tail` of them are read with `cache_prompt`'s
    repeat pass, and mlx-lm feeds only the tail (the question, scored by its own queries
    as usual). What mlx-lm then stores, at the end of the request, kept what a later
    question can ask for, not only what this one asked.
    """

    def __init__(self, provider: "H2OModelProvider", tail: int):
        if tail < 1:
            raise ValueError(f"tail={tail} is invalid: expected >= 1 (mlx-lm feeds at least one token)")
        self.provider, self.tail = provider, tail
        self.prompts_read = 0  # prompts compressed so far (the log says each)

    def read(self, model_key: Any, cache: Optional[List[Any]], rest: List[int]):
        model = self.provider.model
        if model is None or model_key != self.provider.model_key or len(rest) <= self.tail:
            return cache, rest
        cache = make_prompt_cache(model) if cache is None else cache
        layers = h2o_caches(cache)
        if not layers or max(c.tokens_kept for c in layers) + len(rest) <= min(c.config.budget for c in layers):
            return cache, rest  # nothing would be evicted: mlx-lm's prefill keeps every token anyway
        head = rest[: -self.tail]
        cache_prompt(model, head, cache, repeat_prefix=repeat_prefix(self.provider.tokenizer))
        self.prompts_read += 1
        log.info("H2O prompt read with the repeat pass: %d tokens, %d left to the generator; kept per "
                 "layer %s", len(head), self.tail, _span([c.tokens_kept for c in layers]))
        return cache, rest[-self.tail :]


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
        "policy": provider.policy.fields(),
        "h2o_layers": len(budgets),
        "budget_per_layer": budgets,
    }
    out.update(response_generator.prompt_cache.stats(model_key))
    kept = out["stored"]["max_kept_per_layer"]
    out["within_budget"] = all(k <= b for k, b in zip(kept, budgets)) if kept else None
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
    reader = None
    if getattr(provider.cli_args, "prompt_retention", "window") == "repeat":
        reader = PromptReader(provider, max(provider.policy.prompt.window, 1))
    prompt_cache = H2OPromptCache(provider.cli_args.prompt_cache_size, reader=reader)
    generator = serve_compat.GuardedGenerator(provider, prompt_cache, max_prompt_tokens)
    limits = provider.limits()
    provider.alias(limits.model_id)
    handler = serve_compat.handler_class(H2OAPIHandler, limits)
    serve_compat.run_http_server(host, port, generator, handler)
    if generator.deaths and not generator.generation_available():
        raise SystemExit(serve_compat.EXIT_CODE)


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
             f"on, {args.prompt_cache_size} entries: a stored H2O cache is continued when a prompt "
             "extends it, and trimmed back only while it has evicted nothing")
    log.info("H2O stats: GET http://%s:%d%s", args.host, args.port, STATS_PATH)
    serve(args.host, args.port, provider, max_prompt)


def mlx_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")


if __name__ == "__main__":
    main()
