"""One check of a model folder's vocabulary against its embedding (pretrained.vocabulary_problem),
used by finetune_s2s/decode_s2s (load_model) and by finetune_glue, finetune_squad and
evaluate_downstream (hf_trainer.check_model_path, and the conversion of a checkpoint): another size
is refused, and where the run recorded its vocabulary's sha256 (the samples' metadata.json), other
content of the same size too. Refused in one line before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from megatron_pmlm import evaluate_downstream, finetune_glue, finetune_squad  # noqa: E402
from megatron_pmlm.config import ConfigError  # noqa: E402
from megatron_pmlm.hf.pmlm_adapter import import_from_hf  # noqa: E402
from megatron_pmlm.pretrained import load_model  # noqa: E402


@pytest.fixture
def short_vocab_folder(tiny_hf_model, tmp_path) -> Path:
    """The tiny model's folder with a vocab.txt one entry short (its tokenizer.json removed)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_hf_model, folder)
    (folder / "tokenizer.json").unlink(missing_ok=True)
    lines = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
    (folder / "vocab.txt").write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
    return folder


def test_every_fine_tuning_command_refuses_a_vocabulary_of_another_size(short_vocab_folder, tmp_path, capsys):
    message = (f"--model {short_vocab_folder}: {short_vocab_folder / 'vocab.txt'} has 30521 entries but the model's "
               "embedding has 30522 rows: not this model's vocabulary")
    glue = tmp_path / "glue-data" / "MRPC"
    glue.mkdir(parents=True)
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    for split in ("train", "dev"):
        (glue / f"{split}.tsv").write_text(header + "1\t1\t2\tA cat.\tA cat.\n0\t3\t4\tA dog.\tA car.\n")
    squad = tmp_path / "dev.json"
    squad.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "a cat sat", "qas": [
        {"id": "q", "question": "what sat?", "answers": [{"text": "a cat", "answer_start": 0}]}]}]}]}))
    commands = {
        "finetune_glue": lambda out: finetune_glue.main(["--model", str(short_vocab_folder), "--task", "mrpc",
                                                          "--data-dir", str(glue.parent), "--output-dir", str(out)]),
        "finetune_squad": lambda out: finetune_squad.main(["--model", str(short_vocab_folder), "--predict-file",
                                                            str(squad), "--output-dir", str(out)]),
        "evaluate_downstream": lambda out: evaluate_downstream.main(
            ["--model", str(short_vocab_folder), "--tasks", "mrpc", "--data-dir", str(glue.parent), "--output",
             str(out / "results.md")]),
    }
    for name, command in commands.items():
        out = tmp_path / name
        code = command(out)
        err = capsys.readouterr().err
        assert code == 2 and err == f"error: {message}\n", (name, err)
        assert not out.exists(), name
    with pytest.raises(ConfigError, match="has 30521 entries but the model's embedding has 30522 rows"):
        load_model(short_vocab_folder)  # finetune_s2s and decode_s2s: the same check


@pytest.fixture
def checkpoint_with_recorded_vocab(tiny_hf_model, pretraining_samples, tmp_path) -> Path:
    """The tiny model as a checkpoint whose run names samples (their metadata.json records the
    vocabulary's sha256: the BERT vocabulary the model's vocab.txt is a copy of)."""
    save = tmp_path / "ckpt"
    import_from_hf(tiny_hf_model, save, log=lambda message: None)
    run_state_file = save / "iter_0000000" / "run_state.json"
    run_state = json.loads(run_state_file.read_text())
    run_state["args"]["data_path"] = str(pretraining_samples)
    run_state_file.write_text(json.dumps(run_state))
    assert json.loads((pretraining_samples / "metadata.json").read_text())["vocab_sha256"]
    return save


def test_same_size_other_content_is_refused_where_a_checksum_is_recorded(checkpoint_with_recorded_vocab, tmp_path,
                                                                         capsys):
    save = checkpoint_with_recorded_vocab
    assert load_model(save).vocabulary.tokens  # the recorded vocabulary: accepted
    vocab = save / "iter_0000000" / "vocab.txt"
    lines = vocab.read_text(encoding="utf-8").splitlines()
    lines[2000], lines[2001] = lines[2001], lines[2000]  # same size, two ids swapped
    vocab.write_text("\n".join(lines) + "\n", encoding="utf-8")
    # (the manifest's checksum of vocab.txt catches it first; --no-checksums gets to the vocabulary check)
    with pytest.raises(ConfigError, match=r"is not the vocabulary the model was trained with \(same size, other "
                                          r"content: sha256 [0-9a-f]{12}\.\.\., recorded [0-9a-f]{12}\.\.\.\)"):
        load_model(save, checksums=False)
    # finetune_glue / finetune_squad / evaluate_downstream convert the checkpoint first: the same check.
    from megatron_pmlm.hf.convert import export_to_hf
    from megatron_pmlm.training.checkpoint_reader import ConversionError

    with pytest.raises(ConversionError, match=f"vocabulary {vocab} is not the vocabulary the model was trained with"):
        export_to_hf(save, tmp_path / "hf", log=lambda message: None, checksums=False)
    assert not (tmp_path / "hf").exists()
