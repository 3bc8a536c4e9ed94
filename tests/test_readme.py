"""The README's Python examples run as written: every ```python block is a
whole program (```py marks a fragment)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sandboxns

pytestmark = pytest.mark.smoke

README = Path(__file__).parent.parent / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL) if README.exists() else []


@pytest.mark.skipif(not EXAMPLES, reason="README.md is not next to the tests")
@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, tmp_path):
    if "import ray" in EXAMPLES[index] and not os.environ.get("SANDBOXNS_REQUIRE_RAY"):
        pytest.importorskip("ray")  # the example of sandboxns.ray needs its extra
    result = subprocess.run(
        [sys.executable, "-c", EXAMPLES[index]], check=False, capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    if "hello.txt" in EXAMPLES[index]:
        assert result.stdout == "hello\nhello\n"


@pytest.mark.skipif(not README.exists(), reason="README.md is not next to the tests")
def test_readme_places_every_public_name_in_a_tier():
    text = README.read_text()
    tiers = text[text.index("The public names, by how often") : text.index("## Backends")]
    assert set(sandboxns.__all__) <= set(re.findall(r"`([A-Za-z_]+)`", tiers))
