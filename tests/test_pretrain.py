"""Pre-training end to end on DeepSpeed (one process, CPU): the losses fall on real text; bad
arguments stop with a clear message, not a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pmlm.training import TrainingConfig, lr_lambda


def _pretrain(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_pmlm.pretrain", *args],
                          capture_output=True, text=True, timeout=timeout)


def _slice(source: Path, target: Path, max_bytes: int) -> Path:
    target.write_bytes(source.read_bytes()[:max_bytes])
    return target


def test_tiny_model_losses_fall_on_real_text(tmp_path, wikitext, bert_vocab):
    corpus = _slice(wikitext, tmp_path / "wiki.txt", 400_000)
    history = tmp_path / "history.json"
    result = _pretrain(
        "--preset", "tiny", "--vocab-file", str(bert_vocab), "--text-data", str(corpus),
        "--seq-length", "128", "--micro-batch-size", "8", "--global-batch-size", "16",
        "--train-iters", "60", "--lr", "2e-3", "--lr-warmup-iters", "6", "--log-interval", "10",
        "--eval-interval", "60", "--eval-iters", "2", "--history-json", str(history),
        "--save", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in json.loads(history.read_text()) if "loss" in r]
    first, last = records[0], records[-1]
    assert last["iteration"] == 60
    # From ~log(30522) = 10.3 towards unigram entropy: both objectives learn.
    assert first["loss_ae"] > 8.5 and first["loss_par"] > 8.5
    assert last["loss_ae"] < first["loss_ae"] - 1.5, records
    assert last["loss_par"] < first["loss_par"] - 1.5, records
    assert "validation at iteration 60" in result.stdout
    assert any((tmp_path / "ckpt").glob("iter_0000060/*")), "no checkpoint written"


@pytest.mark.parametrize("args,message", [
    (["--objective", "mlm"], "unknown objective 'mlm'"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--preset", "tiny", "--seq-length", "512"], "--seq-length 512 exceeds the model's maximum sequence length 128"),
    (["--preset", "tiny", "--seq-length", "64", "--micro-batch-size", "3", "--global-batch-size", "16"],
     "not divisible by micro batch size 3"),
])
def test_bad_arguments_give_a_clear_error(tmp_path, args, message, bert_vocab):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Some text. More text here.\n")
    result = _pretrain("--vocab-file", str(bert_vocab), "--text-data", str(corpus), *args, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_input_is_named(tmp_path, bert_vocab):
    result = _pretrain("--preset", "tiny", "--seq-length", "64", "--vocab-file", str(bert_vocab),
                       "--text-data", str(tmp_path / "nope.txt"), timeout=120)
    assert result.returncode == 2 and "nope.txt" in result.stderr and "Traceback" not in result.stderr


def test_learning_rate_schedule_is_linear_warmup_then_linear_decay():
    config = TrainingConfig(lr=6e-4, min_lr=0.0, lr_warmup_iters=24_000, train_iters=500_000)
    multiplier = lr_lambda(config)
    assert multiplier(0) == pytest.approx(1 / 24_000)
    assert multiplier(23_999) == pytest.approx(1.0)
    assert multiplier(24_000) == pytest.approx(1.0)
    assert multiplier(262_000) == pytest.approx(0.5)
    assert multiplier(500_000) == pytest.approx(0.0)
    assert TrainingConfig().adam_beta2 == 0.98 and TrainingConfig().adam_eps == 1e-6
    assert TrainingConfig().global_batch_size == 7680 and TrainingConfig().clip_grad == 0.0
