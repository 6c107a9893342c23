"""One rank of a distributed H2O run (started by tests/test_distributed.py under mlx.launch,
or alone as the single-process reference): greedy tokens and every local head's kept
positions, as one JSON line per rank.

    python distributed_run.py {smollm,tiny} SCORING BUDGET MAX_TOKENS
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from h2o_fn import H2OConfig, kept_positions  # noqa: E402
from h2o_fn.adapters.distributed import shard  # noqa: E402
from h2o_fn.adapters.mlx_lm import h2o_caches, make_h2o_cache  # noqa: E402


def main(which: str, scoring: str, budget: int, max_tokens: int) -> None:
    if which == "smollm":
        from h2o_fn.adapters.gguf import load_gguf

        model, tokenizer = load_gguf()
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Explain photosynthesis in detail."}], add_generation_prompt=True)
    else:
        from tiny_models import tiny_model

        model = tiny_model("llama", num_key_value_heads=4, num_attention_heads=8, hidden_size=128)
        prompt = list(range(3, 40))
    group = shard(model)
    cache = make_h2o_cache(model, H2OConfig(budget=budget, n_sink=2, grace=4, scoring=scoring))
    ids = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache)]
    kept = [kept_positions(c.core_state)[0].tolist() for c in h2o_caches(cache)]  # [layer][head][slot]
    print(json.dumps({"rank": group.rank(), "size": group.size(), "ids": ids, "kept": kept,
                      "seen": cache[0].tokens_seen}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
