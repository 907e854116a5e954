"""The table gradient's Triton kernel (`models/bucket_sums.py`) against the one-hot GEMMs.

On the CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, which must be set before
the kernel is defined: each check is a fresh process), the same program a GPU compiles; the GPU
itself is checked in tests/test_gpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megatron_pmlm.models import bucket_sums
from pmlm_testing import REPO_ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (pyproject's test extra installs it on x86_64 Linux)")

INTERPRETED = r"""
import json, sys
import torch
from megatron_pmlm.models.relative_bias import table_gradient

results = []
generator = torch.Generator().manual_seed(0)
# (batch, heads, queries, keys, padded keys, bins): ragged tiles, heads and bins not powers of two,
# more heads and bins than the smallest block, an aligned view of a padded buffer.
for batch, heads, queries, keys, padded, bins in [(3, 12, 13, 71, 72, 32), (2, 5, 4, 64, 64, 20),
                                                  (1, 17, 9, 130, 136, 40), (0, 12, 8, 8, 8, 32)]:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buckets = torch.randint(0, bins, (batch, queries, keys), dtype=torch.uint8, generator=generator)
        grad = torch.randn(batch, heads, queries, padded, generator=generator).to(dtype)[..., :keys]
        exact = table_gradient(grad.double(), buckets, bins, torch.float64)
        ours = torch.ops.megatron_pmlm.bucket_sums(grad, buckets, bins)
        scale = float(exact.abs().max()) if exact.numel() and exact.abs().max() > 0 else 1.0
        results.append({"shape": [batch, heads, queries, keys, padded, bins], "dtype": str(dtype),
                        "out_dtype": str(ours.dtype), "out_shape": list(ours.shape),
                        "error": float((ours.double() - exact).abs().max()) / scale if exact.numel() else 0.0})
# The fake (meta) kernel, the schema and compiled callers: torch.library's own checks.
grad = torch.randn(2, 3, 5, 8)
buckets = torch.randint(0, 32, (2, 5, 8), dtype=torch.uint8)
torch.library.opcheck(torch.ops.megatron_pmlm.bucket_sums.default, (grad, buckets, 32),
                      test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
compiled = torch.compile(lambda g, b: torch.ops.megatron_pmlm.bucket_sums(g, b, 32) * 2, backend="aot_eager",
                         fullgraph=True)
compiled_error = float((compiled(grad, buckets) - 2 * table_gradient(grad, buckets, 32, torch.float32)).abs().max())
json.dump({"results": results, "compiled_error": compiled_error}, sys.stdout)
"""


def run_interpreted(source: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", source], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_the_kernel_sums_each_bucket_as_the_one_hot_gemms_do():
    """fp32 sums of fp32, bf16 and fp16 gradients (half precision enters the tensor cores as TF32,
    which holds it exactly): within fp32 rounding of a float64 sum, for every layout."""
    report = run_interpreted(INTERPRETED)
    assert len(report["results"]) == 12
    for result in report["results"]:
        batch, heads, _, _, _, bins = result["shape"]
        assert result["out_dtype"] == "torch.float32" and result["out_shape"] == [heads, bins], result
        assert result["error"] <= 1e-6, result
    assert report["compiled_error"] <= 1e-5


def test_the_environment_turns_the_kernel_off():
    """PMLM_TABLE_GRADIENT=gemm keeps the GEMMs on a GPU too (read once, at import)."""
    code = ("from megatron_pmlm.models import bucket_sums; import sys; "
            "sys.stdout.write(str(bucket_sums.KERNEL_ENABLED))")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for setting, expected in (("gemm", "False"), ("kernel", "True")):
        result = subprocess.run([sys.executable, "-c", code], env={**env, bucket_sums.TABLE_GRADIENT_ENV: setting},
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout == expected, result.stderr[-2000:]
