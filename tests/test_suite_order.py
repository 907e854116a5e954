"""The suite's own scheduling (tests/conftest.py): the longest files named there exist and are collected
first, so that `make test`'s two workers start on them instead of ending on them."""

from __future__ import annotations

import subprocess
import sys

from pmlm_testing import REPO_ROOT


def _longest_files() -> list[str]:
    # conftest.py is not importable by name (each test folder has one): read the list from its source.
    import ast

    tree = ast.parse((REPO_ROOT / "tests" / "conftest.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "LONGEST_FILES"]
    return ast.literal_eval(node.value)


def test_every_file_named_as_longest_exists():
    names = _longest_files()
    assert names and len(set(names)) == len(names)
    assert [name for name in names if not (REPO_ROOT / "tests" / name).is_file()] == []


def test_the_longest_files_are_collected_first_each_in_its_own_order():
    """test_layout.py sorts before test_slurm.py by name; collected, test_slurm.py (named) comes first,
    test_layout.py after it, and each file's tests keep their order."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               "tests/test_layout.py", "tests/test_slurm.py"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    files = [test_id.split("::")[0] for test_id in ids]
    first_layout = files.index("tests/test_layout.py")
    assert set(files[:first_layout]) == {"tests/test_slurm.py"} and set(files[first_layout:]) == {"tests/test_layout.py"}
    alone = subprocess.run([*command[:-2], "tests/test_slurm.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=120)
    assert [line for line in alone.stdout.splitlines() if "::" in line] == ids[:first_layout]
