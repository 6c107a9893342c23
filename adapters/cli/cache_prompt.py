"""`python -m h2o_fn cache-prompt`: `mlx_lm.cache_prompt` that saves a compressed prompt cache.

The prompt (a document, a system prompt) is read chunk by chunk and compressed with
`cache_prompt`'s repeat pass (query-agnostic: the questions come later), so every H2O
layer keeps at most `--budget` tokens per KV head. Then

    h2o-fn generate --prompt-cache-file F --prompt "a question"

answers from it, as `mlx_lm.generate --prompt-cache-file` does from mlx-lm's file.

Flags are mlx_lm.cache_prompt's (--model, --prompt text or '-' for stdin,
--prompt-cache-file, --ignore-chat-template, --system-prompt) plus the H2O policy and
--chunk-size. With the chat template the prompt is the start of a user message
(`continue_final_message`), which the question continues, as in mlx-lm.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from h2o_fn import storage

from ..at_rest import unpack_layers
from ..attention import query_scoring
from ..export import to_kvcache
from ..mlx_lm import h2o_caches, keep_views, make_h2o_cache, shares_kv
from ..metrics import describe_kept, kept_summary
from ..retention import BUDGETS, CHUNK, POOL, SHARE, SURPRISAL, TAIL, WIDTH, WINDOWS, cache_prompt, repeat_prefix
from . import common

FORMAT = "h2o-fn compressed prompt cache 1"  # metadata["format"]: what generate checks first


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m h2o_fn cache-prompt",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_flag(parser)
    parser.add_argument("--prompt", "-p", required=True, help="the prompt to cache ('-' reads stdin)")
    parser.add_argument("--prompt-cache-file", required=True,
                        help="where to save the compressed cache (.safetensors)")
    parser.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="cache the prompt as raw text, without the tokenizer's chat template")
    parser.add_argument("--chunk-size", type=int, default=CHUNK,
                        help=f"prompt tokens read and scored per chunk; peak memory is about each layer's kept "
                        f"rows + 2 x chunk, plus one slice of attention weights (default {CHUNK})")
    parser.add_argument("--budgets", choices=BUDGETS, default=BUDGETS[0],
                        help="auto (default): layer when --budget is at least 45%% of the prompt, else "
                        "global; global: one selection over every layer and KV head keeps --budget x heads x "
                        "layers tokens where the repeat pass's scores are, so a head that copies from the prompt "
                        "keeps much and the others little; layer: --budget x heads per layer, spread over that "
                        "layer's heads; uniform: --budget in every head")
    parser.add_argument("--tail", type=int, default=TAIL,
                        help="with --budgets global or layer: tokens each head takes after the prompt (the "
                        f"question, the answer) before the rule evicts again (default {TAIL})")
    parser.add_argument("--repeat-pool", type=int, default=POOL,
                        help="the repeat pass scores each prompt token at least as its neighbours within pool // 2 "
                        "places, so kept tokens keep their neighbours (odd; 1: its scores as they are; "
                        f"default {POOL})")
    parser.add_argument("--repeat-surprisal", type=float, default=SURPRISAL,
                        help="each prompt token's score times 1 + this x its surprisal over the chunk's mean: what "
                        "the model could not predict is kept first (0: the repeat pass's scores as they are; "
                        f"default {SURPRISAL})")
    parser.add_argument("--share", type=float, default=None,
                        help="share of a head's budget (0-1) for the prompt's best windows of --share-width tokens, "
                        "kept whole in every layer and head; the rest is spread as --budgets says (not with uniform; "
                        f"default {SHARE} with a global selection, 0 with layer; 0: none)")
    parser.add_argument("--share-width", type=int, default=WIDTH,
                        help=f"tokens per shared window (default {WIDTH})")
    parser.add_argument("--share-windows", type=common.count_or_none, default=WINDOWS,
                        help=f"at most this many shared windows in the prompt (0: as many as --share holds; "
                        f"default {WINDOWS})")
    parser.add_argument("--kvcache", action="store_true",
                        help="save mlx-lm's plain KVCache instead (the kept keys re-rotated to consecutive "
                        "positions, h2o_fn.adapters.export): unmodified mlx_lm.generate --prompt-cache-file "
                        "loads it; BENCHMARKS.md measures what the re-rotation costs")
    common.add_policy_flags(parser)
    return parser


def prompt_ids(tokenizer, prompt: str, chat: bool, system: Optional[str]) -> List[int]:
    """The prompt's ids: raw text, or an unfinished user message the question continues."""
    if not chat or tokenizer.chat_template is None:
        return tokenizer.encode(prompt)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)


def full_cache_bytes(cache) -> int:
    """Bytes of the key and value rows a full KVCache of the tokens this H2O layer has seen
    would hold, in the dtype of its rows."""
    s = cache.core_state

    def row(store):  # (elements per row, bytes per element) unquantized
        return storage.width(store, cache.policy.kv.bits), storage.dtype_of(store).size

    B, H = s.positions.shape[:2]
    return B * H * cache.tokens_seen * sum(n * size for n, size in map(row, (s.keys, s.values)))


def metadata(args, tokenizer, policy, chat: bool, seen: int) -> dict:
    """Strings saved beside the arrays (safetensors metadata), read back by generate."""
    return {
        "format": FORMAT,
        "model": common.model_name(args.model),
        "chat_template": json.dumps(tokenizer.chat_template if chat else None),
        "h2o_policy": json.dumps(policy.fields()),
        "prompt_tokens": str(seen),
        "tokenizer_config": json.dumps({}),  # mlx_lm.generate reads it (its own overrides: none)
    }


def _reading_or_error(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """How the prompt is read, checked: the budgets' spread (uniform with --kvcache), then the
    repeat pass's and the shared windows' flags; exits through `parser.error` on a bad one."""
    spread = args.budgets
    if args.kvcache and spread != "uniform":  # a plain KVCache holds one count for every head
        spread = "uniform"
        print("--kvcache: every head keeps --budget tokens (plain KVCache rows hold one count per layer): "
              "--budgets uniform")
    if args.tail < 1:
        parser.error(f"--tail {args.tail} is invalid: expected at least 1")
    if args.repeat_pool < 1 or args.repeat_pool % 2 == 0:
        parser.error(f"--repeat-pool {args.repeat_pool} is invalid: expected an odd number >= 1 (1: no pooling)")
    if not 0 <= args.repeat_surprisal < float("inf"):
        parser.error(f"--repeat-surprisal {args.repeat_surprisal} is invalid: expected a finite number >= 0 "
                     "(0: scores as they are)")
    if args.share is not None and not 0 <= args.share <= 1:
        parser.error(f"--share {args.share} is invalid: expected 0 <= share <= 1 (of a head's budget; 0: none)")
    if spread == "uniform" and args.share:
        parser.error(f"--share {args.share} is invalid with uniform budgets (--budgets uniform or --kvcache): "
                     "expected 0 (windows are shared by a selection across heads)")
    if args.share_width < 1:
        parser.error(f"--share-width {args.share_width} is invalid: expected >= 1")
    if args.share_windows is not None and args.share_windows < 0:
        parser.error(f"--share-windows {args.share_windows} is invalid: expected >= 0 (0: no bound)")
    return spread


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.chunk_size < 1:
        parser.error(f"--chunk-size {args.chunk_size} is invalid: expected at least 1")
    out = Path(args.prompt_cache_file)
    if out.suffix != ".safetensors":
        parser.error(f"--prompt-cache-file {out} is invalid: expected a .safetensors file name")
    config = common.policy_or_error(parser, args, args.budget)
    options = common.cache_options(parser, args)
    spread = _reading_or_error(parser, args)
    model, tokenizer = common.load_or_exit("cache-prompt", args.model, dequantize=True)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        parser.error("--prompt is empty: expected text to cache")
    chat = not args.ignore_chat_template and tokenizer.chat_template is not None
    ids = prompt_ids(tokenizer, prompt, chat, args.system_prompt)
    start = time.perf_counter()
    with query_scoring(model):
        cache = make_h2o_cache(model, config, **options)
        cache_prompt(model, ids, cache, repeat_prefix=repeat_prefix(tokenizer), chunk_size=args.chunk_size,
                     budgets=spread, tail=args.tail, pool=args.repeat_pool,
                     surprisal=args.repeat_surprisal, share=args.share, width=args.share_width,
                     windows=args.share_windows)
    seconds = time.perf_counter() - start
    summary = kept_summary(h2o_caches(cache))
    if args.kvcache:
        try:
            cache = to_kvcache(model, cache)
        except ValueError as e:
            parser.error(f"--kvcache: {e}")
    policy = common.policy_of(config, options)
    save_prompt_cache(str(out), cache, metadata(args, tokenizer, policy, chat, len(ids)))
    print(f"h2o-fn cache-prompt: {common.model_name(args.model)}")
    print(f"H2O policy: {common.describe_policy(policy)}")
    print(f"Prompt: {len(ids)} tokens read in {seconds:.1f} s; kept {describe_kept(summary)} "
          f"(compression {len(ids) / max(summary['mean'], 1):.2f}x)")
    full = sum(full_cache_bytes(c) for c in h2o_caches(cache)) if not args.kvcache else None
    layout = "plain KVCache, positions 0..kept-1" if args.kvcache else "H2OKVCache"
    print(f"Saved {out} ({out.stat().st_size / 2**20:.2f} MiB, {layout})")
    if full:
        print(f"A full cache of these {len(ids)} tokens holds {full / 2**20:.2f} MiB of rows in this dtype "
              "(what mlx_lm.cache_prompt saves)")


def load(path: str, model, model_spec: Optional[str]):
    """`(cache, metadata)` from a prompt-cache file, checked against the model that will
    read it. Raises ValueError naming the mismatch (not a file of prompt caches, written
    for another model, layers that do not fit)."""
    if not Path(path).is_file():
        raise ValueError(f"--prompt-cache-file {path}: no such file")
    try:
        cache, meta = load_prompt_cache(path, return_metadata=True)
        cache = unpack_layers(cache)  # an entry file of `serve --prompt-cache-dir` holds packed layers
    except Exception as e:  # safetensors or mlx-lm's class lookup: the file is not a prompt cache
        raise ValueError(f"--prompt-cache-file {path} is not a prompt-cache file "
                         f"(expected one from h2o-fn cache-prompt or mlx_lm.cache_prompt): {e}") from None
    keep_views(cache, shares_kv(model))
    want = common.model_name(model_spec)
    if meta.get("model") not in (None, want):
        raise ValueError(f"--prompt-cache-file {path} was written for model {meta['model']!r}: "
                         f"expected {want!r} (give that --model)")
    if len(cache) != len(model.layers):
        raise ValueError(f"--prompt-cache-file {path} holds {len(cache)} layers: expected {len(model.layers)} "
                         f"for {want!r}")
    try:  # one token through a copy: shapes that do not fit fail here, not mid-generation
        mx.eval(model(mx.array([[0]]), cache=copy.deepcopy(cache)))
    except Exception as e:
        raise ValueError(f"--prompt-cache-file {path} does not fit model {want!r}: {e}") from None
    return cache, meta


def question_ids(tokenizer, question: str, meta: dict) -> List[int]:
    """The question's ids after a cached prompt: with the chat template the cached prompt
    is an unfinished user message, and the question ends it and opens the answer
    (mlx_lm.generate's `<query>` split)."""
    if json.loads(meta.get("chat_template", "null")) is None:
        return tokenizer.encode(question, add_special_tokens=False)
    template = lambda content: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    marked = template("<query>")
    text = template(question)[marked.index("<query>"):]
    return tokenizer.encode(text, add_special_tokens=False)


if __name__ == "__main__":
    main()
