"""tools/bench_train.py: it runs on CPU in seconds and prints its figures, and its naive-cloze
baseline predicts exactly what the pseudo-masked layout predicts, one step per pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pmlm_testing import REPO_ROOT, run_module

sys.path.insert(0, str(REPO_ROOT / "tools"))
import bench_train  # noqa: E402
import gpu_check  # noqa: E402

from megatron_pmlm.models.layout import IGNORE_INDEX, MASKED, PSEUDO  # noqa: E402


def test_naive_cloze_passes_predict_what_the_pseudo_masked_layout_predicts():
    examples = bench_train.make_examples(3, 64, 30522, seed=5)
    pmlm = bench_train.pmlm_batch(examples)
    naive = bench_train.naive_cloze_batches(examples)
    steps = max(int(m.step_ids.max()) for _, _, m in examples)
    assert len(naive) == steps + 1  # the AE pass and one per factorization step
    for row, (ids, _, masks) in enumerate(examples):
        ae = sorted(int(p) for p in torch.nonzero(pmlm.roles[row] == MASKED).flatten())
        assert sorted(int(p) for p in torch.nonzero(naive[0].labels[row] != IGNORE_INDEX).flatten()) == ae
        for step in range(1, steps + 1):
            predicted = masks.masked_positions[masks.step_ids == step]
            labelled = torch.nonzero(naive[step].labels[row] != IGNORE_INDEX).flatten().tolist()
            assert sorted(labelled) == sorted(predicted.tolist())
            # Later steps are hidden, earlier ones revealed.
            later = masks.masked_positions[masks.step_ids > step]
            earlier = masks.masked_positions[masks.step_ids < step]
            assert (naive[step].input_ids[row, later] == bench_train.MASK).all()
            assert (naive[step].input_ids[row, earlier] == torch.from_numpy(ids[earlier])).all()
        par_labels = pmlm.labels[row][pmlm.roles[row] == PSEUDO]
        assert sorted(par_labels.tolist()) == sorted(ids[masks.masked_positions].tolist())


def test_bench_train_runs_on_cpu_and_reports_its_figures(tmp_path):
    out = tmp_path / "figures.json"
    result = run_module("tools.bench_train", "--preset", "tiny", "--seq-length", "64", "--micro-batch-size", "4",
                        "--iterations", "1", "--warmup", "0", "--naive-cloze", "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "samples/s" in result.stdout and "model TFLOP/s" in result.stdout and "MFU" in result.stdout
    assert "naive cloze" in result.stdout
    figures = json.loads(out.read_text())
    assert figures["tokens_per_sec"] > 0 and figures["model_tflops"] > 0 and 0 < figures["mfu"]
    assert figures["layout_width"] > 64 and figures["naive_passes"] > 2 and figures["pmlm_over_naive"] > 0
    # The CPU proxies (issue 33, item 9): syncs in our code over one eager step, kernels, bias bytes.
    assert "proxies: host syncs/step" in result.stdout
    ours = sum(int(line.split()[0]) for line in figures["host_syncs"] if line.split()[1] == "ours")
    assert figures["host_syncs_per_step"] == ours and figures["host_syncs_all_owners"] >= ours
    assert figures["kernels_per_step"] > 100 and figures["kernels_counted"] == "eager (dispatch)"
    heads, width = 4, figures["padded_width"]  # tiny: 4 heads
    assert figures["bias_bytes_per_step"] >= 4 * heads * width * width * 4  # at least one fp32 [B, H, T, T]
    assert figures["bias_ops"] and figures["sdpa_pad_bytes_per_step"] == 0  # the bias is built aligned
    assert figures["table_gradient"] == "the layers' summed bias gradient, one-hot GEMMs"  # the CPU's path
    assert "| table gradient: the layers' summed bias gradient, one-hot GEMMs" in result.stdout
    # Where the kernels come from (by phase and op), the optimizer one fused AdamW; the host floor.
    assert figures["kernels_by_source"]["optimizer: aten::_fused_adamw_"] == 1
    assert any(source.startswith("backward EmbeddingBackward0: ") for source in figures["kernels_by_source"])
    assert 0 < figures["host_ms_forward_backward"] < figures["host_ms_per_step"]
    assert figures["host_proxy_shape"].startswith("micro batch 1, seq 16 ") and "host ms/step" in result.stdout
    bad = run_module("tools.bench_train", "--preset", "tiny", "--micro-batch-size", "0")
    assert bad.returncode == 2 and "--micro-batch-size must be >= 1" in bad.stderr


def test_hidden_size_keeps_the_preset_s_structure_with_less_arithmetic(tmp_path):
    """--hidden-size: the same layers, heads and parameter tensors (so the same kernels per step), a
    narrower model (fewer FLOPs per token); a width the heads do not divide is refused."""
    figures = {}
    for name, extra in (("preset", []), ("narrow", ["--hidden-size", "32"])):
        out = tmp_path / f"{name}.json"
        result = run_module("tools.bench_train", "--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "2",
                            "--iterations", "1", "--warmup", "0", "--json", str(out), *extra, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        figures[name] = json.loads(out.read_text())
    assert figures["narrow"]["kernels_per_step"] == figures["preset"]["kernels_per_step"]
    assert (figures["narrow"]["hidden_size"], figures["preset"]["hidden_size"]) == (32, 64)
    flops_per_token = {name: f["model_tflops"] / f["tokens_per_sec"] for name, f in figures.items()}
    assert flops_per_token["narrow"] < flops_per_token["preset"] / 2
    assert figures["narrow"]["host_ms_outside_ops"] > 0
    bad = run_module("tools.bench_train", "--preset", "tiny", "--hidden-size", "30")
    assert bad.returncode == 2 and "--hidden-size 30 is not a multiple of the preset's 4 attention heads" in bad.stderr


def test_peak_from_device_name_tells_the_h100_forms_apart_and_names_its_source():
    peak = bench_train.peak_from_device_name
    assert peak("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.0 and "H100 SXM" in peak("NVIDIA H100 80GB HBM3", "bf16")[1]
    assert peak("NVIDIA H100 PCIe", "bf16")[0] == 756.0
    assert peak("NVIDIA H100 NVL", "fp16")[0] == 835.0
    assert peak("NVIDIA H200", "bf16") == (989.0, "H200 SXM datasheet, dense bf16 (device 'NVIDIA H200')")
    assert peak("Tesla V100-SXM2-32GB", "fp16")[0] == 125.0
    assert peak("Tesla V100-SXM2-32GB", "bf16")[0] is None  # Volta has no bf16
    assert peak("NVIDIA A100-SXM4-80GB", "bf16")[0] == 312.0
    assert peak("Some Future GPU", "bf16") == (None, "unknown GPU 'Some Future GPU': pass --peak-tflops")


def test_data_path_needs_deepspeed_and_an_existing_folder(tmp_path):
    alone = run_module("tools.bench_train", "--preset", "tiny", "--data-path", str(tmp_path))
    assert alone.returncode == 2 and "--data-path is for --deepspeed" in alone.stderr
    missing = run_module("tools.bench_train", "--preset", "tiny", "--deepspeed", "--data-path", str(tmp_path / "no"))
    assert missing.returncode == 2 and "no such samples folder" in missing.stderr


def test_the_real_step_s_samples_are_built_from_whole_wikitext_articles():
    """wikitext ends every paragraph with a blank line, which ends a document for preprocess: read
    as it is, no sample reached seq 512 (235 tokens per sample on the H200). One document per
    article: blank lines only before a title line, never before a section heading."""
    text = ("\n = Lobster = \n\n A first paragraph .\n\n = = Biology = = \n\n Claws .\n\n"
            " = Frank = \n\n Born in 1914 .\n\n = = = Early life = = = \n\n A school .\n")
    assert bench_train.article_documents(text) == (
        " = Lobster = \n A first paragraph .\n = = Biology = = \n Claws .\n\n"
        " = Frank = \n Born in 1914 .\n = = = Early life = = = \n A school .\n")


def test_the_device_timeline_counts_overlapping_kernels_once_and_the_gaps_as_idle(tmp_path):
    """Two streams overlapping (0-10 and 5-12 us), a gap, a copy (20-25 us); host events ignored."""
    events = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 10}, {"ph": "X", "cat": "kernel", "ts": 5, "dur": 7},
              {"ph": "X", "cat": "gpu_memcpy", "ts": 20, "dur": 5}, {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 99}]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert bench_train.device_timeline(str(trace)) == {"span_ms": 0.025, "busy_ms": 0.017, "idle_ms": 0.008,
                                                        "kernels": 3, "ms_by_kind": {"other": 0.017,
                                                                                     "copies and fills": 0.005}}
    trace.write_text(json.dumps({"traceEvents": events[3:]}))
    assert bench_train.device_timeline(str(trace)) is None
    assert bench_train.companion_trace_path("/o/base.trace.json", "pretrain") == "/o/base.pretrain.trace.json"


def test_the_device_timeline_sums_the_kernels_time_by_kind(tmp_path):
    """Where a busy step's GPU time goes: kernels named as an H100 trace names them (cuBLAS's, our Triton
    kernels', Inductor's, torch's attention and optimizer, NCCL's), summed by kind, largest first."""
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMMs", "nvjet_tst_128x256_64x4_1x2_h_bz_TNT":
        "GEMMs", "triton_tem_fused_addmm_gelu_t_view_6": "GEMMs",
        "attention_backward_key_value_kernel": "attention, ours", "bucket_sums_kernel": "attention, ours",
        "attention_dropout_bits_kernel": "attention, ours",
        "gelu_backward_kernel": "other Triton kernels of ours", "dropout_keep_bits_kernel": "other Triton kernels of ours",
        "triton_per_fused_native_layer_norm_backward_3": "Inductor's fused kernels",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionKernel)": "attention, torch's",
        "void multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other"}
    assert {name: bench_train.kernel_kind(name) for name in names} == names
    assert bench_train.kernel_kind("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "copies and fills"
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": 10 * index, "dur": index + 1}
              for index, name in enumerate(names)]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    kinds = bench_train.device_timeline(str(trace))["ms_by_kind"]
    expected: dict[str, float] = {}
    for index, kind in enumerate(names.values()):
        expected[kind] = expected.get(kind, 0.0) + (index + 1) / 1e3
    assert kinds == pytest.approx(expected) and list(kinds.values()) == sorted(kinds.values(), reverse=True)
    line = gpu_check._timeline(bench_train.device_timeline(str(trace)))
    assert f"Kernel time by kind: {next(iter(kinds))} {next(iter(kinds.values())):.1f} ms" in line, line


def test_pretrain_s_step_is_timed_and_signals_keep_their_meaning(pretraining_samples, tmp_path):
    """--deepspeed on the CPU: pretrain's own step (two micro batches an optimizer step) is timed beside
    the bare model; its kernels do not grow with the micro batch (no per-sequence work: the table
    gradient once ran a GEMM per sequence under bf16 weights); and the Trainer it builds does not
    keep SIGTERM/SIGINT to itself (they ask a run to save at its next iteration; this loop is not a
    run, so `timeout` or Ctrl-C must end the bench)."""
    from deepspeed.accelerator import get_accelerator

    precision = ["--bf16"] if get_accelerator().is_bf16_supported() else []  # DeepSpeed's own question
    # 2 and 5, not 1: at batch 1 the CPU's SDPA reads its strided inputs without the copies it makes above.
    outputs = {micro_batch: tmp_path / f"figures-{micro_batch}.json" for micro_batch in (2, 5)}
    calls = "; ".join(
        f"codes.append(bench_train.main(['--preset', 'tiny', '--seq-length', '64', '--micro-batch-size', "
        f"'{micro_batch}', '--iterations', '1', '--warmup', '0', '--deepspeed', '--gradient-accumulation-steps', "
        f"'2', '--data-path', {str(pretraining_samples)!r}, '--json', {str(out)!r}, *{precision!r}]))"
        for micro_batch, out in outputs.items())
    # The handlers the process started with (Python's own for SIGINT, or SIG_IGN where its parent
    # ignores it: pytest-xdist's workers launched from a background job) are the ones it ends with.
    script = ("import signal, sys; sys.path.insert(0, 'tools'); import bench_train; codes = []; "
              "signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT); "
              "before = [signal.getsignal(s) for s in signals]; " + calls + "; "
              "print('handlers', [signal.getsignal(s) == handler for s, handler in zip(signals, before)]); "
              "sys.exit(max(codes))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "handlers [True, True, True]" in result.stdout
    real = {micro_batch: json.loads(out.read_text())["deepspeed"] for micro_batch, out in outputs.items()}
    assert real[5]["zero_stage"] == 1 and real[5]["seconds_per_step"] > 0 and real[5]["kernels_per_step"] > 100
    assert real[5]["precision"] == ("bf16" if precision else "fp32")
    assert real[2]["kernels_per_step"] == real[5]["kernels_per_step"], (real[2]["kernels_per_step"],
                                                                         real[5]["kernels_per_step"])
    # Two micro batches an optimizer step: every one counted in samples/s and tokens.
    assert real[5]["gradient_accumulation_steps"] == 2 and "2 micro batches a step" in result.stdout
    assert abs(real[5]["samples_per_sec"] * real[5]["seconds_per_step"] - 10) < 1e-6
    bare_only = run_module("tools.bench_train", "--preset", "tiny", "--gradient-accumulation-steps", "2")
    assert bare_only.returncode == 2 and "--gradient-accumulation-steps is for --deepspeed" in bare_only.stderr
