"""Every skip says why in ``pytest -rs`` (tests/skip_reasons.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ASYNC_SKIP = """import pytest
import trio


async def test_skips():
    await trio.sleep(0)
    pytest.skip("the reason given")
"""


@pytest.mark.parametrize("with_plugin", [True, False])
def test_a_skip_in_an_async_test_keeps_its_reason(tmp_path, with_plugin):
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrio_mode = true\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["skip_reasons"]\n' if with_plugin else "")
    (tmp_path / "test_it.py").write_text(ASYNC_SKIP)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "test_it.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Without the plugin, pytest-trio's own bare skip: which is why it exists.
    assert ("SKIPPED [1] test_it.py:7: the reason given" in done.stdout) is with_plugin, done.stdout
