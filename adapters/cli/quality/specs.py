"""What every quality section shares: the run (model, tokenizer, flags, policy), the caches
compared (specs: a name, a family, a budget and the H2O config where there is one) and
how to build one."""

from typing import List, Optional

from h2o_fn import H2OConfig, Storage

from ... import allocation
from ...metrics import corpus_tokens
from ...mlx_lm import h2o_layer_count, make_h2o_cache
from .. import baselines, common
from ..baselines import Baseline


PROMPTS = [
    "Explain photosynthesis in detail.",
    "Write a short story about a robot who learns to paint.",
    "Explain how a computer's CPU executes a program, step by step.",
    "What were the main causes of the French Revolution? Answer in detail.",
]


# cache_prompt's retrieval rows: (family, name, spread; None leaves cache_prompt's default, "auto")
REPEAT_ROWS = (
    ("repeat", "H2O repeat (cache_prompt, chunk {chunk})", None),
    ("repeat-global", "H2O repeat, one selection over all layers", "global"),
    ("repeat-layer", "H2O repeat, budgets per layer", "layer"),
    ("repeat-uniform", "H2O repeat, budgets uniform per head", "uniform"),
    ("repeat-kvcache", "H2O repeat, saved as KVCache (re-rotated)", "uniform"),
)
RETRIEVAL_FAMILIES = ("rotating", "h2o-key", "h2o-query") + tuple(family for family, _, _ in REPEAT_ROWS)


class Run:
    """What every section reads: the model, the tokenizer, the flags, and the policy."""

    def __init__(self, model, tokenizer, args, parser, command: str):
        self.model, self.tokenizer, self.args, self.parser = model, tokenizer, args, parser
        self.command = command
        self.options = common.cache_options(parser, args)  # every H2O cache's prompt, evict_every, storage
        self._tokens = None

    def tokens(self) -> List[int]:
        if self._tokens is None:
            self._tokens = corpus_tokens(self.tokenizer, self.args.tokens, self.args.text_file)
        return self._tokens

    def policy(self, budget: int, **changes) -> H2OConfig:
        return common.policy_or_error(self.parser, self.args, budget, **changes)

    def budgets(self, policy: str, config: H2OConfig) -> List[int]:
        """The per-layer budgets of an allocation policy at this config (spelled out)."""
        return allocation.describe(allocation.budgets_for(self.model, policy, config, self.tokenizer),
                                   config, h2o_layer_count(self.model))


def h2o_name(scoring: str, extra: str = "", bits: Optional[int] = None) -> str:
    return f"H2O {scoring}{extra}" + (f" {bits}-bit" if bits else "")


def cache_specs(run: Run, budgets: List[int], ablations: bool, prefills=("oneshot",),
                allocations=()) -> List[dict]:
    """Every cache to compare: name, family, budget, and the H2O config where there is one."""
    specs = [{"name": "full KVCache", "family": "full", "budget": None}]
    for b in budgets:
        keep = run.policy(b).n_sink  # the baseline keeps as many first tokens as H2O's sinks
        specs.append({"name": f"RotatingKVCache keep={keep}", "family": "rotating", "budget": b,
                      "keep": keep})
        for scoring in ("key", "query"):
            for prefill in prefills:
                cfg = run.policy(b, scoring=scoring, prefill=prefill)
                extra = f" {prefill}" if len(prefills) > 1 else ""
                specs.append({"name": h2o_name(scoring, extra, run.options["kv_bits"]), "family": f"h2o-{scoring}", "budget": b,
                              "config": cfg})
        for policy in allocations:  # per-layer budgets at the same bytes (true query, oneshot)
            cfg = run.policy(b, scoring="query", prefill="oneshot")
            specs.append({"name": f"H2O query {policy}", "family": "allocation", "budget": b, "config": cfg,
                          "allocation": policy, "budgets": run.budgets(policy, cfg)})
    if ablations:
        b = budgets[min(1, len(budgets) - 1)]
        for scoring in ("key", "query"):
            base = run.policy(b, scoring=scoring)
            for label, change in (
                ("grace=0 decay=1 (Algorithm 1)", dict(n_sink=0, grace=0, decay=1.0)),
                ("grace=0", dict(grace=0)),
                ("decay=1", dict(decay=1.0)),
            ):
                specs.append({"name": f"H2O {scoring} {label}", "family": f"ablation-{scoring}", "budget": b,
                              "config": base._replace(**change)})
    return specs


# the spec families that are mlx-lm baselines (ppl and retrieval name them by kind, the
# frontier by class: its plot labels its series by family)
BASELINE_FAMILIES = {"full": "full", "full KVCache": "full", "rotating": "rotating",
                     "RotatingKVCache": "rotating", "QuantizedKVCache": "quantized"}


def build_cache(model, spec: dict, options: dict) -> list:
    """The cache list of `spec`: a baseline, or H2O with the spec's config and the run's
    `options` (`common.cache_options`: prompt, evict_every, kv_bits and kv_group_size, the
    last two the spec's own where it has "bits")."""
    family = BASELINE_FAMILIES.get(spec["family"])
    if family is not None:
        return baselines.build(model, Baseline(family, budget=spec.get("budget"), keep=spec.get("keep", 0),
                                               bits=spec.get("bits"), group_size=spec.get("group_size", 64)))
    kv = storage_of(spec, options)
    options = {**options, "kv_bits": kv.bits, "kv_group_size": kv.group_size}
    return make_h2o_cache(model, spec["config"], budgets=spec.get("budgets"), **options)


def describe(spec: dict, options: dict) -> dict:
    """`spec` as JSON: an H2O spec's config with the storage its cache takes (`build_cache`)."""
    out = {k: v for k, v in spec.items() if k != "config"}
    if "config" in spec:
        out["config"] = {**spec["config"]._asdict(), **storage_of(spec, options).fields()}
    return out


def storage_of(spec: dict, options: dict) -> Storage:
    """The row storage of an H2O spec: its own "bits" (the frontier's), else the run's."""
    if "bits" in spec:
        return Storage(spec["bits"], spec.get("group_size", 64))
    return Storage(options["kv_bits"], options["kv_group_size"])


def vs(ppl: float, full: float) -> str:
    return f"{100 * (ppl / full - 1):+.1f}%"
