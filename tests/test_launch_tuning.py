"""The triton attention kernels' launch tuned where they run (models/launch_tuning.py): the register
cap offered where registers bound the programs an SM holds; the fastest candidate kept, announced
once per problem, a failing candidate left out; and on the real kernels (the attention kernels and
the table gradient's bucket_sums in Triton's interpreter, where PMLM_TRITON_LAUNCH_TUNING=on tunes)
the same outputs, kept bits and gradients as the untuned launch, each problem tuned once, a given
attention launch never tuned. The GPU side (each candidate computes the same
bits) is in tests/test_gpu.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
import types

import pytest
import torch

from megatron_pmlm.config import ConfigError, model_config_from_preset
from megatron_pmlm.models import launch_tuning
from megatron_pmlm.models.accelerated import value_from_environment
from megatron_pmlm.models.bucket_attention import KernelShape
from megatron_pmlm.models.model import check_attention_backend
from pmlm_testing import REPO_ROOT, RUN_ENVIRONMENT, run_python


def test_a_register_cap_is_offered_where_registers_bound_the_programs():
    """The forward at seq 128's width on SM 9.0: 211 registers a thread, 24 KiB of shared memory, 4
    warps: two programs an SM; capped at 168, three. No cap where shared memory bounds the programs,
    where one more program would need fewer than MIN_REGISTER_CAP, or where the kernel already fits."""
    assert launch_tuning.resident_programs(211, 4, 24 * 1024) == 2
    assert launch_tuning.register_cap_for_one_more_program(211, 4, 24 * 1024) == 168
    assert launch_tuning.resident_programs(168, 4, 24 * 1024) == 3
    assert launch_tuning.register_cap_for_one_more_program(211, 4, 100 * 1024) is None  # 2 programs by shared memory
    assert launch_tuning.register_cap_for_one_more_program(40, 4, 1024) is None  # 12 programs; 13 would need 32
    assert launch_tuning.register_cap_for_one_more_program(168, 8, 24 * 1024) == 128  # 8 warps: 1 -> 2 programs
    a100 = launch_tuning.SMResources(shared_bytes=164 * 1024)
    assert launch_tuning.register_cap_for_one_more_program(211, 4, 60 * 1024, a100) is None  # 2 programs by shared
    assert launch_tuning.register_cap_for_one_more_program(211, 4, 24 * 1024, a100) == 168


class _Compiled(types.SimpleNamespace):
    """What Triton's launch returns, as far as the tuner reads it."""


def test_the_fastest_candidate_is_kept_and_announced_once_and_a_failing_one_left_out(capfd):
    """Candidates: the base, its other stage count, and each capped to fit one more program; a
    candidate that raises is left out (announced as failed), the base's error is raised as it is;
    later launches of the problem run the kept shape once, untimed and unannounced."""
    base = KernelShape(64, 64, 4, 1)
    seconds = {"64x64w4s1": 0.004, "64x64w4s2": 0.002, "64x64w4s1r168": 0.001}
    launched = []

    def launch(shape: KernelShape):
        launched.append(str(shape))
        if str(shape) not in seconds:
            raise RuntimeError("out of resources (injected)")
        time.sleep(seconds[str(shape)])
        return _Compiled(n_regs=168 if shape.max_registers else 211, metadata=_Compiled(shared=24 * 1024))

    launch_tuning.forget_choices()
    capfd.readouterr()
    cpu = torch.device("cpu")
    launch_tuning.tuned_launch("kernel", base, ("problem", 1), launch, cpu, tune=True, describe=lambda: "a test")
    choice = launch_tuning.chosen_launches()[("kernel", base, "cpu", ("problem", 1))]
    assert str(choice.shape) == "64x64w4s1r168"
    assert [str(shape) for shape in choice.times] == ["64x64w4s1", "64x64w4s2", "64x64w4s1r168", "64x64w4s2r168"]
    assert choice.times[base._replace(num_stages=2, max_registers=168)] is None
    assert all(ms >= 1.0 for ms in choice.times.values() if ms is not None)
    assert launched[-1] == "64x64w4s1r168"  # the outputs the caller reads: the kept launch's
    announced = capfd.readouterr().err
    assert announced.count("triton launch tuning:") == 1, announced
    assert "kernel for a test: 64x64w4s1r168 (ms a launch: 64x64w4s1 " in announced and "64x64w4s2r168 failed" in announced
    launched.clear()
    launch_tuning.tuned_launch("kernel", base, ("problem", 1), launch, cpu, tune=True)
    assert launched == ["64x64w4s1r168"] and "tuning" not in capfd.readouterr().err
    launched.clear()
    launch_tuning.tuned_launch("kernel", base, ("problem", 2), launch, cpu, tune=False)
    assert launched == ["64x64w4s1"] and len(launch_tuning.chosen_launches()) == 1
    with pytest.raises(RuntimeError, match="injected"):
        launch_tuning.tuned_launch("kernel", base._replace(num_warps=8), ("problem", 3), launch, cpu, tune=True)
    launch_tuning.forget_choices()
    assert launch_tuning.chosen_launches() == {}


def test_the_setting_is_read_and_a_bad_value_stops_a_triton_model(monkeypatch):
    """PMLM_TRITON_LAUNCH_TUNING: auto (the default: a GPU's launches, not the interpreter's, unless
    the launch was given), off, on; anything else keeps auto and a triton model refuses to start naming
    it (sdpa is not concerned)."""
    for value, expected in (("on", ("on", None)), ("off", ("off", None)), (None, ("auto", None)),
                            ("always", ("auto", "PMLM_TRITON_LAUNCH_TUNING='always': give auto (the default) or "
                                                "off or on"))):
        if value is None:
            monkeypatch.delenv(launch_tuning.TUNING_ENV, raising=False)
        else:
            monkeypatch.setenv(launch_tuning.TUNING_ENV, value)
        assert value_from_environment(launch_tuning.TUNING_ENV, launch_tuning.TUNING_CHOICES) == expected
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert launch_tuning.tunes(cuda, interpreted=False, pinned=False) and not launch_tuning.tunes(cpu, True, False)
    assert not launch_tuning.tunes(cuda, interpreted=False, pinned=True)
    with launch_tuning.tuning("on"):
        assert launch_tuning.tunes(cpu, True, False) and not launch_tuning.tunes(cpu, True, True)
    with launch_tuning.tuning("off"):
        assert not launch_tuning.tunes(cuda, False, False)
    with pytest.raises(ValueError, match="launch tuning 'fast': give auto, off, on"):
        with launch_tuning.tuning("fast"):
            pass
    monkeypatch.setattr(launch_tuning, "TUNING_PROBLEM", "PMLM_TRITON_LAUNCH_TUNING='always': give auto (the "
                                                         "default) or off or on")
    config = model_config_from_preset("tiny", attention_backend="triton")
    with pytest.raises(ConfigError, match="PMLM_TRITON_LAUNCH_TUNING='always'"):
        check_attention_backend(config)
    check_attention_backend(dataclasses.replace(config, attention_backend="sdpa"))


TUNED = r"""
import json, sys
import torch
from megatron_pmlm.models import bucket_attention as ba, launch_tuning as lt

def run(queries, dropout, dtype=torch.float32, batch=2, heads=2, head_dim=16, bins=8):
    generator = torch.Generator().manual_seed(queries)
    q, k, v = (torch.randn(batch, heads, queries, head_dim, generator=generator).to(dtype).requires_grad_()
               for _ in range(3))
    allowed = torch.rand(batch, queries, queries, generator=generator) > 0.3
    codes = ba.attention_codes(torch.randint(0, bins, (batch, queries, queries), dtype=torch.uint8,
                                             generator=generator), allowed)
    table = torch.randn(heads, bins, generator=generator).requires_grad_()
    inputs = ba.kernel_inputs(codes, table, dtype)
    torch.manual_seed(7)  # the dropout seed the forward draws
    out, lse, seed, bits = ba.bucket_attention_forward(q, k, v, inputs.padded_codes, *inputs.tiles, table,
                                                       inputs.kernel_table, dropout, head_dim ** -0.5)
    grads = torch.autograd.grad(out, [q, k, v, table], torch.randn(out.shape, generator=generator).to(dtype))
    if dropout:  # the kept pairs' bits where the kernels compute (a tile with no pair to compute is not written)
        computed = (codes != ba.BLOCKED)[:, None].expand(batch, heads, queries, queries)
        bits = ba.stored_keep_mask(bits, queries, queries)[computed]
    return [out, lse, seed, bits, *grads]

def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))

def kernels():
    return sorted(f"{key[0]} {key[1]} {choice.shape} {len(choice.times)}" for key, choice in lt.chosen_launches().items())

report = {"default_tunes_here": lt.tunes(torch.device("cpu"), ba.INTERPRETED, ba.SHAPES_PINNED)}
expected = {case: run(*case) for case in ((70, 0.1), (70, 0.0), (40, 0.1))}
with ba.dq_from_scores(False):
    expected_dq_kernel = run(70, 0.1)
with ba.dq_over_tiles(True):
    expected_dq_tiles = run(70, 0.1)
with lt.tuning("on"):
    report["tuned_equal"] = same(run(70, 0.1), expected[70, 0.1])
    report["after_one_problem"] = kernels()
    report["again_equal"] = same(run(70, 0.1), expected[70, 0.1])  # the kept launches, untimed
    report["after_again"] = kernels()
    report["no_dropout_equal"] = same(run(70, 0.0), expected[70, 0.0])  # another problem: tuned anew
    report["problems"] = len(lt.chosen_launches())
    with ba.dq_from_scores(False):  # dQ by its kernel: tuned as the forward's tiles
        report["dq_kernel_equal"] = same(run(70, 0.1), expected_dq_kernel)
    report["with_dq_kernel"] = kernels()
    with ba.dq_over_tiles(True):  # dQ from dS over the listed tiles: its kernel tuned, the others as above
        report["dq_tiles_equal"] = same(run(70, 0.1), expected_dq_tiles)
    report["with_dq_tiles"] = kernels()
    with ba.kernel_shapes(ba.KernelShape(64, 64, 4, 2), ba.KernelShape(64, 64, 4, 2)):  # given: not tuned
        report["given_equal"] = same(run(40, 0.1), expected[40, 0.1])
    report["after_given"] = len(lt.chosen_launches())
print(json.dumps(report))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed (pyproject's test extra installs it on x86_64 Linux)")
def test_tuned_kernels_compute_what_the_untuned_launch_does_and_tune_once_a_problem():
    env = {key: value for key, value in {**os.environ, **RUN_ENVIRONMENT, "TRITON_INTERPRET": "1"}.items()
           if key not in (launch_tuning.TUNING_ENV, "PMLM_TRITON_KERNEL_SHAPES")}
    result = run_python(["-c", TUNED], cwd=REPO_ROOT, env=env, timeout=600)  # forked: the interpreter's server
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["default_tunes_here"] is False  # auto: a GPU's launches only
    assert report["tuned_equal"] and report["again_equal"] and report["no_dropout_equal"], report
    assert report["dq_kernel_equal"] and report["given_equal"], report
    # the forward and the dK, dV, dS kernel, each from its base (1 stage) and 2 stages, and the table
    # gradient's bucket_sums from Triton's default (3 stages) and 1, 2; no register count in the
    # interpreter, so no capped candidate
    tuned = [line.split() for line in report["after_one_problem"]]
    assert [kernel for kernel, *_ in tuned] == ["attention_backward_key_value_kernel", "attention_forward_kernel",
                                                "bucket_sums_kernel"], tuned
    assert all(base == "64x64w4s1" and kept in ("64x64w4s1", "64x64w4s2") and count == "2"
               for _, base, kept, count in tuned[:2]), tuned
    assert tuned[2][1] == "w4s3" and tuned[2][2] in ("w4s1", "w4s2", "w4s3") and tuned[2][3] == "3", tuned
    # the same problem again: nothing tuned; without dropout: the attention kernels anew, the sums
    # (the same problem) not
    assert report["after_again"] == report["after_one_problem"] and report["problems"] == 5, report
    # dQ by its kernel: tuned as the forward's tiles; and the key/value pass anew (no GEMM reads every
    # tile of dS then, so it writes no zeros in the skipped ones: another kernel)
    with_dq_kernel = [line.split()[0] for line in report["with_dq_kernel"]]
    assert with_dq_kernel.count("attention_backward_query_kernel") == 1, report
    assert with_dq_kernel.count("attention_backward_key_value_kernel") == 3 and len(with_dq_kernel) == 7, report
    assert report["dq_tiles_equal"], report
    assert sorted(set(report["with_dq_tiles"]) - set(report["with_dq_kernel"]))[0].startswith(
        "attention_query_grad_from_scores_kernel ") and len(report["with_dq_tiles"]) == 8, report
    # a given launch: the attention kernels not tuned at the new size, only the sums
    assert report["after_given"] == 9, report
    announced = [line for line in result.stderr.splitlines() if line.startswith("triton launch tuning:")]
    assert len(announced) == report["after_given"], result.stderr[-3000:]
    attention = [line for line in announced if "attention_" in line]
    assert len(attention) == 7 and all("programs of up to 2 tiles; " in line and "ms a launch: 64x64w4s1 " in line
                                       for line in attention), announced
