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
