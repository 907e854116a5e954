"""tools/gpu_check.py's pieces that run without a GPU: the plan of benchmark processes, the MFU peaks
from device names, and a whole `--cpu-dry-run` (tiny preset): pretrain's own step through
bench_train --deepspeed, the Hugging Face rows, the profiler trace, and the report built from them."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from pmlm_testing import REPO_ROOT, run_module

sys.path.insert(0, str(REPO_ROOT / "tools"))
import gpu_check  # noqa: E402
from bench_attention_kernels import TIMED_ONLY, VARIANTS  # noqa: E402


def test_plan_times_the_real_path_once_per_shape_at_the_preferred_precision():
    plan = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("fp16", "bf16"), ("sdpa", "flex"), "bf16", compile_rows=True)
    eager = [spec for spec in plan if spec["kind"] == "eager"]
    assert len(eager) == 8 and len(plan) == 10  # 2 shapes x 2 precisions x 2 backends, + 2 compile rows
    real = [(s["seq_length"], s["precision"], s["backend"], s["flags"]) for s in plan if s["real"]]
    # pretrain's own step, eager (with Hugging Face beside it) and compiled, at each shape.
    assert real == [(128, "bf16", "sdpa", ["--deepspeed", "--huggingface"]),
                    (512, "bf16", "sdpa", ["--deepspeed", "--huggingface"]),
                    (128, "bf16", "sdpa", ["--compile", "--deepspeed", "--skip-host-proxy"]),
                    (512, "bf16", "sdpa", ["--compile", "--deepspeed", "--skip-host-proxy"])]
    assert [s["seq_length"] for s in plan if s["traced"]] == [128]
    assert [(s["seq_length"], s["precision"]) for s in plan if s["kind"] == "compile"] == [(128, "bf16"), (512, "bf16")]
    # Most important first, so that a short lease measures what the goals are judged on: the real
    # path, the compiled rows, the other backend at the preferred precision, the other precision
    # (without large batches; with them below).
    assert [gpu_check.bench_name(spec, "base") for spec in plan] == [
        "base-seq128-bf16-sdpa", "base-seq512-bf16-sdpa", "base-seq128-bf16-sdpa-compile",
        "base-seq512-bf16-sdpa-compile", "base-seq128-bf16-flex", "base-seq512-bf16-flex",
        "base-seq128-fp16-sdpa", "base-seq128-fp16-flex", "base-seq512-fp16-sdpa", "base-seq512-fp16-flex"]
    assert [spec["priority"] for spec in plan] == sorted(spec["priority"] for spec in plan)
    assert 2 < gpu_check.TESTS_PRIORITY < 3  # the gpu tests before the other precision's rows
    # pretrain's step at larger micro batches, eager then compiled, before the compiled rows at the first shapes.
    large = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("fp16", "bf16"), ("sdpa", "flex"), "bf16", compile_rows=True,
                                 large_batches=gpu_check.LARGE_BATCH_SHAPES)
    assert [gpu_check.bench_name(spec, "base") for spec in large][2:8] == [
        "base-seq128-bf16-sdpa-mb256", "base-seq512-bf16-sdpa-mb64", "base-seq128-bf16-sdpa-compile-mb256",
        "base-seq512-bf16-sdpa-compile-mb64", "base-seq128-bf16-sdpa-compile", "base-seq512-bf16-sdpa-compile"]
    assert [(s["micro_batch"], s["flags"], gpu_check.minimum_seconds(s)) for s in large[2:6]] == [
        (256, ["--deepspeed"], gpu_check.MIN_REAL_STEP_SECONDS), (64, ["--deepspeed"], gpu_check.MIN_REAL_STEP_SECONDS),
        (256, list(gpu_check.COMPILE_FLAGS), gpu_check.MIN_COMPILE_STEP_SECONDS),
        (64, list(gpu_check.COMPILE_FLAGS), gpu_check.MIN_COMPILE_STEP_SECONDS)]
    assert [gpu_check.bench_name(s, "base") for s in large if s["traced"]] == [
        "base-seq128-bf16-sdpa", "base-seq128-bf16-sdpa-compile-mb256"]  # the compiled step sized to the card too
    assert len(large) == 14 and [spec["priority"] for spec in large] == sorted(spec["priority"] for spec in large)
    # pretrain's step accumulating micro batches (as a run of the paper's global batch does: 15 of 64 at
    # seq 512 on 8 GPUs), as the goal rows run (compiled, the kernel backend), after the compiled
    # large-batch rows, before the compiled rows at the first shapes.
    accumulated = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("bf16",), ("sdpa",), "bf16", compile_rows=True,
                                       large_batches=gpu_check.LARGE_BATCH_SHAPES,
                                       accumulation=gpu_check.ACCUMULATION_SHAPES, kernel_backends=("triton",))
    assert [gpu_check.bench_name(spec, "base") for spec in accumulated][8:12] == [
        "base-seq128-bf16-triton-compile-mb256", "base-seq512-bf16-triton-compile-mb64",
        "base-seq512-bf16-triton-compile-mb64-ga15", "base-seq128-bf16-sdpa-compile"]
    (row,) = [spec for spec in accumulated if spec.get("name_suffix") == "-mb64-ga15"]
    assert (row["micro_batch"], row["flags"], row["real"], row["traced"], gpu_check.minimum_seconds(row)) == (
        64, [*gpu_check.COMPILE_FLAGS, "--gradient-accumulation-steps", "15"], True, False,
        gpu_check.MIN_COMPILE_STEP_SECONDS)
    # without a kernel backend or bench_train's --compile: sdpa, eager
    (row,) = [spec for spec in gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("bf16",), ("sdpa",), "bf16", compile_rows=False,
                                                    accumulation=gpu_check.ACCUMULATION_SHAPES) if "-ga" in spec.get("name_suffix", "")]
    assert gpu_check.bench_name(row, "base") == "base-seq512-bf16-sdpa-mb64-ga15"
    assert row["flags"] == ["--deepspeed", "--gradient-accumulation-steps", "15"]
    # The triton backend's pretrain step at the large micro batches, right after sdpa's there.
    kernels = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("bf16",), ("sdpa",), "bf16", compile_rows=True,
                                   large_batches=gpu_check.LARGE_BATCH_SHAPES, kernel_backends=("triton",))
    assert [gpu_check.bench_name(spec, "base") for spec in kernels][2:6] == [
        "base-seq128-bf16-sdpa-mb256", "base-seq512-bf16-sdpa-mb64", "base-seq128-bf16-triton-mb256",
        "base-seq512-bf16-triton-mb64"]
    assert all(spec["real"] and spec["flags"] == ["--deepspeed"] for spec in kernels[4:6])
    # ... and compiled, right after sdpa's compiled rows at the large micro batches
    assert [gpu_check.bench_name(spec, "base") for spec in kernels][6:10] == [
        "base-seq128-bf16-sdpa-compile-mb256", "base-seq512-bf16-sdpa-compile-mb64",
        "base-seq128-bf16-triton-compile-mb256", "base-seq512-bf16-triton-compile-mb64"]
    assert all(spec["flags"] == list(gpu_check.COMPILE_FLAGS) and spec["traced"] for spec in kernels[8:10])
    assert not any(spec["traced"] for spec in kernels[4:6])  # triton eager: not traced
    # Without --compile in bench_train: the large batches eager only.
    no_compile = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("bf16",), ("sdpa",), "bf16", compile_rows=False,
                                      large_batches=gpu_check.LARGE_BATCH_SHAPES)
    assert [gpu_check.bench_name(spec, "base") for spec in no_compile] == [
        "base-seq128-bf16-sdpa", "base-seq512-bf16-sdpa", "base-seq128-bf16-sdpa-mb256", "base-seq512-bf16-sdpa-mb64"]
    # A V100: fp16 only, sdpa only, bench_train without --compile.
    v100 = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("fp16",), ("sdpa",), "fp16", compile_rows=False)
    assert [(s["precision"], s["real"], s["traced"]) for s in v100] == [("fp16", True, True), ("fp16", True, False)]


def test_a_step_starts_only_with_its_own_minimum_left():
    """A row that cannot finish in what is left is skipped, so that the cheaper rows after it run."""
    plan = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("bf16",), ("sdpa", "flex"), "bf16", compile_rows=True)
    minimum = {gpu_check.bench_name(spec, "base"): gpu_check.minimum_seconds(spec) for spec in plan}
    assert minimum == {"base-seq128-bf16-sdpa": gpu_check.MIN_REAL_STEP_SECONDS,
                       "base-seq512-bf16-sdpa": gpu_check.MIN_REAL_STEP_SECONDS,
                       "base-seq128-bf16-sdpa-compile": gpu_check.MIN_COMPILE_STEP_SECONDS,
                       "base-seq512-bf16-sdpa-compile": gpu_check.MIN_COMPILE_STEP_SECONDS,
                       "base-seq128-bf16-flex": gpu_check.MIN_STEP_SECONDS,
                       "base-seq512-bf16-flex": gpu_check.MIN_STEP_SECONDS}
    assert gpu_check.MIN_STEP_SECONDS < gpu_check.MIN_REAL_STEP_SECONDS < gpu_check.MIN_COMPILE_STEP_SECONDS
    assert gpu_check.minimum_seconds({"kind": "tests"}) == gpu_check.MIN_TESTS_SECONDS
    assert gpu_check.minimum_seconds({"kind": "attention"}) == gpu_check.MIN_ATTENTION_SECONDS
    # the attention kernels after sdpa's eager rows at the large micro batches, before the triton rows
    # there (which launch as the attention table's fastest) and the compiled ones
    large = gpu_check.bench_plan(gpu_check.BENCH_SHAPES, ("bf16",), ("sdpa",), "bf16", compile_rows=True,
                                 large_batches=gpu_check.LARGE_BATCH_SHAPES, kernel_backends=("triton",))
    eager_large = [s["priority"] for s in large if s.get("name_suffix") and s["kind"] == "eager"
                   and s["backend"] == "sdpa"]
    after = [s["priority"] for s in large if s.get("name_suffix") and (s["kind"] == "compile" or s["backend"] == "triton")]
    assert max(eager_large) < gpu_check.ATTENTION_PRIORITY < min(after)


def test_the_triton_rows_launch_as_the_fastest_row_of_the_attention_table():
    """`fastest_triton_launch`: the triton launch that is the same attention as sdpa at every shape in
    the least total time; the dropout and no-bias rows (timed only) and a launch that differed or failed at any
    shape are not candidates; none without a triton row."""
    def row(variant, launch, ms, same=True):
        return {"variant": variant, "launch": launch, "ms": ms, "same_attention": same}

    shapes = {"shapes": [
        {"rows": [{"variant": "sdpa", "ms": 9.0}, row("triton", "64x64w4s3/64x64w4s3", 5.0),
                  row("triton[128x64w8s3/64x64w4s3]", "128x64w8s3/64x64w4s3", 3.0),
                  row("triton[64x64w4s2/64x64w4s2]", "64x64w4s2/64x64w4s2", 1.0, same=False),
                  {"variant": "triton[128x128w8s2/64x128w8s2]", "launch": "128x128w8s2/64x128w8s2",
                   "unavailable": "OutOfResources: shared memory"},
                  row("triton-dropout", "64x64w4s3/64x64w4s3", 0.5),
                  {"variant": "triton-no-bias", "launch": "64x64w4s3/64x64w4s3", "ms": 0.4}]},  # timed only
        {"rows": [row("triton", "64x64w4s3/64x64w4s3", 2.0),
                  row("triton[128x64w8s3/64x64w4s3]", "128x64w8s3/64x64w4s3", 2.5),
                  row("triton[64x64w4s2/64x64w4s2]", "64x64w4s2/64x64w4s2", 1.0)]}]}
    fastest = gpu_check.fastest_triton_launch(shapes)
    assert fastest == {"launch": "128x64w8s3/64x64w4s3",
                       "ms": {"64x64w4s3/64x64w4s3": 7.0, "128x64w8s3/64x64w4s3": 5.5}}, fastest
    # on a GPU the `triton` row's launch is tuned (models/launch_tuning.py): when it wins, the rows tune too
    tuned = {"shapes": [{"rows": [row("triton", "tuned", 1.5), row("triton[64x64w4s1/64x64w4s1]", "64x64w4s1/64x64w4s1",
                                                                    2.0)]}]}
    assert gpu_check.fastest_triton_launch(tuned) == {"launch": "tuned", "ms": {"tuned": 1.5, "64x64w4s1/64x64w4s1": 2.0}}
    assert gpu_check.fastest_triton_launch({"shapes": [{"rows": [{"variant": "sdpa", "ms": 1.0}]}]}) is None
    assert gpu_check.fastest_triton_launch(None) is None


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
    # Fed as Trainer.train feeds it (the loader's thread builds the batches): the step itself reads
    # nothing from the device in our code; DeepSpeed's own reads are listed.
    assert real["host_syncs_per_step"] == ours == 0, real["host_syncs"]
    assert real["host_syncs_all_owners"] > 0 and all(" deepspeed " in line for line in real["host_syncs"])
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
    # pretrain's step traced beside it (the optimizer step DeepSpeed runs among its ops); no GPU timeline here.
    assert real["profile_trace"] == str(run / "tiny-seq64-fp32-sdpa.pretrain.trace.json")
    real_names = {event.get("name") for event in json.loads(Path(real["profile_trace"]).read_text())["traceEvents"]}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= real_names
    assert len(real["top_kernels"]) == 20 and figures["device_timeline"] is None and real["device_timeline"] is None

    markdown = (run / "gpu-check.md").read_text()
    assert markdown == gpu_check.markdown(report)
    # the environment's settings that change what the rows run are named in the report (folders left out)
    assert report["environment"] == gpu_check.environment_settings()
    with_settings = {**report, "environment": gpu_check.environment_settings(
        {"PMLM_TRITON_BIAS": "dense", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "HOME": "/root"})}
    assert ("Settings from the environment (they change what the rows run): `PMLM_TRITON_BIAS=dense`."
            in gpu_check.markdown(with_settings))
    assert ("Settings from the environment (they change what the rows run): none (the code's defaults)."
            in gpu_check.markdown({**report, "environment": {}}))
    assert "## pretrain's own step" in markdown and "## Hugging Face BertForMaskedLM" in markdown
    assert f"| {real['host_syncs_per_step']} ({real['host_syncs_all_owners']}) | {real['kernels_per_step']:,} |" \
        in markdown
    assert f"| {figures['bias_bytes_per_step'] / 2**20:,.1f} | {figures['host_ms_per_step']:,.1f} |" in markdown
    # The host's Python between ops, pretrain's step beside the bare model's.
    assert real["host_ms_outside_ops"] > 0 and figures["host_ms_outside_ops"] > 0
    assert (f"| {real['kernels_per_step']:,} | {real['host_ms_outside_ops']:,.1f} "
            f"({figures['host_ms_outside_ops']:,.1f}) |") in markdown
    assert f"| `{figures['top_kernels'][0]['name']}` | {figures['top_kernels'][0]['calls']} |" in markdown
    assert "kernels of the bare model's step" in markdown and "kernels of pretrain's step" in markdown
    assert ", compiled, by" not in markdown
    compiled = json.loads(json.dumps(report))  # a traced --compile row (the large micro batch's) says so
    next(row for row in compiled["bench"] if row["name"] == "tiny-seq64-fp32-sdpa")["kind"] = "compile"
    assert "(seq 64, micro batch 4, fp32, sdpa, compiled, by self CPU time;" in gpu_check.markdown(compiled)
    assert f"| `{real['top_kernels'][0]['name'][:120]}` | {real['top_kernels'][0]['calls']} |" in markdown
    assert markdown.count("GPU timeline: none (no GPU events in this trace).") == 2
    has_compile = gpu_check.bench_has_compile()
    assert ("tiny-seq64-fp32-sdpa-compile" in rows) == has_compile
    assert ("--compile rows not run" in markdown) != has_compile
    if has_compile:  # pretrain --compile timed too, compiled (after the proxies' eager counters ran)
        compiled = rows["tiny-seq64-fp32-sdpa-compile"]["figures"]["deepspeed"]
        assert compiled["compile"] and not real["compile"]
        assert compiled["compilations"] >= 1  # its own graphs (dropout 0.1: the bare model's do not serve)
        assert compiled["host_syncs_per_step"] == 0 and compiled["kernels_per_step"] > 100
        assert "| 64 | 4 | fp32 | compile | 30,592 |" in markdown and "| 64 | 4 | fp32 | eager | 30,592 |" in markdown
        # The compiled row spares the host proxy's own compilation (micro batch 1, seq 16): "skipped".
        bare = rows["tiny-seq64-fp32-sdpa-compile"]["figures"]
        assert "host_ms_per_step" not in bare and bare["host_proxy_skipped"] == "--skip-host-proxy"
        assert f"| {bare['bias_bytes_per_step'] / 2**20:,.1f} | skipped |" in markdown

    # The attention kernel alone: every variant ran, each the same attention as sdpa, in the report.
    attention = report["attention"]
    assert attention["ok"] and "--shapes 64x4" in attention["command"], attention
    (shape,) = attention["figures"]["shapes"]
    variants = {row["variant"]: row for row in shape["rows"]}
    launched_otherwise = [f"triton[{entry}]" for entry in gpu_check.TRITON_KERNEL_SHAPES.split(",")]
    assert sorted(variants) == sorted(VARIANTS + tuple(launched_otherwise))
    compared = [name for name in variants if name not in ("sdpa", "sdpa-cudnn")
                and not name.startswith("triton") and name not in TIMED_ONLY]
    assert all(variants[name]["same_attention"] for name in compared), variants
    assert all(variants[name]["ms"] > 0 for name in TIMED_ONLY if not name.startswith("triton")), variants
    for name in [name for name in variants if name.startswith("triton")]:  # CUDA (or Triton's interpreter)
        assert "runs on CUDA GPUs" in variants[name]["unavailable"], variants[name]
    for name in ("flex-dense-bias", "sdpa-contiguous-bias", "sdpa-split"):  # the bias's gradient compared too
        assert "grad_bias" in variants[name]["relative_difference"], name
    # a probe that cannot run here says why, and is not a failure of the check
    assert variants["sdpa-cudnn"]["unavailable"] == "NotImplementedError: cuDNN's attention runs on CUDA only"
    assert "## The attention kernel alone" in markdown and "| flex-dense-bias |" in markdown
    assert f"context width {shape['context_width']} (sdpa-split's pairs " in markdown
    assert "| sdpa-cudnn | not available: NotImplementedError: cuDNN's attention runs on CUDA only | | |" in markdown
    # which path pretrain's step took for the table gradient (the CPU's: the GEMMs)
    assert ("The relative-bias table's gradient (`models/bucket_sums.py`): the layers' summed bias gradient, "
            "one-hot GEMMs." in markdown)
    # the table gradient beside them: the GEMMs timed, the Triton kernel a GPU's
    assert shape["table_gradient"]["gemm"]["relative_difference"] < 1e-6
    assert "| table gradient, kernel | not available: needs CUDA | | |" in markdown

    # An accumulated row: its micro batches a step named, the real / bare ratio per micro batch.
    accumulated = copy.deepcopy(report)
    step = next(row for row in accumulated["bench"] if row["name"] == "tiny-seq64-fp32-sdpa")["figures"]
    step["deepspeed"].update(gradient_accumulation_steps=8, seconds_per_step=8 * 3 * step["seconds_per_step"])
    assert "| 64 | 4 x 8 a step | fp32 | eager | 30,592 |" in gpu_check.markdown(accumulated)
    assert f"{gpu_check._percent(step.get('mfu'))} | 3.00 |" in gpu_check.markdown(accumulated)

    # A triton row beside sdpa's: the step time's ratio, which decides the default backend.
    with_triton = copy.deepcopy(report)
    sdpa_row = next(row for row in with_triton["bench"] if row["name"] == "tiny-seq64-fp32-sdpa")
    triton_row = copy.deepcopy(sdpa_row)
    triton_row.update(name="tiny-seq64-fp32-triton", attention_backend="triton")
    triton_row["figures"]["deepspeed"]["seconds_per_step"] = 0.8 * sdpa_row["figures"]["deepspeed"]["seconds_per_step"]
    with_triton["bench"].append(triton_row)
    assert ("The triton backend against sdpa (pretrain's step, same sequence, micro batch and mode; below 1: triton "
            "is faster): seq 64 x 4 eager 0.80x (faster)." in gpu_check.markdown(with_triton))
    assert "The triton backend against sdpa" not in markdown

    # The report of a run whose pretrain step was skipped and whose other row failed.
    changed = copy.deepcopy(report)
    changed["bench"][0]["figures"]["deepspeed"] = {"skipped": "../shared/data absent"}
    changed["bench"].append({**changed["bench"][0], "ok": False, "error": "exit code 1: out of memory"})
    text = gpu_check.markdown(changed)
    assert "| 64 | 4 | skipped: ../shared/data absent |" in text and "failed: exit code 1: out of memory" in text


def _archived_report(archive: Path) -> dict:
    """gpu-check.json from inside an --archive file (one results folder)."""
    with tarfile.open(archive) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith("/gpu-check.json")]
        names = {m.name.split("/", 1)[-1] for m in tar.getmembers() if m.isfile()}
        assert "gpu-check.md" in names
        return json.loads(tar.extractfile(member).read())


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path):
    """A budget smaller than one step: every step listed as not run, the report and the archive still
    written, exit 0 (nothing failed)."""
    archive = tmp_path / "results.tar.gz"
    budget = gpu_check.REPORT_SECONDS + gpu_check.MIN_REAL_STEP_SECONDS - 1  # the dry run's first row is real
    result = run_module("tools.gpu_check", "--cpu-dry-run", "--output-dir", str(tmp_path / "out"),
                        "--budget-seconds", str(budget), "--archive", str(archive), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = _archived_report(archive)
    assert report["bench"] == [] and report["budget_seconds"] == budget
    assert report["not_run"][0] == "tiny-seq64-fp32-sdpa"
    assert report["not_run_reason"] == f"the budget of {budget} s was spent"
    (run,) = (tmp_path / "out").iterdir()
    assert f"Not run (the budget of {budget} s was spent): tiny-seq64-fp32-sdpa" in (run / "gpu-check.md").read_text()
    assert not list(tmp_path.glob("*.partial"))


def test_only_runs_the_named_steps_and_refuses_a_pattern_that_names_none(tmp_path):
    """--only 'attention kernels': that step alone, the others neither run nor listed as not run;
    a pattern matching no step: exit 2 naming the steps there are, no results folder left."""
    result = run_module("tools.gpu_check", "--cpu-dry-run", "--output-dir", str(tmp_path / "out"),
                        "--only", "attention kernels", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = (tmp_path / "out").iterdir()
    report = json.loads((run / "gpu-check.json").read_text())
    assert report["bench"] == [] and report["attention"]["ok"] and report["not_run"] == []
    notes = report["notes"]
    assert any(note.startswith("--only attention kernels: 1 of 3 steps (attention kernels)") for note in notes), notes
    result = run_module("tools.gpu_check", "--cpu-dry-run", "--output-dir", str(tmp_path / "none"),
                        "--only", "*-triton-*", timeout=300)
    assert result.returncode == 2 and "matches none of: tiny-seq64-fp32-sdpa" in result.stderr, result.stderr
    assert not any((tmp_path / "none").iterdir())


def _children(pid: int) -> list[str]:
    """The command lines of `pid`'s direct children."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the benchmark process")
def test_sigterm_during_a_benchmark_still_writes_the_report_and_the_archive(tmp_path):
    """`timeout` or a scheduler stopping the check mid-benchmark: the benchmark process is ended, the
    report names what did not run and why, the archive holds it, exit 1."""
    archive = tmp_path / "results.tar.gz"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "tools.gpu_check", "--cpu-dry-run", "--output-dir",
                                str(tmp_path / "out"), "--archive", str(archive)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not any("bench_train.py" in line and "--json" in line for line in _children(process.pid)):
            assert process.poll() is None, process.communicate()
            assert time.time() < deadline, "no benchmark process started within 240 s"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert "gpu-check: stopped by SIGTERM" in stderr
    report = _archived_report(archive)
    assert report["not_run"][0] == "tiny-seq64-fp32-sdpa" and report["not_run_reason"] == "stopped by SIGTERM"
    assert any(note.startswith("stopped by SIGTERM after ") for note in report["notes"])
    assert not _children(process.pid)


@pytest.mark.parametrize("kind", ["zip", "fifo", "folder", "no folder"])
def test_bad_archive_paths_are_refused_before_anything_runs(tmp_path, kind):
    path = tmp_path / {"zip": "results.zip", "fifo": "fifo.tar.gz", "folder": "folder.tar.gz",
                       "no folder": "missing/results.tar.gz"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    message = {"zip": "give a file name ending in .tar.gz", "fifo": "is not a regular file",
               "folder": "is a folder", "no folder": f"the folder {path.parent} does not exist"}[kind]
    result = run_module("tools.gpu_check", "--cpu-dry-run", "--output-dir", str(tmp_path / "out"), "--archive",
                        str(path), timeout=120)
    assert result.returncode == 2 and f"--archive {path}" in result.stderr and message in result.stderr, \
        result.stderr
    assert not (tmp_path / "out").exists() and len(result.stderr.strip().splitlines()) == 1


def test_a_budget_too_small_for_the_report_is_refused(tmp_path):
    result = run_module("tools.gpu_check", "--cpu-dry-run", "--output-dir", str(tmp_path), "--budget-seconds", "5",
                        timeout=120)
    assert result.returncode == 2 and "--budget-seconds 5: give more than" in result.stderr


def test_offline_scripts_refuse_bad_arguments_in_one_line(tmp_path):
    """tools/wheelhouse.sh and tools/offline_gpu_check.sh (docs/gpu.md, "without network"): their
    refusals need no network and install nothing."""
    empty = tmp_path / "wheels"
    empty.mkdir()
    cases = [
        ([str(REPO_ROOT / "tools" / "offline_gpu_check.sh"), str(empty), str(tmp_path / "r.tar.gz")],
         f"WHEELHOUSE {empty}: no .whl files"),
        ([str(REPO_ROOT / "tools" / "offline_gpu_check.sh"), str(empty)], "usage: tools/offline_gpu_check.sh"),
        ([str(REPO_ROOT / "tools" / "wheelhouse.sh"), str(tmp_path / "out"), "312"],
         "PYTHON_VERSION 312: give it as 3.N"),
        ([str(REPO_ROOT / "tools" / "wheelhouse.sh")], "usage: tools/wheelhouse.sh"),
    ]
    for command, message in cases:
        result = subprocess.run(["bash", *command], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and result.stderr.strip() == result.stderr.strip().splitlines()[0], result.stderr
        assert message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.tar.gz").exists()


def test_a_step_that_runs_past_its_timeout_is_ended_with_its_whole_process_group(tmp_path):
    """A benchmark or test process that started helpers of its own (torchrun's workers, say): at the
    timeout the whole group ends, nothing of it outlives the step."""
    marker = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(600)']); open({str(marker)!r}, 'w').write(str(child.pid)); print('started', flush=True); "
              "time.sleep(600)")
    started = time.time()
    output, returncode = gpu_check.run_process_group([sys.executable, "-c", script], timeout=5, env=dict(os.environ))
    assert returncode == 124 and "started" in output and "timed out after 5 s" in output
    assert time.time() - started < 5 + 2 * gpu_check.GROUP_STOP_SECONDS
    grandchild = int(marker.read_text())
    deadline = time.time() + 10
    while Path(f"/proc/{grandchild}").exists() and "zombie" not in _state(grandchild):
        assert time.time() < deadline, f"the step's helper {grandchild} outlived it"
        time.sleep(0.1)
    # A step that ends by itself: its output and exit code as they were.
    assert gpu_check.run_process_group([sys.executable, "-c", "print('done'); raise SystemExit(3)"], timeout=60,
                                       env=dict(os.environ)) == ("done\n", 3)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].splitlines()[0].lower()
    except (OSError, IndexError):
        return "zombie"
