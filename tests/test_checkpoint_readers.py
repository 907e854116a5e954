"""Every command that reads a checkpoint checks its files' checksums first, through the one reader
(checkpoint_reader.resolve_tag, with the resume's newest_verified_checkpoint): 4 KB overwritten in
the newest model states is passed over for the older checkpoint that verifies, naming the bad
file and the tag used; with nothing to fall back on, or a damaged --tag, the command is refused in
one line and writes nothing; --no-checksums reads it anyway, saying so.

One real tiny pre-training run (checkpoints at iterations 1 and 2) makes the checkpoints each test
damages a copy of."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pmlm_testing import damage_in_place, run_module

pytest.importorskip("transformers")

from megatron_pmlm.hf.convert import main as convert_main  # noqa: E402
from megatron_pmlm.training.checkpoint_reader import load_pretraining_checkpoint  # noqa: E402

MODEL_STATES = "mp_rank_00_model_states.pt"
OLD, NEW = "iter_0000001", "iter_0000002"
MISMATCH = f"{MODEL_STATES} checksum mismatch (file changed after save)"


@pytest.fixture(scope="module")
def pretrained(pretraining_samples, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("readers") / "ckpt"
    result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(pretraining_samples),
                        "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2",
                        "--save-interval", "1", "--eval-iters", "0", "--log-interval", "1", "--save", str(save))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (save / "latest").read_text() == NEW and (save / OLD / "run_state.json").is_file()
    return save


def damage(tag_dir: Path) -> None:
    """4 KB in the middle of the model states flipped, the size unchanged (a bad disk block)."""
    damage_in_place(tag_dir / MODEL_STATES)


@pytest.fixture
def damaged(pretrained, tmp_path) -> Path:
    """A copy of the run's checkpoints whose newest (the one `latest` names) is damaged."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pretrained, ckpt)
    damage(ckpt / NEW)
    return ckpt


@pytest.fixture
def only_damaged(damaged) -> Path:
    """Nothing to fall back on: the older checkpoint is gone."""
    shutil.rmtree(damaged / OLD)
    return damaged


def fallback_line(ckpt: Path) -> str:
    return f"warning: {ckpt / NEW}: {MISMATCH}; using {ckpt / OLD}, the newest checkpoint that verifies"


def one_error_line(stderr: str) -> str:
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.startswith("error: "), stderr
    return stderr.strip()


# ------------------------------------------------------------------------------------------------
# convert_checkpoint
# ------------------------------------------------------------------------------------------------

class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)


def test_convert_falls_back_to_the_newest_checkpoint_that_verifies(damaged, tmp_path):
    lines = Lines()
    assert convert_main(["--load", str(damaged), "--output", str(tmp_path / "hf")], log=lines) == 0
    assert lines[0] == fallback_line(damaged), lines
    assert lines[1].startswith(f"read {damaged / OLD} "), lines
    import torch

    exported = torch.load(tmp_path / "hf" / "pytorch_model.bin", weights_only=True)
    older = load_pretraining_checkpoint(damaged, OLD).state_dict
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(exported[name], older[name])  # the older checkpoint's weights, not the damaged ones


@pytest.mark.parametrize("case", ["explicit-tag", "only-one"])
def test_convert_refuses_a_damaged_checkpoint_in_one_line(case, damaged, tmp_path, capsys):
    argv = ["--load", str(damaged), "--output", str(tmp_path / "hf")]
    if case == "explicit-tag":
        argv += ["--tag", NEW]
        expected = f"error: --tag {NEW}: {damaged / NEW} fails its check: {MISMATCH}"
    else:
        shutil.rmtree(damaged / OLD)
        expected = f"error: no checkpoint in {damaged} passes its check: {damaged / NEW}: {MISMATCH}"
    assert convert_main(argv, log=Lines()) == 2
    assert one_error_line(capsys.readouterr().err).startswith(expected)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".*"))


def test_convert_with_no_checksums_reads_the_damaged_checkpoint_saying_so(only_damaged, tmp_path, capsys):
    lines = Lines()
    code = convert_main(["--load", str(only_damaged), "--output", str(tmp_path / "hf"), "--no-checksums"], log=lines)
    assert lines[0] == f"not checking the checksums of {only_damaged / NEW} (--no-checksums)", lines
    assert code == 0 and (tmp_path / "hf" / "config.json").is_file(), capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# decode_s2s, finetune_s2s, finetune_glue / evaluate_downstream (the same reader)
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def sources(tmp_path) -> Path:
    path = tmp_path / "src.txt"
    path.write_text("what is the capital of france ?\nwho wrote hamlet ?\n")
    return path


def decode(model: Path, sources: Path, output: Path, *extra: str):
    return run_module("megatron_pmlm.decode_s2s", "--model", str(model), "--input", str(sources), "--output",
                      str(output), "--max-target-length", "4", "--no-progress", *extra, timeout=300)


def test_decode_s2s_falls_back_refuses_or_reads_unchecked(damaged, sources, tmp_path):
    result = decode(damaged, sources, tmp_path / "fallback.txt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert fallback_line(damaged) in result.stderr.splitlines(), result.stderr[-3000:]
    assert len((tmp_path / "fallback.txt").read_text().splitlines()) == 2
    shutil.rmtree(damaged / OLD)
    result = decode(damaged, sources, tmp_path / "refused.txt")
    assert result.returncode == 2
    assert one_error_line(result.stderr).startswith(f"error: no checkpoint in {damaged} passes its check: "
                                                    f"{damaged / NEW}: {MISMATCH}")
    assert not (tmp_path / "refused.txt").exists()
    result = decode(damaged, sources, tmp_path / "unchecked.txt", "--no-checksums")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"not checking the checksums of {damaged / NEW} (--no-checksums)" in result.stderr.splitlines()


def finetune_s2s(model: Path, qg_pairs, save: Path, *extra: str):
    return run_module("megatron_pmlm.finetune_s2s", "--model", str(model), "--train-src", str(qg_pairs[0]),
                      "--train-tgt", str(qg_pairs[1]), "--max-source-length", "32", "--max-target-length", "12",
                      "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "1",
                      "--log-interval", "1", "--save", str(save), *extra, timeout=300)


def test_finetune_s2s_from_a_damaged_checkpoint(damaged, qg_pairs, tmp_path):
    result = finetune_s2s(damaged, qg_pairs, tmp_path / "fallback")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert fallback_line(damaged) in result.stderr.splitlines(), result.stderr[-3000:]
    shutil.rmtree(damaged / OLD)
    result = finetune_s2s(damaged, qg_pairs, tmp_path / "refused")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert one_error_line(result.stderr).startswith(f"error: no checkpoint in {damaged} passes its check: "
                                                    f"{damaged / NEW}: {MISMATCH}")
    assert not (tmp_path / "refused").exists()


@pytest.fixture(scope="module")
def glue_dir(shared_data) -> Path:
    folder = shared_data / "glue"
    if not (folder / "MRPC" / "train.tsv").is_file():
        pytest.skip(f"{folder}/MRPC is absent")
    return folder


def finetune_glue(model: Path, glue_dir: Path, output: Path, *extra: str):
    return run_module("megatron_pmlm.finetune_glue", "--model", str(model), "--task", "mrpc", "--data-dir",
                      str(glue_dir), "--output-dir", str(output), "--max-steps", "1", "--max-train-samples", "8",
                      "--max-eval-samples", "8", "--per-device-train-batch-size", "8", "--disable-tqdm",
                      "--no-save-model", *extra, timeout=300)


def test_finetune_glue_from_a_damaged_checkpoint(damaged, glue_dir, tmp_path):
    result = finetune_glue(damaged, glue_dir, tmp_path / "fallback")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert fallback_line(damaged) in result.stdout.splitlines(), result.stdout[-3000:]
    # The converted folder records the checkpoint it holds: the older one.
    assert f'"checkpoint_tag": "{OLD}"' in (tmp_path / "fallback" / "model" / "config.json").read_text()
    shutil.rmtree(damaged / OLD)
    result = finetune_glue(damaged, glue_dir, tmp_path / "refused")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert one_error_line(result.stderr).startswith(f"error: --model {damaged}: no checkpoint in {damaged} passes "
                                                    f"its check: {damaged / NEW}: {MISMATCH}")
    assert not (tmp_path / "refused").exists()
    result = finetune_glue(damaged, glue_dir, tmp_path / "unchecked", "--no-checksums")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"not checking the checksums of {damaged / NEW} (--no-checksums)" in result.stdout.splitlines()
