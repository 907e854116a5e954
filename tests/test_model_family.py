"""A model of the wrong family (PALM where a command takes PMLM/UniLM/BERT models, or the other way
round) is refused in one line naming what the path holds and which command takes it: exit status
2, no traceback, nothing written. The paths are small stand-ins: a PALM Hugging Face folder (a
real one, random weights) and checkpoint directories whose run_state.json names the family; every
command refuses them before reading any weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_pmlm.hf.family import PALM, PMLM, check_family, model_family

PALM_LINE = "is a PALM model (encoder-decoder); {tool} takes PMLM/UniLM/BERT models; PALM continues text with decode_palm"


def checkpoint_dir(root: Path, model: str | None) -> Path:
    """`latest` and a tag whose run_state.json records `pretrain --model` (absent: a PMLM run before the flag)."""
    folder = root / f"ckpt-{model}"
    (folder / "iter_0000002").mkdir(parents=True)
    (folder / "latest").write_text("iter_0000002")
    args = {"model_config": {}} if model is None else {"model": model, "model_config": {}}
    (folder / "iter_0000002" / "run_state.json").write_text(json.dumps({"iteration": 2, "consumed_samples": 16, "args": args}))
    return folder


@pytest.fixture(scope="module")
def palm_folder(tmp_path_factory, bert_vocab) -> Path:
    """A converted PALM folder: random palm-tiny weights, the real vocabulary."""
    from megatron_pmlm.hf.palm_adapter import unpadded, write_folder
    from megatron_pmlm.models.palm import PalmForPreTraining, palm_config_from_preset

    config = palm_config_from_preset("palm-tiny", vocab_size=30522, padded_vocab_size=30592)
    model = PalmForPreTraining(config, init_seed=3)
    folder = tmp_path_factory.mktemp("palm") / "hf"
    folder.mkdir()
    write_folder(folder, unpadded(model.state_dict(), config), config, bert_vocab, True, "bin")
    return folder


@pytest.fixture
def palm_checkpoint(tmp_path) -> Path:
    return checkpoint_dir(tmp_path, PALM)


def test_family_of_folders_and_checkpoints(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "palm"}))
    assert model_family(hf) == PALM
    (hf / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert model_family(hf) == PMLM
    assert model_family(checkpoint_dir(tmp_path, PALM)) == PALM
    assert model_family(checkpoint_dir(tmp_path, PMLM)) == PMLM
    assert model_family(checkpoint_dir(tmp_path, None)) == PMLM
    assert model_family(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match=f"--model {hf} is a PMLM/UniLM/BERT model .encoder only.; decode_palm takes "
                                         "PALM models; PMLM/UniLM/BERT models fine-tune with finetune_glue"):
        check_family("--model", hf, "decode_palm", takes=PALM)


def refused(code: int, err: str, message: str) -> None:
    assert code == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["folder", "checkpoint"])
def test_finetune_glue_and_squad_refuse_a_palm_model(kind, palm_folder, palm_checkpoint, tmp_path, capsys):
    pytest.importorskip("transformers")
    from megatron_pmlm import finetune_glue, finetune_squad

    model = palm_folder if kind == "folder" else palm_checkpoint
    rte = tmp_path / "RTE"
    rte.mkdir()
    for split in ("train", "dev"):
        (rte / f"{split}.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n")
    out = tmp_path / "out"
    code = finetune_glue.main(["--model", str(model), "--task", "rte", "--data-dir", str(rte), "--output-dir", str(out)])
    refused(code, capsys.readouterr().err, f"--model {model} " + PALM_LINE.format(tool="finetune_glue"))
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "a b", "qas": [
        {"id": "1", "question": "a?", "answers": [{"text": "a", "answer_start": 0}]}]}]}]}))
    code = finetune_squad.main(["--model", str(model), "--predict-file", str(squad), "--output-dir", str(out)])
    refused(code, capsys.readouterr().err, f"--model {model} " + PALM_LINE.format(tool="finetune_squad"))
    assert not out.exists()


def test_evaluate_downstream_refuses_a_palm_model(palm_folder, tmp_path, capsys):
    pytest.importorskip("transformers")
    from megatron_pmlm import evaluate_downstream

    rte = tmp_path / "glue" / "RTE"
    rte.mkdir(parents=True)
    for split in ("train", "dev"):
        (rte / f"{split}.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n")
    output = tmp_path / "eval" / "results.md"
    code = evaluate_downstream.main(["--model", str(palm_folder), "--tasks", "rte", "--data-dir",
                                     str(tmp_path / "glue"), "--output", str(output)])
    refused(code, capsys.readouterr().err, f"--model {palm_folder} " + PALM_LINE.format(tool="evaluate_downstream"))
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("kind", ["folder", "checkpoint"])
def test_finetune_s2s_refuses_a_palm_model(kind, palm_folder, palm_checkpoint, tmp_path, capsys):
    from megatron_pmlm import finetune_s2s

    model = palm_folder if kind == "folder" else palm_checkpoint
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("a source .\n")
    tgt.write_text("a target .\n")
    code = finetune_s2s.main(["--model", str(model), "--train-src", str(src), "--train-tgt", str(tgt), "--save",
                              str(tmp_path / "save")])
    refused(code, capsys.readouterr().err, f"--model {model} " + PALM_LINE.format(tool="finetune_s2s"))
    assert not (tmp_path / "save").exists()


def test_convert_from_hf_refuses_a_palm_folder(palm_folder, tmp_path, capsys):
    from megatron_pmlm.hf.convert import main

    code = main(["--from-hf", str(palm_folder), "--save", str(tmp_path / "save")], log=lambda message: None)
    refused(code, capsys.readouterr().err,
            f"--from-hf {palm_folder} " + PALM_LINE.format(tool="convert_checkpoint --from-hf"))
    assert not (tmp_path / "save").exists()


@pytest.mark.parametrize("saved, flags, message", [
    (PALM, [], "is a PALM model (encoder-decoder); pretrain --model pmlm takes PMLM/UniLM/BERT checkpoints; add "
               "--model palm to train PALM from it"),
    (PALM, ["--finetune"], "is a PALM model (encoder-decoder); pretrain --model pmlm takes"),
    (PMLM, ["--model", "palm"], "is a PMLM/UniLM/BERT model (encoder only); pretrain --model palm takes PALM "
                                "checkpoints"),
    (None, ["--model", "palm", "--finetune"], "is a PMLM/UniLM/BERT model (encoder only); pretrain --model palm"),
])
def test_pretrain_load_of_the_other_family(saved, flags, message, tmp_path, capsys):
    from megatron_pmlm import pretrain

    load = checkpoint_dir(tmp_path, saved)
    code = pretrain.main(["--data-path", str(tmp_path / "samples"), "--load", str(load), *flags,
                          "--train-iters", "1"])
    refused(code, capsys.readouterr().err, f"--load {load} {message}")


def test_decode_s2s_decodes_a_palm_model_as_decode_palm_does(palm_folder, tmp_path, capsys):
    """One decode command for both families: decode_s2s given a PALM folder runs decode_palm's
    decoding with PALM's defaults and PALM's options (--max-context-length); decode_palm stays."""
    from megatron_pmlm import decode_palm, decode_s2s

    contexts = tmp_path / "contexts.txt"
    contexts.write_text("the park also includes a long path .\nrobert is an english actor .\n")
    outputs, messages = [], []
    for module in (decode_palm, decode_s2s):
        output = tmp_path / f"{module.__name__}.txt"
        code = module.main(["--model", str(palm_folder), "--input", str(contexts), "--output", str(output),
                            "--beam-size", "2", "--max-target-length", "5", "--max-context-length", "12",
                            "--no-progress"])
        err = capsys.readouterr().err
        assert code == 0, err
        outputs.append(output.read_text())
        messages.append([line for line in err.splitlines() if line.startswith("model:")])
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 2
    assert messages[0] == messages[1] and "(PALM, 2 + 2 layers" in messages[0][0]
    assert "cut to 10 wordpieces" in messages[0][0]


def test_decode_options_of_the_other_family(palm_folder, tmp_path, capsys):
    from megatron_pmlm import decode_palm, decode_s2s

    contexts = tmp_path / "contexts.txt"
    contexts.write_text("a context .\n")
    out = tmp_path / "out.txt"
    common = ["--input", str(contexts), "--output", str(out), "--no-progress"]
    code = decode_s2s.main(["--model", str(palm_folder), *common, "--fp16"])
    refused(code, capsys.readouterr().err, f"--fp16 is for PMLM/UniLM/BERT models; --model {palm_folder} is a PALM "
                                           "model (encoder-decoder: --max-context-length sets its input length)")
    pmlm = checkpoint_dir(tmp_path, PMLM)
    code = decode_s2s.main(["--model", str(pmlm), *common, "--max-context-length", "50"])
    refused(code, capsys.readouterr().err, f"--max-context-length is for PALM models; --model {pmlm} is a "
                                           "PMLM/UniLM/BERT model (--max-seq-length sets its source + target length)")
    code = decode_palm.main(["--model", str(pmlm), *common])
    refused(code, capsys.readouterr().err, f"--model {pmlm} is a PMLM/UniLM/BERT model (encoder only); decode_palm "
                                           "takes PALM models; PMLM/UniLM/BERT models fine-tune with")
    assert not out.exists()
