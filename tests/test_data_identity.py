"""A resume checks the samples it is given against the ones the checkpoint was trained on (issue 34
item 4): the samples' identity (from their content, not their path) is recorded in metadata.json
by build_samples and with each checkpoint; another vocabulary is refused, other samples of the same
vocabulary need --allow-data-change, a moved samples folder resumes as it is, an older checkpoint
resumes with a warning, and --finetune is unaffected."""

from __future__ import annotations

import json
import shutil

import pytest

from pmlm_testing import run_module
from megatron_pmlm.data.samples import data_identity, read_metadata, samples_identity

COMMON = ["--preset", "tiny", "--micro-batch-size", "4", "--global-batch-size", "4", "--log-interval", "1",
          "--eval-iters", "0"]


def _build(corpus_prefix, output, *extra):
    result = run_module("data_prep.build_samples", "--data-path", str(corpus_prefix), "--output", str(output),
                        "--seq-length", "64", "--split", "95,5,0", "--mask-epochs", "2", "--no-progress", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


def _losses(stdout: str) -> list[str]:
    return [line.split("loss ")[1].split()[0] for line in stdout.splitlines()
            if line.startswith("iteration") and "loss " in line]


@pytest.fixture(scope="module")
def data(tmp_path_factory, pretraining_samples, bert_vocab):
    """The conftest samples (bert vocabulary, seed 7), the same text under a vocabulary of the same
    size with two tokens swapped, and the same corpus built with another seed."""
    root = tmp_path_factory.mktemp("identity")
    corpus = pretraining_samples.parent
    tokens = bert_vocab.read_text(encoding="utf-8").splitlines()
    tokens[2000], tokens[2001] = tokens[2001], tokens[2000]
    swapped_vocab = root / "swapped-vocab.txt"
    swapped_vocab.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    result = run_module("data_prep.preprocess", "--input", str(corpus / "wiki.txt"), "--output-prefix",
                        str(root / "wiki-swapped"), "--vocab-file", str(swapped_vocab), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    swapped = _build(root / "wiki-swapped", root / "swapped", "--seed", "7")
    other_seed = _build(corpus / "wiki", root / "seed8", "--seed", "8")
    moved = root / "moved" / "samples"
    shutil.copytree(pretraining_samples, moved)
    return {"root": root, "samples": pretraining_samples, "swapped": swapped, "other_seed": other_seed,
            "moved": moved}


@pytest.fixture(scope="module")
def checkpoint(data):
    """Two of four iterations on the conftest samples, saved (--exit-interval); the uninterrupted run's losses."""
    ckpt = data["root"] / "ckpt"
    result = run_module("megatron_pmlm.pretrain", *COMMON, "--data-path", str(data["samples"]), "--train-iters", "4",
                        "--exit-interval", "2", "--save", str(ckpt), "--save-interval", "100")
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_module("megatron_pmlm.pretrain", *COMMON, "--data-path", str(data["samples"]), "--train-iters", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    return ckpt, _losses(result.stdout)


def _resume(ckpt, samples, save, *extra):
    return run_module("megatron_pmlm.pretrain", *COMMON, "--data-path", str(samples), "--train-iters", "4",
                      "--load", str(ckpt), "--save", str(save), "--save-interval", "100", *extra)


def test_the_identity_is_recorded_at_build_and_saved_with_the_checkpoint(data, checkpoint):
    metadata = read_metadata(data["samples"])
    recorded = metadata["identity"]
    assert recorded["vocab_sha256"] == metadata["vocab_sha256"]
    assert len(recorded["corpora"][0]["idx_sha256"]) == 64
    assert recorded["build"]["seed"] == 7 and recorded["samples"]["train"] == metadata["splits"]["train"]["num_samples"]
    # A moved folder has the same identity; an older metadata.json (none recorded) gets one computed
    # from what it holds, the vocabulary included.
    assert data_identity(read_metadata(data["moved"])) == recorded
    older = {key: value for key, value in metadata.items() if key != "identity"}
    assert data_identity(older) == samples_identity(older)
    assert data_identity(older)["vocab_sha256"] == metadata["vocab_sha256"]
    assert data_identity(older)["digest"] != recorded["digest"]  # no .idx checksum in it
    saved = json.loads((checkpoint[0] / "iter_0000002" / "run_state.json").read_text())
    assert saved["args"]["data_identity"] == recorded


def test_another_vocabulary_is_refused_naming_both(data, checkpoint, tmp_path):
    ckpt, _ = checkpoint
    result = _resume(ckpt, data["swapped"], tmp_path / "s")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    before, after = (read_metadata(data[name])["vocab_sha256"] for name in ("samples", "swapped"))
    assert before != after
    assert (f"error: {ckpt / 'iter_0000002'} was trained on samples of another vocabulary: vocab sha256 {before} "
            f"({data['samples']}) -> {after} ({data['swapped']}); resume on samples built with the checkpoint's "
            "vocabulary\n") in result.stderr
    assert "Traceback" not in result.stderr and not list((tmp_path / "s").glob("iter_*"))
    # --allow-data-change is for a corpus change, not another vocabulary.
    result = _resume(ckpt, data["swapped"], tmp_path / "s", "--allow-data-change")
    assert result.returncode == 2 and "another vocabulary" in result.stderr, result.stderr[-2000:]


def test_other_samples_of_the_same_vocabulary_need_allow_data_change(data, checkpoint, tmp_path):
    ckpt, _ = checkpoint
    result = _resume(ckpt, data["other_seed"], tmp_path / "s")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert (f"error: {ckpt / 'iter_0000002'} was trained on other samples (data_path {data['samples']} -> "
            f"{data['other_seed']}: seed 7 -> 8") in result.stderr
    assert "add --allow-data-change to resume on them" in result.stderr
    assert "Traceback" not in result.stderr and not list((tmp_path / "s").glob("iter_*"))
    result = _resume(ckpt, data["other_seed"], tmp_path / "s", "--allow-data-change")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    changed = [line for line in result.stdout.splitlines() if line.startswith("resuming with changed settings")]
    assert len(changed) == 1 and "seed 7 -> 8" in changed[0] and "allowed by --allow-data-change" in changed[0], \
        result.stdout[-3000:]
    assert f"resumed from {ckpt / 'iter_0000002'}: iteration 2" in result.stdout


def test_a_moved_samples_folder_resumes_exactly(data, checkpoint, tmp_path):
    ckpt, uninterrupted = checkpoint
    result = _resume(ckpt, data["moved"], tmp_path / "s")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # The path is where the samples are, not what they are: not a changed setting.
    changed = [line for line in result.stdout.splitlines() if line.startswith("resuming with changed settings")]
    assert changed == ["resuming with changed settings: exit_interval 2 -> 0"], result.stdout[-3000:]
    assert "warning" not in result.stdout, result.stdout[-3000:]
    assert _losses(result.stdout) == uninterrupted[2:], (result.stdout[-3000:], uninterrupted)


def test_a_checkpoint_without_an_identity_resumes_with_a_warning(data, checkpoint, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(checkpoint[0], older)
    run_state = older / "iter_0000002" / "run_state.json"
    saved = json.loads(run_state.read_text())
    del saved["args"]["data_identity"]
    run_state.write_text(json.dumps(saved))
    result = _resume(older, data["other_seed"], older)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    warnings = [line for line in result.stdout.splitlines() if "records no identity" in line]
    assert warnings == [f"warning: {older / 'iter_0000002'} records no identity of its samples (saved before it "
                        f"was recorded): resuming on {data['other_seed']} without checking it is the same data"]
    assert f"resumed from {older / 'iter_0000002'}: iteration 2" in result.stdout


def test_finetune_takes_the_weights_whatever_the_data(data, checkpoint, tmp_path):
    ckpt, _ = checkpoint
    result = run_module("megatron_pmlm.pretrain", *COMMON, "--data-path", str(data["swapped"]), "--train-iters", "1",
                        "--load", str(ckpt), "--finetune", "--save", str(tmp_path / "f"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"loaded the weights of {ckpt / 'iter_0000002'}" in result.stdout
    assert "another vocabulary" not in result.stderr + result.stdout
