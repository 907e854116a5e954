"""data_prep.inspect: the JSON of one sample agrees with the stored sample and masks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from data_prep.inspect import main, step_spans
from megatron_pmlm.data import PretrainingSamples


def test_json_has_tokens_segments_and_steps_in_order(built, capsys):
    samples = PretrainingSamples(built, "valid")
    index, epoch = len(samples) // 2, samples.mask_epochs - 1
    assert main([str(built), "--sample", str(index), "--split", "valid", "--mask-epoch", str(epoch), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    (ids,), (segments,) = samples.tokens([index])
    (masks,) = samples.masks([index], epoch)
    assert info["input_ids"] == ids.tolist() and info["segment_ids"] == segments.tolist()
    assert info["tokens"][0] == "[CLS]" and info["tokens"][-1] == "[SEP]" and len(info["tokens"]) == len(ids)
    assert info["mask_epoch"] == epoch
    # The steps, in factorization order, are exactly the stored masked positions.
    covered = [p for start, end in info["steps"] for p in range(start, end)]
    assert covered == masks.masked_positions.tolist()
    assert len(info["steps"]) == int(masks.step_ids.max())
    assert step_spans(np.array([7, 8, 2, 5]), np.array([1, 1, 2, 3])) == [[7, 9], [2, 3], [5, 6]]


def test_text_output_sentence_mode_and_errors(built, tokenized, capsys):
    assert main([str(built), "--sample", "0"]) == 0
    out = capsys.readouterr().out
    assert "factorization order" in out and "A: [CLS]" in out
    assert main([str(tokenized), "--sample", "3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sentence"] == 3 and info["tokens"] and info["document"] >= 0
    assert main([str(built), "--sample", "999999"]) == 2
    assert "out of range" in capsys.readouterr().err
    # A mask epoch the build does not have is refused (it used to wrap around silently).
    epochs = PretrainingSamples(built, "train").mask_epochs
    assert main([str(built), "--sample", "0", "--mask-epoch", str(epochs)]) == 2
    assert f"--mask-epoch {epochs} is out of range" in capsys.readouterr().err
    assert main([str(Path(built) / "nowhere"), "--sample", "0"]) == 2


def test_module_runs_from_the_command_line(built):
    result = subprocess.run([sys.executable, "-m", "data_prep.inspect", str(built), "--sample", "1", "--json"],
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) >= {"input_ids", "tokens", "segment_ids", "steps"}
