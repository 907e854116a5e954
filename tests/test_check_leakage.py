"""`python -m megatron_pmlm.check_leakage`: passes for every objective, catches broken masks."""

from __future__ import annotations

import pytest

from pmlm_testing import run_module
from megatron_pmlm.check_leakage import FAULTS, run_check
from megatron_pmlm.models.objectives import OBJECTIVES, PMLM_OBJECTIVES, UNILM_OBJECTIVES


@pytest.mark.parametrize("objective", PMLM_OBJECTIVES)
def test_every_objective_passes(objective):
    report = run_check("tiny", objective, examples=4, seed=1)
    assert report.passed, report.summary()
    assert report.checks["every token sees context and [M]"] > 0
    if OBJECTIVES[objective].pseudo_masked:
        assert report.checks["[P] of step k see originals of steps < k"] > 0
        assert report.checks["[P] of step k ignore originals of steps >= k"] > 0


@pytest.mark.parametrize("objective", UNILM_OBJECTIVES)
def test_every_unilm_objective_passes_exactly_both_ways(objective):
    """SPEC §8's table by perturbation: no output reacts to a token it may not see (a left-to-right
    token never to a later one; a seq2seq source never to the target, a target token never to a later
    target token) and every output reacts to every token it may see."""
    report = run_check("tiny", objective, examples=2, seed=1)
    assert report.passed, report.summary()
    for lm, _ in OBJECTIVES[objective].lm_mixture:
        assert report.checks[f"{lm}: every output reacts to what it sees"] > 0
        if lm != "bi":
            assert report.checks[f"{lm}: no output reacts to a token it may not see"] > 0


@pytest.mark.parametrize("fault", ["implicit", "later-originals"])
def test_a_broken_unilm_mask_is_caught(fault):
    report = run_check("tiny", "unilm", examples=1, seed=2, fault=fault)
    assert not report.passed
    for lm in ("l2r", "r2l", "s2s"):
        assert report.violations[f"{lm}: no output reacts to a token it may not see"] > 0, report.summary()


def test_without_relative_position_bias_too():
    assert run_check("tiny", "ae+par", examples=2, rel_pos=False).passed


@pytest.mark.parametrize("fault,category", [
    ("explicit", "[P] of step k ignore originals of steps >= k"),
    ("implicit", "context/[M] ignore originals"),
    ("over-restrictive", "[P] of step k see originals of steps < k"),
    ("later-originals", "[P] of step k ignore originals of steps >= k"),
])
def test_a_broken_mask_is_caught(fault, category):
    report = run_check("tiny", "ae+par", examples=2, fault=fault)
    assert not report.passed
    assert report.violations[category] > 0, report.summary()
    assert set(FAULTS) >= {fault}


def test_command_line_exit_codes():
    ok = run_module("megatron_pmlm.check_leakage", "--examples", "2")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS" in ok.stdout
    broken = run_module("megatron_pmlm.check_leakage", "--examples", "2", "--inject-fault", "explicit")
    assert broken.returncode == 1 and "FAIL" in broken.stdout
    bad = run_module("megatron_pmlm.check_leakage", "--objective", "mlm")
    assert bad.returncode == 2
    assert "unknown objective 'mlm'" in bad.stderr and "Traceback" not in bad.stderr
