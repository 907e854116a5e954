"""The suite's own scheduling (tests/conftest.py): the longest files named there exist and are collected
first, so that `make test`'s two workers start on them instead of ending on them."""

from __future__ import annotations

import os
import subprocess
import sys

from pmlm_testing import REPO_ROOT

ENV = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
"""The nested pytest runs as a fresh one even when this test runs in an xdist worker."""


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
    result = subprocess.run(command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    files = [test_id.split("::")[0] for test_id in ids]
    first_layout = files.index("tests/test_layout.py")
    assert set(files[:first_layout]) == {"tests/test_slurm.py"} and set(files[first_layout:]) == {"tests/test_layout.py"}
    alone = subprocess.run([*command[:-2], "tests/test_slurm.py"], cwd=REPO_ROOT, env=ENV, capture_output=True,
                           text=True, timeout=120)
    assert [line for line in alone.stdout.splitlines() if "::" in line] == ids[:first_layout]


def test_xdist_loadfile_runs_the_longest_files_first():
    """One worker runs the files in the order xdist queues them: test_slurm.py (1 test selected) before
    test_layout.py (6), where xdist's own --loadscope-reorder would queue the file with more tests first."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadfile", "-v", "-p", "no:cacheprovider",
         "tests/test_layout.py", "tests/test_slurm.py", "-k", "requests_the_papers or layout"],
        cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ran = [line.split("PASSED ")[1].split("::")[0] for line in result.stdout.splitlines() if "] PASSED " in line]
    assert ran[0] == "tests/test_slurm.py" and set(ran[1:]) == {"tests/test_layout.py"}, ran
