"""Hypothesis profiles: "ci" (the default, used by `make test`) and "dev" (quick); and the
end-of-run summary: what a test records as `record_property("summary", text)` (the real
model's seed scenario) is printed after the results, also from xdist workers."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=25, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_SUMMARIES = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _SUMMARIES.extend(v for k, v in report.user_properties if k == "summary")


def pytest_terminal_summary(terminalreporter):
    if _SUMMARIES:
        terminalreporter.section("what the tests report")
        for line in _SUMMARIES:
            terminalreporter.write_line(line)


# The longest tests (seconds on 2 cores, cold kernel cache), slowest first. `make test` runs
# with -n 2 --dist worksteal, which hands each worker a contiguous half of the collection and
# lets an idle worker steal from the other's tail: a long test collected late would finish
# alone after everything else. So these go first, alternating between the two halves. (Not
# the commands' end-to-end runs: they time out at 120 s, and at the start of a run on a cold
# kernel cache every process compiles the same kernels at once.)
SLOW_FIRST = (
    "test_real_model.py::test_seed_failure_photosynthesis_does_not_collapse",
    "test_stateful.py::",
    "test_distributed.py::test_smollm2_3_kv_heads_over_3_ranks",
    "test_serve.py::test_a_soak_of_short_requests_keeps_memory_flat",
    "test_core_reference.py::test_step_matches_reference_every_token",
    "test_core_reference.py::test_query_single_tokens_match_reference",
    "test_serve.py::test_concurrent_plain_and_streaming_chats",
    "test_real_model.py::test_smollm2_logits_equal_kvcache_when_nothing_is_evicted",
    "test_distributed.py::test_tiny_llama_4_kv_heads_over_2_ranks",
)


def _rank(item):
    return next((i for i, s in enumerate(SLOW_FIRST) if s in item.nodeid), None)


def pytest_collection_modifyitems(config, items):
    """The SLOW_FIRST tests at the head of each half of the collection (see above); the
    order of everything else is kept. Every worker collects the same order."""
    slow = sorted((it for it in items if _rank(it) is not None), key=_rank)
    rest = [it for it in items if _rank(it) is None]
    first, second = slow[0::2], slow[1::2]
    k = max(len(items) // 2 - len(first), 0)
    items[:] = first + rest[:k] + second + rest[k:]
