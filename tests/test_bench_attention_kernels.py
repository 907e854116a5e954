"""tools/bench_attention_kernels.py: what it refuses, and that a variant computing another attention
is reported as different (the GPU figures come from `make gpu-check`; its dry run runs every variant)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch

from pmlm_testing import REPO_ROOT, run_module, run_tool

sys.path.insert(0, str(REPO_ROOT / "tools"))
import bench_attention_kernels  # noqa: E402


@pytest.mark.parametrize("args,message", [
    (["--shapes", "128"], "shape '128': give SEQxBATCH"),
    (["--shapes", "4x2"], "sequence length >= 8"),
    (["--variants", "sdpa,fast"], "--variants sdpa,fast: unknown fast"),
    (["--preset", "huge"], "--preset huge:"),
    (["--triton-shapes", "64x64w4s3"], "'64x64w4s3': give FORWARD/KEY_VALUE"),
    (["--triton-shapes", "64x64/64x64w4s3"], "kernel shape '64x64': give QUERIESxKEYSwWARPSsSTAGES"),
    (["--triton-shapes", "48x64w4s3/64x64w4s3"], "kernel shape 48x64w4s3: blocks of queries must be 32 or 64 or 128, of keys 64 or 128"),
    (["--triton-shapes", "64x64w4s3/32x64w4s3"], "kernel shape 32x64w4s3 for dK, dV, dS: its blocks of queries must be 64 or 128"),
])
def test_bad_arguments_are_refused_in_one_line(args, message, tmp_path):
    result = run_module("tools.bench_attention_kernels", *args, "--json", str(tmp_path / "out.json"), timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out.json").exists()


def test_relative_difference_reads_the_reference_finite_entries_and_catches_non_finite_output():
    expected = torch.tensor([1.0, float("-inf"), 2.0])
    assert bench_attention_kernels.relative_difference(torch.tensor([1.0, float("-inf"), 2.0]), expected) == 0.0
    assert bench_attention_kernels.relative_difference(torch.tensor([1.0, 0.0, 2.2]), expected) == \
        pytest.approx(0.2 / math.sqrt(5))
    assert bench_attention_kernels.relative_difference(torch.tensor([float("nan"), 0.0, 2.0]), expected) == math.inf


def test_a_probe_that_cannot_run_is_reported_and_is_not_a_failure(tmp_path):
    """sdpa-cudnn asks whether cuDNN's kernel takes the bias and its gradient; on the CPU it cannot run."""
    code = bench_attention_kernels.main(["--preset", "tiny", "--shapes", "32x2", "--variants", "sdpa,sdpa-cudnn",
                                         "--iterations", "1", "--warmup", "1", "--json", str(tmp_path / "out.json")])
    assert code == 0
    shape = json.loads((tmp_path / "out.json").read_text())["shapes"][0]
    rows = {r["variant"]: r for r in shape["rows"]}
    assert "cuDNN's attention runs on CUDA only" in rows["sdpa-cudnn"]["unavailable"]
    assert "error" not in rows["sdpa-cudnn"] and rows["sdpa"]["ms"] > 0
    # The table gradient from sdpa's bias gradient: the GEMMs here, the Triton kernel only on CUDA.
    table = shape["table_gradient"]
    assert table["gemm"]["ms"] > 0 and table["gemm"]["relative_difference"] < 1e-6
    assert table["kernel"] == {"unavailable": "needs CUDA"}
    # and a step's worth (tiny: 2 layers): the layers' gradients summed, then the GEMMs (twice the table)
    assert table["2 layers: summed, gemm"]["relative_difference"] < 1e-6
    assert table["2 layers: each, kernel"] == {"unavailable": "needs CUDA"}


def test_the_split_sdpa_computes_the_same_attention_over_fewer_pairs(tmp_path):
    """sdpa-split: the context rows against the context keys, the appended rows against all keys
    (two sdpa calls, each bias part a leaf of its own): the same output and q/k/v and bias gradients
    as one sdpa call over T x T; its share of the pairs is reported; its dropout row is timed only."""
    code = bench_attention_kernels.main(["--preset", "tiny", "--shapes", "64x3", "--variants",
                                         "sdpa,sdpa-split,sdpa-split-dropout", "--iterations", "1", "--warmup", "1",
                                         "--json", str(tmp_path / "out.json")])
    assert code == 0
    shape = json.loads((tmp_path / "out.json").read_text())["shapes"][0]
    rows = {r["variant"]: r for r in shape["rows"]}
    split = rows["sdpa-split"]
    assert split["same_attention"] and set(split["relative_difference"]) == {
        "output", "grad_query", "grad_key", "grad_value", "grad_bias"}, split
    assert max(split["relative_difference"].values()) < 1e-5, split
    width, context = shape["width"], shape["context_width"]
    assert 64 <= context < width
    assert shape["split_pairs_fraction"] == pytest.approx((context ** 2 + (width - context) * width) / width ** 2)
    assert rows["sdpa-split-dropout"]["ms"] > 0 and "relative_difference" not in rows["sdpa-split-dropout"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pyproject's test "
                    "extra installs it on x86_64 Linux)")
def test_the_triton_backend_s_kernels_are_compared_with_sdpa_including_the_table_gradient(tmp_path):
    """In Triton's interpreter (a fresh process: it is read when the kernels are defined) the
    triton variant is the same attention as sdpa, the table's gradient compared with sdpa's bias
    gradient reduced per bucket, launched as the model does and with other tiles (--triton-shapes),
    with dQ by its own kernel or from dS over the listed tiles, with the key/value pass's tiles as [queries, keys], and reading the
    bias from its dense form; its dropout rows (the bits drawn apart or by the forward), its
    no-bias row and sdpa's dropout row are timed only."""
    out = tmp_path / "out.json"
    result = run_tool(
        "bench_attention_kernels.py", "--preset", "tiny", "--shapes", "32x2", "--variants",
        "sdpa,triton,sdpa-dropout,triton-dropout,triton-no-bias,triton-dq-kernel,triton-dq-tiles,"
        "triton-dropout-dq-tiles,triton-kv-rows,triton-dropout-kv-rows,triton-dense-bias,triton-dropout-dense-bias,"
        "triton-dropout-in-forward",
        "--triton-shapes",
        "32x64w2s1/64x64w4s3", "--iterations", "1", "--warmup", "1", "--json", str(out),
        cwd=REPO_ROOT, env={"TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["shapes"][0]["rows"]}
    for name, launch in (("triton", "64x64w4s1/64x64w4s1"), ("triton[32x64w2s1/64x64w4s3]", "32x64w2s1/64x64w4s3"),
                         ("triton-dq-kernel", "64x64w4s1/64x64w4s1"),  # dQ by its kernel: the same attention
                         ("triton-dq-tiles", "64x64w4s1/64x64w4s1"),  # dQ from dS over the listed tiles: too
                         ("triton-kv-rows", "64x64w4s1/64x64w4s1"),  # the other orientation: the same too
                         ("triton-dense-bias", "64x64w4s1/64x64w4s1")):  # the dense bias: the same too
        assert rows[name]["same_attention"] and rows[name]["launch"] == launch, rows[name]
        assert rows[name]["relative_difference"]["grad_table"] < 1e-5, rows[name]
    for name in ("sdpa-dropout", "triton-dropout", "triton-no-bias", "triton-dropout-dq-tiles",
                 "triton-dropout-kv-rows", "triton-dropout-dense-bias", "triton-dropout-in-forward"):
        assert rows[name]["ms"] > 0 and "relative_difference" not in rows[name], rows[name]


def test_a_variant_computing_another_attention_is_reported_as_different(monkeypatch, tmp_path):
    """flash-no-bias is never compared (it is the floor); were a bias variant to drop the bias, the
    check would say so and the tool would exit 1."""
    original = bench_attention_kernels.run_variant

    def dropping_the_bias(name, *args, **kwargs):
        return original("flash-no-bias" if name == "sdpa-bias-frozen" else name, *args, **kwargs)
    monkeypatch.setattr(bench_attention_kernels, "run_variant", dropping_the_bias)
    code = bench_attention_kernels.main(["--preset", "tiny", "--shapes", "32x2", "--variants", "sdpa,sdpa-bias-frozen",
                                         "--iterations", "1", "--warmup", "1", "--json", str(tmp_path / "out.json")])
    assert code == 1
    (row,) = [r for r in json.loads((tmp_path / "out.json").read_text())["shapes"][0]["rows"]
              if r["variant"] == "sdpa-bias-frozen"]
    assert row["same_attention"] is False and row["relative_difference"]["output"] > 1e-2
