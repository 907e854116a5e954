"""Resuming on another tensor/pipeline-parallel layout with --universal-checkpoint (issue 26): the
losses after the resume equal the uninterrupted run's in the original layout (dropout 0, same global
batch), with iteration, schedule and consumed samples kept; refusals are one line, before the model
is built. Each original run saves at iteration 3 of 6; its checkpoint at 3, alone in a directory
of its own, is what a run stopped there leaves."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from pmlm_testing import run_module

COMMON = ["--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "2e-3", "--lr-warmup-iters", "2",
          "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--zero-stage", "1",
          "--hidden-dropout", "0", "--attention-dropout", "0"]
PMLM = ["--preset", "tiny", *COMMON]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
ITERATIONS, STOPPED_AT = 6, 3


def train(samples: Path, out: Path, *args: str, nproc: int = 1) -> tuple[list[dict], str]:
    started = time.monotonic()
    history = out / "history.json"
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(samples), "--train-iters", str(ITERATIONS),
                        "--history-json", str(history), *args, nproc=nproc)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"{out.name}: {nproc} process(es), {time.monotonic() - started:.1f} s")
    return [r for r in json.loads(history.read_text()) if "loss" in r], result.stdout


def original_run(samples: Path, out: Path, *args: str, nproc: int) -> tuple[list[dict], Path]:
    """The uninterrupted run (its records) and a directory holding its checkpoint at STOPPED_AT only."""
    records, _ = train(samples, out / "original", *args, "--save", str(out / "saved"), "--save-interval",
                       str(STOPPED_AT), nproc=nproc)
    stopped = out / "stopped"
    tag = f"iter_{STOPPED_AT:07d}"
    shutil.copytree(out / "saved" / tag, stopped / tag)
    (stopped / "latest").write_text(tag)
    return records, stopped


def check_resume(samples: Path, out: Path, original: list[dict], stopped: Path, *args: str, nproc: int,
                 change: str) -> str:
    """Resume `stopped` with `args` on `nproc` processes, losses within 1e-4 of `original`'s; its log."""
    resumed, stdout = train(samples, out / "resumed", *args, "--load", str(stopped), "--universal-checkpoint",
                            nproc=nproc)
    assert f"consumed samples {16 * STOPPED_AT} (through" in stdout and change in stdout, stdout[-3000:]
    assert [r["iteration"] for r in resumed] == list(range(STOPPED_AT + 1, ITERATIONS + 1))
    assert [r["consumed_samples"] for r in resumed] == [16 * i for i in range(STOPPED_AT + 1, ITERATIONS + 1)]
    assert [r["lr"] for r in resumed] == pytest.approx([r["lr"] for r in original[STOPPED_AT:]])
    difference = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, original[STOPPED_AT:]))
    print(f"{change}: largest loss difference after the resume {difference:.2e}")
    assert difference < 1e-4, ([r["loss"] for r in resumed], [r["loss"] for r in original[STOPPED_AT:]])
    return stdout


@pytest.fixture(scope="module")
def tp2_checkpoint(pretraining_samples, tmp_path_factory):
    """A PMLM run at TP 2 (2 processes, ZeRO-1) and its checkpoint at iteration 3."""
    out = tmp_path_factory.mktemp("tp2")
    return (out, *original_run(pretraining_samples, out, *PMLM, *TP2, nproc=2))


def test_tp2_resumes_on_tp1(tp2_checkpoint, pretraining_samples):
    """The vocabulary padding changes with the TP size (30720 rows at TP 2, 30592 at TP 1). The run
    saves into the directory it resumed from: retention deletes the re-sharded copy with its checkpoint."""
    out, original, stopped = tp2_checkpoint
    directory = out / "resumed_here"
    shutil.copytree(stopped, directory)
    stdout = check_resume(pretraining_samples, out, original, directory, *PMLM, "--save", str(directory),
                          "--keep-last-checkpoints", "1", nproc=1,
                          change="TP 2 x PP 1 -> TP 1 x PP 1, data-parallel size 1 -> 1")
    # The model line speaks words; the raw field name is only in the run identity's config line.
    readable = "\n".join(line for line in stdout.splitlines() if not line.startswith("run identity: config "))
    assert "vocabulary 30522 padded to 30592" in readable and "padded_vocab_size" not in readable, stdout[-3000:]
    assert "RNG states are not restored because the layout changed (TP 2 x PP 1 then, TP 1 x PP 1 now)" in stdout
    tag = f"iter_{STOPPED_AT:07d}"
    assert f"deleted old checkpoint {directory / tag} and its universal conversion {tag}_universal_tp1_pp1" in stdout
    assert not [path.name for path in directory.iterdir() if path.name.startswith(tag)]


@pytest.mark.parametrize("original_layout, nproc_before, target_layout, nproc_after, change", [
    ([], 1, TP2, 2, "TP 1 x PP 1 -> TP 2 x PP 1"),
    (PP2, 2, [], 1, "TP 1 x PP 2 -> TP 1 x PP 1"),
    ([*TP2, *PP2], 4, [], 1, "TP 2 x PP 2 -> TP 1 x PP 1"),
], ids=["tp1-to-tp2", "pp2-to-pp1", "tp2pp2-to-1"])
def test_pmlm_resumes_on_another_layout(original_layout, nproc_before, target_layout, nproc_after, change,
                                        pretraining_samples, tmp_path):
    original, stopped = original_run(pretraining_samples, tmp_path, *PMLM, *original_layout, nproc=nproc_before)
    check_resume(pretraining_samples, tmp_path, original, stopped, *PMLM, *target_layout, nproc=nproc_after,
                 change=change)


def test_unilm_resumes_on_another_tensor_parallel_size(pretraining_samples, tmp_path):
    """UniLM v1 (its pooler and next-sentence head too): TP 2 -> 1."""
    unilm = [*PMLM, "--objective", "unilm"]
    original, stopped = original_run(pretraining_samples, tmp_path, *unilm, *TP2, nproc=2)
    check_resume(pretraining_samples, tmp_path, original, stopped, *unilm, nproc=1,
                 change="TP 2 x PP 1 -> TP 1 x PP 1")


def test_palm_resumes_on_another_tensor_parallel_size(pretraining_samples, tmp_path):
    """PALM (stage 2: encoder, decoder, copy attention): TP 2 -> 1."""
    samples = tmp_path / "palm_samples"
    built = run_module("data_prep.build_samples", "--layout", "palm", "--data-path",
                       str(pretraining_samples.parent / "wiki"), "--context-length", "48", "--continuation-length",
                       "16", "--split", "95,5,0", "--mask-epochs", "2", "--seed", "7", "--no-progress",
                       "--output", str(samples))
    assert built.returncode == 0, built.stderr[-3000:]
    palm = ["--model", "palm", "--preset", "palm-tiny", *COMMON]
    original, stopped = original_run(samples, tmp_path, *palm, *TP2, nproc=2)
    check_resume(samples, tmp_path, original, stopped, *palm, nproc=1, change="TP 2 x PP 1 -> TP 1 x PP 1")


def refused(samples: Path, *args: str) -> str:
    """The one line a refused run prints (exit 2, no traceback, nothing built)."""
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(samples), *PMLM, "--train-iters",
                        str(ITERATIONS), *args)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "model:" not in result.stdout, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_layout_changes_that_cannot_resume_say_what_to_do(tp2_checkpoint, pretraining_samples, tmp_path):
    _, _, stopped = tp2_checkpoint
    saved = f"{stopped} was saved with TP 2 x PP 1, this run asks for TP 1 x PP 1"
    line = refused(pretraining_samples, "--load", str(stopped))
    assert saved in line and "add --universal-checkpoint" in line and "padded_vocab_size" not in line, line
    line = refused(pretraining_samples, "--load", str(stopped), "--universal-checkpoint", "--zero-stage", "0")
    assert saved in line and "use --zero-stage 1 or 2" in line, line
    line = refused(pretraining_samples, "--load", str(stopped), "--finetune")
    assert saved in line and "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1" in line, line
    # A ZeRO-0 checkpoint keeps its optimizer whole in the model files: not re-sharded (its run
    # state says ZeRO-0 here; the check reads nothing else).
    zero0 = tmp_path / "zero0"
    shutil.copytree(stopped, zero0)
    run_state = zero0 / f"iter_{STOPPED_AT:07d}" / "run_state.json"
    state = json.loads(run_state.read_text())
    state["training_config"]["zero_stage"] = 0
    run_state.write_text(json.dumps(state))
    line = refused(pretraining_samples, "--load", str(zero0), "--universal-checkpoint")
    assert "with ZeRO-0" in line and "ZeRO-1/2" in line, line


def test_pipeline_names_map_back_to_the_plain_models():
    """Every parameter of the plain model (UniLM v1's pooler and NSP head included) has one pipeline
    name, and the converter's mapping takes it back."""
    from megatron_pmlm.config import model_config_from_preset
    from megatron_pmlm.models.pipeline import canonical_parameter_name
    from megatron_pmlm.training.checkpoint_reader import expected_shapes
    from megatron_pmlm.training.relayout import pipeline_parameter_name

    config = model_config_from_preset("tiny", vocab_size=30522)
    names = list(expected_shapes(config, nsp_head=True))
    pipeline_names = [pipeline_parameter_name(name, config.num_layers) for name in names]
    assert len(set(pipeline_names)) == len(names)
    assert [canonical_parameter_name(name, config.num_layers) for name in pipeline_names] == names
