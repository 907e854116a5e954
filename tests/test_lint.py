"""The tree stays free of what pyflakes finds: unused imports and names, redefinitions, undefined
names (a typo in a rarely taken error path is a NameError in a user's 20-day run)."""

from __future__ import annotations

import subprocess
import sys

from pmlm_testing import REPO_ROOT

CHECKED = ["megatron_pmlm", "data_prep", "tools", "tests"]


def test_pyflakes_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "pyflakes", *CHECKED], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
