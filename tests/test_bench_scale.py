"""tools/bench_scale.py at a few hundred kB: the corpus it builds, the memory it samples (private
pages, not memory-mapped ones; workers included), the fits, the JSON, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import bench_scale  # noqa: E402

MIB = 1 << 20


def test_corpus_is_repeated_shuffled_documents(tmp_path):
    documents = [f"document {i}. It has two sentences." for i in range(50)]
    first = bench_scale.write_corpus(documents, 0.004, tmp_path / "a.jsonl", seed=1)
    again = bench_scale.write_corpus(documents, 0.004, tmp_path / "b.jsonl", seed=1)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes() and first == again
    texts = [json.loads(line)["text"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert first["documents"] == len(texts) > 50 and first["bytes"] >= 4000
    assert sorted(texts[:50]) == sorted(documents) and texts[:50] != documents  # a whole copy, shuffled
    assert texts[50:100] != texts[:50]  # the next copy in another order


def _sampled(code: str, tmp_path: Path) -> dict:
    return bench_scale.run_measured([[sys.executable, "-c", code]], tmp_path, 0.05, tmp_path / "log.txt")


def test_private_memory_is_measured_not_mapped_pages(tmp_path):
    """A child holding 64 MiB of its own pages, and one reading a 64 MiB file through a memory map:
    both have the RSS; only the first has the private (anonymous) memory."""
    data = tmp_path / "data.bin"
    np.ones(64 * MIB, np.uint8).tofile(data)
    private = _sampled("import numpy as np, time; a = np.ones(64 << 20, np.uint8); time.sleep(0.6)", tmp_path)
    mapped = _sampled(f"import numpy as np, time; m = np.memmap({str(data)!r}, mode='r'); s = int(m.sum()); "
                      "time.sleep(0.6)", tmp_path)
    assert private["peak_sum_bytes"]["rss_anon"] > 60 * MIB
    assert mapped["peak_sum_bytes"]["rss"] > 60 * MIB
    assert mapped["peak_sum_bytes"]["rss_anon"] < private["peak_sum_bytes"]["rss_anon"] - 40 * MIB
    assert private["cpu_s"] > 0 and private["wall_s"] >= 0.6


def test_workers_are_sampled_and_counted(tmp_path):
    """Processes the measured one starts are part of its tree: their private memory is summed and
    listed, and their CPU time counts (wait4 of the reaped children)."""
    child_cpu = tmp_path / "child_cpu.txt"
    child = ("import numpy as np, os, time; a = np.ones(48 << 20, np.uint8); time.sleep(0.5); "
             f"sum(range(10_000_000)); t = os.times(); open({str(child_cpu)!r}, 'w').write(str(t.user + t.system))")
    result = _sampled(f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)",
                      tmp_path)
    roles = [p["role"] for p in result["per_process_peak_bytes"]]
    assert roles.count("main") == 1 and roles.count("worker") == 1
    worker = result["per_process_peak_bytes"][1]
    assert worker["rss_anon"] > 40 * MIB
    assert result["peak_sum_bytes"]["rss_anon"] >= worker["rss_anon"]
    assert result["cpu_s"] >= float(child_cpu.read_text()) > 0.1  # the child's CPU time is counted


def test_linear_fit_and_projection():
    assert bench_scale.linear_fit([10, 30, 100], [25, 65, 205]) == pytest.approx((5.0, 2.0))
    points = [{"corpus_mb": mb, "step": {"cpu_s": 1 + 0.5 * mb}} for mb in (10, 30, 100)]
    fit = bench_scale.projections(points)["step.cpu_s"]
    assert fit["at_160GB"] == pytest.approx(1 + 0.5 * 160_000)


def test_tool_end_to_end_and_errors(tmp_path):
    report = tmp_path / "scale.json"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "bench_scale.py"), "--sizes-mb", "0.2", "0.6",
                             "--mask-epochs", "1", "--loader-ranks", "2", "--loader-batches", "1",
                             "--micro-batch", "2", "--work", str(tmp_path / "work"), "--json", str(report)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(report.read_text())
    assert [round(p["corpus_mb"], 1) for p in data["points"]] == [0.2, 0.6]
    for point in data["points"]:
        assert point["preprocess"]["bin_idx_bytes"] > 0 and point["build.k1"]["samples_bytes"] > 0
        assert point["build.k1"]["peak_sum_bytes"]["rss_anon"] > 10 * MIB
        assert point["build.k1"]["train_samples"] > 0
        assert "worker" in [p["role"] for p in point["build.k1"]["per_process_peak_bytes"]]  # --workers 2
        ranks = point["loader.r2"]["per_process_peak_bytes"]
        assert [p["role"] for p in ranks] == ["main", "main"] and all(p["rss_anon"] > 10 * MIB for p in ranks)
    assert data["points"][1]["build.k1"]["train_samples"] > 2 * data["points"][0]["build.k1"]["train_samples"]
    assert "build.k1.peak_sum_bytes.rss_anon" in data["fits"] and data["fits"]["paper"]["train_samples_at_160GB"] > 0
    assert "projection to 160 GB" in result.stdout
    assert not (tmp_path / "work" / "0.2MB").exists(), "each size's files are removed without --keep"

    for bad, culprit in ((["--sizes-mb", "0"], "--sizes-mb"), (["--mask-epochs", "0"], "--mask-epochs"),
                         (["--code-root", str(tmp_path)], "--code-root")):
        failed = subprocess.run([sys.executable, str(REPO / "tools" / "bench_scale.py"), *bad, "--json",
                                 str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120)
        assert failed.returncode == 2 and culprit in failed.stderr and len(failed.stderr.splitlines()) == 1
        assert not (tmp_path / "bad.json").exists()
