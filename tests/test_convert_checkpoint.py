"""tools/convert_checkpoint.py: checkpoints of every layout -> Hugging Face folders, verified on held-out
samples; Hugging Face -> a checkpoint pre-training starts from; bad input refused with a clear message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pmlm_testing import run_module, run_tool

transformers = pytest.importorskip("transformers")

from megatron_pmlm.config import ModelConfig  # noqa: E402
from megatron_pmlm.files import OUTPUT_MARKER  # noqa: E402
from megatron_pmlm.hf import pmlm_adapter  # noqa: E402
from megatron_pmlm.hf.convert import main  # noqa: E402
from megatron_pmlm.models.model import PMLMForPreTraining, relative_position_bucket  # noqa: E402
from megatron_pmlm.training.checkpoint_reader import load_pretraining_checkpoint  # noqa: E402

# lr 1e-4 and one step: Adam moves every weight by at most ~lr, so every layout's converted
# weights must agree with ZeRO-0's within 2 x lr, while a wrongly merged or renumbered tensor
# (a different random draw of std 0.02) would be off by far more.
TINY = ["--preset", "tiny", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-4",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
        "--train-iters", "1"]
LAYOUTS = {
    "zero0": ([], 1),
    "zero0-no-rel-pos": (["--no-rel-pos"], 1),
    "zero3": (["--zero-stage", "3"], 2),  # + a DeepSpeed config partitioning every parameter (below)
    "tp2": (["--tensor-model-parallel-size", "2"], 2),
    "pp2": (["--pipeline-model-parallel-size", "2"], 2),
}
SPEC_HEAD_KEYS = {"cls.predictions.bias", "cls.predictions.transform.dense.weight",
                  "cls.predictions.transform.dense.bias", "cls.predictions.transform.LayerNorm.weight",
                  "cls.predictions.transform.LayerNorm.bias"}


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def trained(pretraining_samples, workdir):
    """name -> the --save directory of a 1-iteration tiny run in that layout (trained on first use)."""
    cache: dict[str, Path] = {}
    zero3_config = workdir / "zero3.json"
    zero3_config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                        "zero_allow_untested_optimizer": True}))

    def get(name: str) -> Path:
        if name not in cache:
            extra, nproc = LAYOUTS[name]
            if name == "zero3":
                extra = extra + ["--deepspeed-config", str(zero3_config)]
            save = workdir / f"ckpt-{name}"
            result = run_module("megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY, *extra,
                                "--save", str(save), nproc=nproc)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            assert (save / "latest").read_text() == "iter_0000001"
            cache[name] = save
        return cache[name]
    return get


@pytest.fixture(scope="module")
def converted(trained, workdir):
    """name -> (Hugging Face folder, log lines) of `convert --verify` on that layout's checkpoint."""
    cache: dict[str, tuple[Path, list[str]]] = {}

    def get(name: str) -> tuple[Path, list[str]]:
        if name not in cache:
            out, lines = workdir / f"hf-{name}", Lines()
            assert main(["--load", str(trained(name)), "--output", str(out), "--verify"], log=lines) == 0, lines
            cache[name] = (out, lines)
        return cache[name]
    return get


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return pmlm_adapter.read_hf_weights(folder)


def _verify_figures(lines: list[str]) -> tuple[float, float, float]:
    line = next(line for line in lines if line.startswith("verify:"))
    difference = float(line.split("max |logit difference| ")[1].split()[0])
    ours = float(line.split("ours ")[1].split(",")[0])
    hf = float(line.split("Hugging Face ")[1].split()[0])
    return difference, ours, hf


@pytest.mark.parametrize("layout", ["zero0", "zero3", "tp2", "pp2"])
def test_every_layout_converts_to_a_verified_hugging_face_folder(layout, converted, trained):
    out, lines = converted(layout)
    difference, loss_ours, loss_hf = _verify_figures(lines)
    assert difference <= 1e-4 and abs(loss_ours - loss_hf) <= 1e-4, lines
    assert 5.0 < loss_ours < 15.0  # an untrained-ish model over a 30,522-token vocabulary: ~log(30522)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "pmlm" and config["architectures"] == ["PMLMForMaskedLM"]
    assert (config["rel_pos_bins"], config["max_rel_pos"]) == (32, 128)
    assert config["auto_map"]["AutoModelForMaskedLM"] == "modeling_pmlm.PMLMForMaskedLM"
    assert (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"]) == (30522, 2, 64)
    weights = _weights(out)
    # SPEC §10 names; padding rows gone; the tied softmax not stored; one stack of layers.
    assert SPEC_HEAD_KEYS <= set(weights) and not any("decoder" in k or "_extra_state" in k for k in weights)
    assert weights["bert.embeddings.word_embeddings.weight"].shape == (30522, 64)
    assert weights["cls.predictions.bias"].shape == (30522,)
    assert weights["bert.rel_pos_bias.weight"].shape == (4, 32)
    assert {k.split(".")[3] for k in weights if k.startswith("bert.encoder.layer.")} == {"0", "1"}
    # Every layout trained the same model (same seed, same data): the merged, consolidated and
    # renumbered weights agree with the single-process checkpoint's.
    reference = _weights(converted("zero0")[0])
    assert set(weights) == set(reference)
    for name in reference:
        assert torch.allclose(weights[name], reference[name], rtol=0, atol=3e-4), name
    tokenizer = transformers.BertTokenizer.from_pretrained(str(out))
    assert tokenizer.tokenize("The Tower of London") == ["the", "tower", "of", "london"]


def test_the_remote_code_model_computes_our_logits_and_needs_its_bias(converted, trained, pretraining_samples):
    out, _ = converted("zero0")
    checkpoint = load_pretraining_checkpoint(trained("zero0"))
    ours = PMLMForPreTraining(checkpoint.model_config, "ae").eval()
    ours.load_state_dict(torch.load(trained("zero0") / "iter_0000001" / "mp_rank_00_model_states.pt",
                                    weights_only=False)["module"])
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True).eval()
    assert type(hf).__name__ == "PMLMForMaskedLM"
    tokenizer = transformers.BertTokenizer.from_pretrained(str(out))
    texts = ["the album was released in [MASK] and reached number one .", "he was born in 1867 ."]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    ids, types, keep = encoded["input_ids"], encoded["token_type_ids"], encoded["attention_mask"].bool()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    roles = torch.where(keep, 0, 4)  # context tokens; padding
    plain = transformers.BertForMaskedLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        # After one step the table is still near its N(0, 0.02) start: scale it (in both models) so
        # that it visibly shapes the attention.
        ours.bert.rel_pos_bias.weight.mul_(100)
        hf.bert.rel_pos_bias.weight.mul_(100)
        expected = ours.mlm_logits(ours.bert(ids, positions, types, roles, torch.zeros_like(ids)))[..., :30522]
        logits = hf(**encoded).logits
        plain_logits = plain(**encoded).logits
    assert (logits - expected)[keep].abs().max() < 1e-4
    # Without the relative position bias (plain BERT reading the same folder) the logits move:
    # the remote code is what makes them equal.
    assert (plain_logits - expected)[keep].abs().max() > 1e-2
    # The remote code's buckets are ours (key - query distance, T5 bidirectional, 32 bins, 128).
    from megatron_pmlm.hf.modeling_pmlm import relative_position_bucket as hf_bucket

    distances = torch.arange(-700, 700)
    assert torch.equal(hf_bucket(distances, 32, 128), relative_position_bucket(distances, 32, 128))


def test_a_no_rel_pos_checkpoint_loads_into_plain_bert(converted):
    out, lines = converted("zero0-no-rel-pos")
    difference, loss_ours, loss_hf = _verify_figures(lines)
    assert difference <= 1e-4 and abs(loss_ours - loss_hf) <= 1e-4
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bert" and "auto_map" not in config and "rel_pos_bins" not in config
    assert not (out / "modeling_pmlm.py").exists()
    model, info = transformers.BertForMaskedLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    auto = transformers.AutoModelForMaskedLM.from_pretrained(str(out))  # no remote code
    assert type(auto) is transformers.BertForMaskedLM
    assert torch.equal(auto.cls.predictions.decoder.weight, auto.bert.embeddings.word_embeddings.weight)


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_hugging_face_to_ours_to_hugging_face_is_identical(tp, converted, workdir):
    source, _ = converted("zero0")
    save, back = workdir / f"imported-tp{tp}", workdir / f"hf-again-tp{tp}"
    lines = Lines()
    assert main(["--from-hf", str(source), "--save", str(save), "--tensor-model-parallel-size", str(tp)],
                log=lines) == 0, lines
    assert (save / "latest").read_text() == "iter_0000000"
    assert sorted(p.name for p in (save / "iter_0000000").glob("mp_rank_*")) == \
        [f"mp_rank_{r:02d}_model_states.pt" for r in range(tp)]
    run_state = json.loads((save / "iter_0000000" / "run_state.json").read_text())
    assert run_state["args"]["model_config"]["padded_vocab_size"] == (30592 if tp == 1 else 30720)
    assert main(["--load", str(save), "--output", str(back)], log=Lines()) == 0
    original, again = _weights(source), _weights(back)
    assert set(original) == set(again)
    assert all(torch.equal(original[k], again[k]) for k in original)
    for name in ("config.json", "vocab.txt", "tokenizer_config.json", "modeling_pmlm.py", "configuration_pmlm.py"):
        assert (source / name).read_bytes() == (back / name).read_bytes(), name


def test_pretraining_starts_from_an_imported_checkpoint(converted, workdir, pretraining_samples):
    """--from-hf output + `pretrain --load --finetune`: the run trains from those weights (a learning
    rate of 1e-12 leaves them in place), not from its own initialisation (seed 99)."""
    source, _ = converted("zero0")
    save, run = workdir / "imported-for-run", workdir / "run-from-import"
    assert main(["--from-hf", str(source), "--save", str(save)], log=Lines()) == 0
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY, "--lr", "1e-12",
                        "--seed", "99", "--load", str(save), "--finetune", "--save", str(run))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "loaded the weights of" in result.stdout
    assert "saved by an older version" not in result.stdout  # the import has a manifest with checksums
    assert (run / "latest").read_text() == "iter_0000001"  # the iteration count started afresh
    out = workdir / "hf-from-run"
    assert main(["--load", str(run), "--output", str(out), "--vocab-file", str(source / "vocab.txt")],
                log=Lines()) == 0
    original, trained = _weights(source), _weights(out)
    assert max(float((original[k] - trained[k]).abs().max()) for k in original) < 1e-6
    fresh = PMLMForPreTraining(ModelConfig(**json.loads((save / "iter_0000000" / "run_state.json").read_text())
                                           ["args"]["model_config"]), init_seed=99).state_dict()
    assert float((fresh["bert.encoder.layer.0.attention.self.query.weight"]
                  - original["bert.encoder.layer.0.attention.self.query.weight"]).abs().max()) > 1e-2


def test_a_plain_bert_checkpoint_imports_with_a_zero_relative_position_bias(workdir, bert_vocab):
    """What a run starting from BERT does: transformers' BertForMaskedLM -> our model, same logits."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=128)
    bert = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        bert.cls.predictions.bias.normal_()  # so a dropped output bias would show
    folder = workdir / "plain-bert"
    bert.save_pretrained(str(folder))
    shutil.copyfile(bert_vocab, folder / "vocab.txt")
    save = workdir / "plain-bert-imported"
    lines = Lines()
    assert main(["--from-hf", str(folder), "--save", str(save), "--add-rel-pos"], log=lines) == 0, lines
    checkpoint = load_pretraining_checkpoint(save)
    assert checkpoint.model_config.rel_pos and checkpoint.model_config.padded_vocab_size == 30592
    ours = PMLMForPreTraining(checkpoint.model_config).eval()
    ours.load_state_dict(checkpoint.state_dict)
    ids = torch.randint(5, 30522, (2, 20))
    types = torch.zeros_like(ids)
    with torch.no_grad():
        expected = bert(input_ids=ids, token_type_ids=types).logits
        logits = ours.mlm_logits(ours.bert(ids, torch.arange(20).expand_as(ids), types, torch.zeros_like(ids),
                                           torch.zeros_like(ids)))[..., :30522]
    assert (logits - expected).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------ bad input

def _fails(argv: list[str], capsys, code: int = 2) -> str:
    assert main(argv, log=Lines()) == code
    return capsys.readouterr().err


def _copy_without(source: Path, destination: Path, *skip: str) -> Path:
    shutil.copytree(source, destination, ignore=lambda _d, names: [n for n in names if n in skip])
    return destination


def test_bad_checkpoints_are_refused_naming_what_is_missing(trained, tmp_path, capsys):
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    assert "no checkpoint in" in _fails(["--load", str(tmp_path / "empty"), "--output", str(out)], capsys)
    err = _fails(["--load", str(trained("zero0")), "--tag", "iter_0000099", "--output", str(out)], capsys)
    assert "iter_0000099" in err and "does not exist" in err and "iter_0000001" in err
    tp2 = _copy_without(trained("tp2"), tmp_path / "tp2", "mp_rank_01_model_states.pt")
    # The manifest names a missing file first (checkpoint_reader.resolve_tag); past it
    # (--no-checksums), each layout's reader names what it lacks.
    err = _fails(["--load", str(tp2), "--output", str(out)], capsys)
    assert f"{tp2 / 'iter_0000001'}: mp_rank_01_model_states.pt is missing" in err
    err = _fails(["--load", str(tp2), "--output", str(out), "--no-checksums"], capsys)
    assert "tensor-parallel rank(s) 1 of 2 missing" in err and "mp_rank_01_model_states.pt" in err
    pp2 = _copy_without(trained("pp2"), tmp_path / "pp2", "layer_03-model_00-model_states.pt")
    assert "layer_03 of tensor-parallel rank 0 is missing" in _fails(["--load", str(pp2), "--output", str(out),
                                                                      "--no-checksums"], capsys)
    zero3 = _copy_without(trained("zero3"), tmp_path / "zero3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    err = _fails(["--load", str(zero3), "--output", str(out), "--no-checksums"], capsys)
    assert "could not consolidate the ZeRO partitions" in err and "optim_states" in err
    # A checkpoint of another model: run_state.json describes 3 layers, the weights hold 2.
    other = _copy_without(trained("zero0"), tmp_path / "other")
    run_state_file = other / "iter_0000001" / "run_state.json"
    run_state = json.loads(run_state_file.read_text())
    run_state["args"]["model_config"]["num_layers"] = 3
    run_state_file.write_text(json.dumps(run_state))
    err = _fails(["--load", str(other), "--output", str(out)], capsys)
    assert "another model" in err and "bert.encoder.layer.2.attention.self.query.weight" in err
    run_state_file.write_bytes(b"\xff\xfe{ not text, not JSON")
    assert "run_state.json is unreadable" in _fails(["--load", str(other), "--output", str(out)], capsys)
    assert f"{run_state_file} is not valid JSON" in _fails(["--load", str(other), "--output", str(out),
                                                            "--no-checksums"], capsys)
    (other / "iter_0000001" / "run_state.json").unlink()
    assert "run_state.json is missing (the save did not finish)" in _fails(["--load", str(other), "--output",
                                                                            str(out)], capsys)
    assert "not a megatron-pmlm checkpoint" in _fails(["--load", str(other), "--output", str(out), "--no-checksums"],
                                                      capsys)
    # Nothing was written, not even a partial folder.
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_bad_input_exits_2_with_a_message_and_no_traceback(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "roberta", "vocab_size": 10}))
    result = run_module("megatron_pmlm.hf.convert", "--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "s"))
    assert result.returncode == 2 and "model_type 'roberta'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "s").exists()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "bert",')
    result = run_module("megatron_pmlm.hf.convert", "--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "s"))
    assert result.returncode == 2 and f"{tmp_path / 'hf' / 'config.json'} is not valid JSON" in result.stderr, \
        result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "s").exists()
    result = run_tool("convert_checkpoint.py", "--load", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o"),
                      timeout=120)
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_an_existing_output_is_kept_unless_overwrite(converted, trained, tmp_path, capsys):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "already exists" in _fails(["--load", str(trained("zero0")), "--output", str(out)], capsys)
    assert (out / "keep.txt").read_text() == "mine"
    # Refused before the checkpoint is read: even a load directory that does not exist gets this answer.
    assert "--output " + str(out) + " already exists" in _fails(["--load", str(tmp_path / "nowhere"), "--output",
                                                                 str(out)], capsys)
    # --overwrite replaces only a folder this project wrote (it holds the marker): not this one.
    assert "not written by this project" in _fails(["--load", str(trained("zero0")), "--output", str(out),
                                                    "--overwrite"], capsys)
    assert (out / "keep.txt").read_text() == "mine"
    ours = tmp_path / "ours"
    assert main(["--load", str(trained("zero0")), "--output", str(ours)], log=Lines()) == 0
    assert (ours / OUTPUT_MARKER).is_file()
    (ours / "stale.txt").write_text("from an earlier export")
    assert main(["--load", str(trained("zero0")), "--output", str(ours), "--overwrite"], log=Lines()) == 0
    assert not (ours / "stale.txt").exists() and (ours / "config.json").is_file()


def test_a_failed_verification_exits_1_and_writes_nothing(trained, tmp_path, capsys, monkeypatch):
    """--verify compares real outputs: a converter that corrupted one weight is caught."""
    original = pmlm_adapter.to_hf_state_dict

    def corrupted(state, config):
        out = original(state, config)
        out["cls.predictions.bias"][1000] += 1e-3  # one logit of one token off by 1e-3
        return out

    monkeypatch.setattr(pmlm_adapter, "to_hf_state_dict", corrupted)
    out = tmp_path / "out"
    err = _fails(["--load", str(trained("zero0")), "--output", str(out), "--verify"], capsys, code=1)
    assert "verification failed" in err and "FAILED" in err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_a_one_document_corpus_warns_of_its_empty_splits_and_verify_uses_training_samples(
        trained, shared_data, bert_vocab, tmp_path):
    """botchan.txt has no blank line: one document, all of it training. build_samples names the empty
    splits and why; --verify then compares on training samples, saying so in one line."""
    book = shared_data / "corpus" / "botchan.txt"
    if not book.is_file():
        pytest.skip(f"{book} is absent")
    lines = book.read_text(encoding="utf-8")[:20_000].splitlines(keepends=True)[:-1]
    (tmp_path / "botchan.txt").write_text("".join(lines), encoding="utf-8")
    result = run_module("data_prep.preprocess", "--input", str(tmp_path / "botchan.txt"), "--output-prefix",
                        str(tmp_path / "book"), "--vocab-file", str(bert_vocab), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_module("data_prep.build_samples", "--data-path", str(tmp_path / "book"), "--output",
                        str(tmp_path / "samples"), "--seq-length", "64", "--mask-epochs", "1", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, result.stderr
    assert warnings[0].startswith("warning: the valid split is empty: too few documents for --split 949,50,1: "
                                  "it takes whole documents, and 1 document(s) give the valid split's 5.0% share none")
    assert "the test split is empty" in warnings[1]

    out, log = tmp_path / "hf", Lines()
    assert main(["--load", str(trained("zero0")), "--output", str(out), "--verify", "--data-path",
                 str(tmp_path / "samples")], log=log) == 0, log
    notes = [line for line in log if line.startswith("note:")]
    assert notes == [f"note: {tmp_path / 'samples'} has no held-out split (its valid and test splits are empty): "
                     "--verify compares on training samples, which checks the conversion just as well"], log
    assert any(line.startswith("verify: ") and "training samples (train split" in line and line.endswith("-> OK")
               for line in log), log
