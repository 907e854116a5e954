"""tools/gpu_check.py's pieces that run without a GPU: the plan of benchmark processes, the MFU peaks
from device names, and a whole `--cpu-dry-run` (tiny preset): pretrain's own step through
bench_train --deepspeed, the Hugging Face rows, the profiler trace, and the report built from them."""

from __future__ import annotations

import copy
import json
import sys

from pmlm_testing import REPO_ROOT, run_module

sys.path.insert(0, str(REPO_ROOT / "tools"))
import gpu_check  # noqa: E402


def test_plan_times_the_real_path_once_per_shape_at_the_preferred_precision():
    plan = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("fp16", "bf16"), ("sdpa", "flex"), "bf16", compile_rows=True)
    eager = [spec for spec in plan if spec["kind"] == "eager"]
    assert len(eager) == 8 and len(plan) == 10  # 2 shapes x 2 precisions x 2 backends, + 2 compile rows
    real = [(s["seq_length"], s["precision"], s["backend"], s["flags"]) for s in plan if s["real"]]
    assert real == [(128, "bf16", "sdpa", ["--deepspeed", "--huggingface"]),
                    (512, "bf16", "sdpa", ["--deepspeed", "--huggingface"])]
    assert [s["seq_length"] for s in plan if s["traced"]] == [128]
    assert [(s["seq_length"], s["precision"], s["flags"]) for s in plan if s["kind"] == "compile"] == \
        [(128, "bf16", ["--compile"]), (512, "bf16", ["--compile"])]
    # A V100: fp16 only, sdpa only, bench_train without --compile.
    v100 = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("fp16",), ("sdpa",), "fp16", compile_rows=False)
    assert [(s["precision"], s["real"], s["traced"]) for s in v100] == [("fp16", True, True), ("fp16", True, False)]


def test_peaks_come_from_the_exact_device_name():
    peaks = gpu_check.device_peaks("NVIDIA H100 PCIe", ("fp16", "bf16"))
    assert [peaks[p]["tflops"] for p in ("fp16", "bf16")] == [756.0, 756.0]
    assert "H100 PCIe datasheet" in peaks["bf16"]["source"]
    assert gpu_check.device_peaks("NVIDIA H100 80GB HBM3", ("bf16",))["bf16"]["tflops"] == 989.0
    assert gpu_check.device_peaks("Tesla V100-SXM2-32GB", ("fp16",))["fp16"]["tflops"] == 125.0


def test_cpu_dry_run_measures_the_real_path_and_reports_it(tmp_path, shared_data):
    result = run_module("tools.gpu_check", "--cpu-dry-run", "--output-dir", str(tmp_path), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    report = json.loads((run / "gpu-check.json").read_text())
    rows = {row["name"]: row for row in report["bench"]}
    row = rows["tiny-seq64-fp32-sdpa"]
    assert row["ok"] and "--deepspeed --huggingface --profile-trace" in row["command"]
    figures = row["figures"]
    # pretrain's step: its own model (padded vocabulary, dropout), DeepSpeed ZeRO-1, its loader.
    real = figures["deepspeed"]
    assert real["zero_stage"] == 1 and real["precision"] == "fp32"
    assert real["padded_vocab_size"] == 30592  # 30522 padded to a multiple of 128, as pretrain pads it
    assert real["hidden_dropout"] == 0.1  # pretrain's model, not the bare benchmark's dropout-free one
    assert real["tokens_per_sec"] > 0 and real["model_tflops"] > 0 and real["kernels_per_step"] > 100
    ours = sum(int(line.split()[0]) for line in real["host_syncs"] if line.split()[1] == "ours")
    assert real["host_syncs_per_step"] == ours
    # Hugging Face three ways: at the sequence length, at our padded width, head on masked positions.
    hf = {entry["name"]: entry for entry in figures["huggingface"]}
    assert [hf[name]["length"] for name in ("hf-seq", "hf-width", "hf-seq-masked-head")] == \
        [64, figures["padded_width"], 64]
    assert hf["hf-seq-masked-head"]["masked_head_only"]
    for entry in hf.values():
        assert abs(entry["ours_over_theirs"] - figures["seconds_per_step"] / entry["seconds_per_step"]) < 1e-9
    # One step traced: a Chrome trace file and its top 20 by self time.
    trace = json.loads((run / "tiny-seq64-fp32-sdpa.trace.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    times = [kernel["self_us"] for kernel in figures["top_kernels"]]
    assert len(times) == 20 and times == sorted(times, reverse=True)

    markdown = (run / "gpu-check.md").read_text()
    assert markdown == gpu_check.markdown(report)
    assert "## pretrain's own step" in markdown and "## Hugging Face BertForMaskedLM" in markdown
    assert f"| {real['host_syncs_per_step']} ({real['host_syncs_all_owners']}) | {real['kernels_per_step']:,} |" \
        in markdown
    assert f"| {figures['bias_bytes_per_step'] / 2**20:,.1f} | {figures['host_ms_per_step']:,.1f} |" in markdown
    assert f"| `{figures['top_kernels'][0]['name']}` | {figures['top_kernels'][0]['calls']} |" in markdown
    has_compile = gpu_check.bench_has_compile()
    assert ("tiny-seq64-fp32-sdpa-compile" in rows) == has_compile
    assert ("--compile rows not run" in markdown) != has_compile

    # The report of a run whose pretrain step was skipped and whose other row failed.
    changed = copy.deepcopy(report)
    changed["bench"][0]["figures"]["deepspeed"] = {"skipped": "../shared/data absent"}
    changed["bench"].append({**changed["bench"][0], "ok": False, "error": "exit code 1: out of memory"})
    text = gpu_check.markdown(changed)
    assert "| 64 | 4 | skipped: ../shared/data absent |" in text and "failed: exit code 1: out of memory" in text
