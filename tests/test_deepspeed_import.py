"""DeepSpeed is imported without MLflow (parallel/deepspeed_import.py): its autotuner imports MLflow at
module level, 1.5-2 s of every training process's start where MLflow is installed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED_IMPORT = re.compile(r"^\s*(import deepspeed\b|from deepspeed[\w.]* import )")


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="MLflow is not installed (the .[tracking] "
                    "extra): DeepSpeed imports nothing more then")
def test_deepspeed_comes_without_mlflow_and_mlflow_still_imports_afterwards():
    out = run_python(
        "import sys\n"
        "from megatron_pmlm.parallel.deepspeed_import import import_deepspeed\n"
        "deepspeed = import_deepspeed()\n"
        "from deepspeed.autotuning import autotuner\n"
        "print('mlflow' in sys.modules, autotuner.has_mlflow, import_deepspeed() is deepspeed)\n"
        "import mlflow\n"
        "print(mlflow.__name__, type(sys.modules['mlflow']).__name__)\n")
    assert out.splitlines() == ["False False True", "mlflow module"]
    # Without the guard DeepSpeed's import brings MLflow in: the test measures something.
    assert run_python("import sys, deepspeed\nprint('mlflow' in sys.modules)") == "True"


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="MLflow is not installed")
def test_mlflow_imported_first_is_left_to_deepspeed():
    out = run_python(
        "import mlflow\n"
        "from megatron_pmlm.parallel.deepspeed_import import import_deepspeed\n"
        "import_deepspeed()\n"
        "from deepspeed.autotuning import autotuner\n"
        "print(autotuner.has_mlflow)\n")
    assert out == "True"


def guarded(lines: list[str], number: int) -> bool:
    """Whether `import_deepspeed()` is called between line `number` and the `def` it is in."""
    for line in reversed(lines[:number]):
        if "import_deepspeed()" in line:
            return True
        if re.match(r"\s*(async )?def ", line):
            return False
    return False


def test_every_deepspeed_import_of_the_package_and_tools_goes_through_import_deepspeed():
    """A DeepSpeed import statement is the first of its process wherever a code path reaches it
    first: each one in megatron_pmlm/ and tools/ comes after an `import_deepspeed()` call in the
    same function."""
    unguarded = []
    files = [*(REPO_ROOT / "megatron_pmlm").rglob("*.py"), *(REPO_ROOT / "tools").glob("*.py")]
    for path in files:
        if path.name == "deepspeed_import.py":
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if DEEPSPEED_IMPORT.match(line) and not guarded(lines, number):
                unguarded.append(f"{path.relative_to(REPO_ROOT)}:{number + 1}: {line.strip()}")
    assert not unguarded, "call import_deepspeed() first (parallel/deepspeed_import.py):\n" + "\n".join(unguarded)
