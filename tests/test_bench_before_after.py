"""tools/bench_before_after.py: a revision's step against this checkout's, counted by the same counters."""

import json
import subprocess

from pmlm_testing import run_module


def test_a_revision_against_itself_counts_the_same_and_a_bad_revision_is_refused(tmp_path):
    out = tmp_path / "ba.json"
    result = run_module("tools.bench_before_after", "--baseline", "HEAD", "--preset", "tiny", "--seq-length", "32",
                        "--micro-batch-size", "2", "--iterations", "1", "--warmup", "0", "--no-compile",
                        "--json", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["row"] for row in rows] == ["baseline HEAD", "this checkout"]
    baseline, ours = rows
    # HEAD is this checkout's code (CI tests a clean clone), so every count is equal; ours has no syncs.
    for key in ("layout_width", "host_syncs_per_step", "kernels_per_step", "bias_bytes_per_step"):
        assert baseline[key] == ours[key], key
    assert ours["host_syncs_per_step"] == 0 and ours["kernels_per_step"] > 100 and ours["bias_bytes_per_step"] > 0
    assert "| this checkout |" in result.stdout
    # The temporary worktree of the baseline is gone.
    listing = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout
    assert "pmlm-baseline-" not in listing
    bad = run_module("tools.bench_before_after", "--baseline", "no-such-revision")
    assert bad.returncode == 2 and "--baseline 'no-such-revision' is not a commit" in bad.stderr
