"""In CI every test must run: with RLX_NO_SKIPS=1 a skipped test is reported as failed.

A skip there means a broken install (the model package, a tool the test needs),
and a broken install must never look green. `.ci/run` sets the variable.
"""

from __future__ import annotations

import os

import pytest

NO_SKIPS_ENV = "RLX_NO_SKIPS"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and os.environ.get(NO_SKIPS_ENV) == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} was skipped, but {NO_SKIPS_ENV}=1 requires every test to run: {reason}"
        )
    return report
