"""tools/bench_train.py: it runs on CPU in seconds and prints its figures, and its naive-cloze
baseline predicts exactly what the pseudo-masked layout predicts, one step per pass."""

from __future__ import annotations

import json
import sys

import torch

from pmlm_testing import REPO_ROOT, run_module

sys.path.insert(0, str(REPO_ROOT / "tools"))
import bench_train  # noqa: E402

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
    bad = run_module("tools.bench_train", "--preset", "tiny", "--micro-batch-size", "0")
    assert bad.returncode == 2 and "--micro-batch-size must be >= 1" in bad.stderr
