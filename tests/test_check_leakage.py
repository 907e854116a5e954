"""`python -m megatron_pmlm.check_leakage`: passes for every objective, catches broken masks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_pmlm.check_leakage import FAULTS, run_check
from megatron_pmlm.objectives import OBJECTIVES


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_every_objective_passes(objective):
    report = run_check("tiny", objective, examples=4, seed=1)
    assert report.passed, report.summary()
    assert report.checks["every token sees context and [M]"] > 0
    if OBJECTIVES[objective].pseudo_masked:
        assert report.checks["[P] of step k see originals of steps < k"] > 0
        assert report.checks["[P] of step k ignore originals of steps >= k"] > 0


def test_without_relative_position_bias_too():
    assert run_check("tiny", "ae+par", examples=2, rel_pos=False).passed


@pytest.mark.parametrize("fault,category", [
    ("explicit", "[P] of step k ignore originals of steps >= k"),
    ("implicit", "context/[M] ignore originals"),
    ("over-restrictive", "[P] of step k see originals of steps < k"),
])
def test_a_broken_mask_is_caught(fault, category):
    report = run_check("tiny", "ae+par", examples=2, fault=fault)
    assert not report.passed
    assert report.violations[category] > 0, report.summary()
    assert set(FAULTS) >= {fault}


def test_command_line_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "megatron_pmlm.check_leakage", "--examples", "2"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS" in ok.stdout
    broken = subprocess.run([sys.executable, "-m", "megatron_pmlm.check_leakage", "--examples", "2",
                             "--inject-fault", "explicit"], capture_output=True, text=True)
    assert broken.returncode == 1 and "FAIL" in broken.stdout
    bad = subprocess.run([sys.executable, "-m", "megatron_pmlm.check_leakage", "--objective", "mlm"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown objective 'mlm'" in bad.stderr and "Traceback" not in bad.stderr
