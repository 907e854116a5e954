"""Checkpoint integrity: every file's size and checksum are recorded at save; a checkpoint whose
bytes changed after the save (same size) is named by tools/verify_checkpoint.py and passed over on
resume for the newest one that verifies, and the resumed run equals the uninterrupted one.
Checkpoints saved before checksums existed still resume, checked by size.

One real run (2 processes, ZeRO-2: files hashed by both ranks) makes the checkpoints each test
damages a copy of."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest

from pmlm_testing import damage_in_place, run_module, run_tool

ARGS = ["--preset", "tiny", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "2e-3",
        "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "2", "--save-interval", "2"]
MODEL_STATES = "mp_rank_00_model_states.pt"
RANK_1_OPTIMIZER = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def pretrain(samples: Path, ckpt: Path, history: Path, *args: str):
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(samples), *ARGS, "--train-iters", "6",
                        "--save", str(ckpt), "--history-json", str(history), *args, nproc=2)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return [r for r in json.loads(history.read_text()) if "loss" in r], result


def verify_tool(path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_tool("verify_checkpoint.py", str(path), *args)


def losses(records):
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def uninterrupted(pretraining_samples, tmp_path_factory):
    """Six iterations, checkpoints at 2, 4 and 6: the reference losses and the checkpoints."""
    out = tmp_path_factory.mktemp("uninterrupted")
    records, _ = pretrain(pretraining_samples, out / "ckpt", out / "history.json")
    return out / "ckpt", records


@pytest.fixture
def ckpt(uninterrupted, tmp_path) -> Path:
    """A copy of the uninterrupted run's checkpoints to damage."""
    shutil.copytree(uninterrupted[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def resume(samples: Path, ckpt: Path, uninterrupted, resumed_from: int):
    """Resume into `ckpt` to iteration 6; the losses after `resumed_from` equal the uninterrupted run's."""
    records, result = pretrain(samples, ckpt, ckpt.parent / "resumed.json", "--load", str(ckpt))
    assert f"resumed from {ckpt / f'iter_{resumed_from:07d}'}: iteration {resumed_from}" in result.stdout
    reference = [r for r in uninterrupted[1] if r["iteration"] > resumed_from]
    assert [r["iteration"] for r in records] == [r["iteration"] for r in reference]
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def test_the_manifest_has_every_files_size_and_checksum(uninterrupted):
    ckpt = uninterrupted[0]
    for tag in ("iter_0000002", "iter_0000004", "iter_0000006"):
        saved = json.loads((ckpt / tag / "run_state.json").read_text())
        files = {str(p.relative_to(ckpt / tag)): p.stat().st_size for p in (ckpt / tag).rglob("*")
                 if p.is_file() and p.name != "run_state.json"}
        assert {MODEL_STATES, RANK_1_OPTIMIZER, "rng_state_rank00001.pt"} <= set(files)
        assert saved["files"] == files
        assert set(saved["checksums"]) == set(files)
        assert all(c.startswith("xxh3_128:") and len(c) == len("xxh3_128:") + 32 for c in saved["checksums"].values())
    verified = verify_tool(ckpt)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.count("complete, sizes and checksums match") == 3, verified.stdout


def test_bytes_changed_in_place_are_named_and_resume_falls_back(ckpt, uninterrupted, pretraining_samples):
    """4 KB overwritten in the middle of the newest model states, size unchanged (a bad disk block,
    a stray write): once loaded without a word."""
    damage_in_place(ckpt / "iter_0000006" / MODEL_STATES)
    verified = verify_tool(ckpt)
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert (f"{ckpt / 'iter_0000006'} (latest): UNUSABLE: {MODEL_STATES} checksum mismatch (file changed after save)"
            in verified.stdout), verified.stdout
    assert f"resuming would use {ckpt / 'iter_0000004'}" in verified.stdout
    fast = verify_tool(ckpt / "iter_0000006", "--fast")
    assert fast.returncode == 0 and "complete, sizes only (--fast)" in fast.stdout, fast.stdout + fast.stderr
    result = resume(pretraining_samples, ckpt, uninterrupted, resumed_from=4)
    assert (f"warning: skipping {ckpt / 'iter_0000006'}: {MODEL_STATES} checksum mismatch (file changed after save)"
            in result.stdout), result.stdout[-3000:]
    # The damaged checkpoint was saved anew.
    assert verify_tool(ckpt / "iter_0000006").returncode == 0


def test_an_unpicklable_file_falls_back_without_a_traceback(ckpt, uninterrupted, pretraining_samples):
    """The start of rank 1's optimizer shard's pickle overwritten: torch.load raises UnpicklingError."""
    import torch

    shard = ckpt / "iter_0000006" / RANK_1_OPTIMIZER
    data = bytearray(shard.read_bytes())
    start = data.index(b"\x80\x02", data.index(b"data.pkl"))  # the pickle (protocol 2) of torch's zip
    data[start:start + 16] = b"not a pickle!!!!"
    shard.write_bytes(data)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(shard, weights_only=False)
    result = resume(pretraining_samples, ckpt, uninterrupted, resumed_from=4)
    assert (f"warning: skipping {ckpt / 'iter_0000006'}: {RANK_1_OPTIMIZER} checksum mismatch (file changed after "
            "save)" in result.stdout), result.stdout[-3000:]


def test_a_checkpoint_from_before_checksums_resumes_checked_by_size(ckpt, uninterrupted, pretraining_samples):
    """iter_4 as an older version saved it (a manifest of sizes only), and the newest."""
    shutil.rmtree(ckpt / "iter_0000006")
    (ckpt / "latest").write_text("iter_0000004")
    run_state = ckpt / "iter_0000004" / "run_state.json"
    saved = json.loads(run_state.read_text())
    del saved["checksums"]
    run_state.write_text(json.dumps(saved))
    note = f"{ckpt / 'iter_0000004'} has no checksums (saved by an older version): checked sizes only"
    verified = verify_tool(ckpt)
    assert verified.returncode == 0 and "complete, sizes only" in verified.stdout and note in verified.stdout, \
        verified.stdout + verified.stderr
    result = resume(pretraining_samples, ckpt, uninterrupted, resumed_from=4)
    assert result.stdout.count(note) == 1, result.stdout[-3000:]
    assert "checksums" in json.loads((ckpt / "iter_0000006" / "run_state.json").read_text())


def test_every_file_is_hashed_once_and_the_largest_are_spread():
    from megatron_pmlm.training.checkpoint_files import checksum_share

    sizes = {"model": 1400, "optim_0": 500, "optim_1": 500, "optim_2": 500, "rng_0": 1, "rng_1": 1, "rng_2": 1}
    shares = [checksum_share(sizes, rank, 3) for rank in range(3)]
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    assert shares[0][0] == "model" and max(sum(sizes[n] for n in share) for share in shares) == 1400
    assert checksum_share(sizes, 0, 1) == sorted(sizes, key=lambda n: (-sizes[n], n))
