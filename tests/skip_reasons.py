"""A pytest plugin: a skip inside an async test or fixture keeps its reason.

pytest-trio (0.8) sees a skip raised under trio as an exception group and
raises a bare ``pytest.skip()`` of its own, so ``pytest -rs`` says only
"Skipped" at a line of pytest's. The skip it replaced is that exception's
context: report its reason and where the test raised it."""

from __future__ import annotations

import traceback

import pytest
from _pytest.outcomes import Skipped


def _skip_inside(exc: BaseException | None) -> Skipped | None:
    pending = [exc.__context__] if exc is not None else []
    while pending:
        current = pending.pop()
        if isinstance(current, Skipped) and current.msg:
            return current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if report.skipped and call.excinfo is not None and isinstance(report.longrepr, tuple):
        original = _skip_inside(call.excinfo.value)
        if original is not None:
            frames = [
                frame for frame in traceback.extract_tb(original.__traceback__) if "/_pytest/" not in frame.filename
            ]
            path, lineno = (frames[-1].filename, frames[-1].lineno) if frames else report.longrepr[:2]
            report.longrepr = (path, lineno, f"Skipped: {original.msg}")
    return report
