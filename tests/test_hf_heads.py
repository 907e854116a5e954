"""A converted PMLM folder under every Hugging Face Auto class used for fine-tuning (remote code with
the relative position bias in every layer), its fast tokenizer, and the plain-BERT pitfall.

A tiny random model (`model_config_from_preset("tiny")`) written with `pmlm_adapter.write_hf_folder`:
no pre-training run, no download; seconds per test."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_pmlm.config import model_config_from_preset  # noqa: E402
from megatron_pmlm.hf import pmlm_adapter  # noqa: E402
from megatron_pmlm.models.layout import CONTEXT  # noqa: E402
from megatron_pmlm.models.model import PMLMForPreTraining  # noqa: E402
from megatron_pmlm.tokenizer import WordPieceTokenizer  # noqa: E402

VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[P]", "Hello", "hello", "world", "the", "tower", "of",
          "london", "##s", ".", ",", "[", "]", "p"] + [f"w{i}" for i in range(80)])
# Auto class -> (class it must give, the weights a converted folder lacks: new, reported missing)
HEADS = {
    "AutoModelForPreTraining": ("PMLMForPreTraining", {"bert.pooler.dense.weight", "bert.pooler.dense.bias",
                                                       "cls.seq_relationship.weight", "cls.seq_relationship.bias"}),
    "AutoModelForSequenceClassification": ("PMLMForSequenceClassification", {
        "bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"}),
    "AutoModelForQuestionAnswering": ("PMLMForQuestionAnswering", {"qa_outputs.weight", "qa_outputs.bias"}),
    "AutoModelForTokenClassification": ("PMLMForTokenClassification", {"classifier.weight", "classifier.bias"}),
    "AutoModelForMultipleChoice": ("PMLMForMultipleChoice", {
        "bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"}),
    "AutoModelForMaskedLM": ("PMLMForMaskedLM", set()),
}
ALL_AUTO = {"AutoModel": ("PMLMBertModel", None), **HEADS}


def write_vocab(path: Path, tokens: list[str] = VOCAB) -> Path:
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path


def write_tiny_folder(folder: Path, vocab_file: Path, do_lower_case: bool = True, seed: int = 0):
    """A random tiny PMLM (its bias table scaled up so that it shapes the attention) as a converted folder."""
    config = model_config_from_preset("tiny", vocab_size=len(pmlm_adapter.read_vocab(vocab_file)))
    ours = PMLMForPreTraining(config, init_seed=seed).eval()
    with torch.no_grad():
        ours.bert.rel_pos_bias.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    pmlm_adapter.write_hf_folder(folder, pmlm_adapter.to_hf_state_dict(ours.state_dict(), config), config, vocab_file,
                            do_lower_case)
    return ours, config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, our model, its config) of a random tiny PMLM with [P] in its (lower-cased) vocabulary."""
    directory = tmp_path_factory.mktemp("hf-heads")
    folder = directory / "hf"
    ours, config = write_tiny_folder(folder, write_vocab(directory / "vocab.txt"))
    return folder, ours, config


def load(auto: str, folder: Path, **kwargs):
    model, info = getattr(transformers, auto).from_pretrained(str(folder), trust_remote_code=True,
                                                              output_loading_info=True, **kwargs)
    return model.eval(), info


def example_inputs(config, auto: str = "", batch: int = 2, length: int = 12, padded: bool = True) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, config.vocab_size, (batch, length), generator=generator)
    ids[:, 0], ids[:, -1] = 2, 3
    types = torch.zeros_like(ids)
    types[:, length // 2:] = 1
    mask = torch.ones_like(ids)
    if padded:
        ids[-1, length - 3:], mask[-1, length - 3:] = 0, 0
    inputs = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    if auto == "AutoModelForMultipleChoice":  # [batch, choices, length]
        inputs = {k: torch.stack([v, v.flip(0)], dim=1) for k, v in inputs.items()}
    return inputs


def main_output(output) -> torch.Tensor:
    for name in ("last_hidden_state", "logits", "prediction_logits", "start_logits"):
        if getattr(output, name, None) is not None:
            return getattr(output, name)
    raise AssertionError(f"no output tensor in {type(output).__name__}")


def test_config_maps_every_auto_class_to_the_remote_code(tiny):
    folder, _, _ = tiny
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["PMLMForMaskedLM"] and config["model_type"] == "pmlm"
    assert config["auto_map"] == {"AutoConfig": "configuration_pmlm.PMLMConfig",
                                  **{auto: f"modeling_pmlm.{name}" for auto, (name, _) in ALL_AUTO.items()}}
    assert (folder / "modeling_pmlm.py").is_file() and (folder / "configuration_pmlm.py").is_file()


@pytest.mark.parametrize("auto", sorted(ALL_AUTO))
def test_every_auto_class_loads_with_only_its_new_head_missing(auto, tiny):
    folder, _, config = tiny
    model, info = load(auto, folder)
    name, new = ALL_AUTO[auto]
    assert type(model).__name__ == name
    assert type(model.get_submodule("bert") if auto != "AutoModel" else model).__name__ == "PMLMBertModel"
    if auto == "AutoModel":  # as BertModel from a BERT checkpoint: the pooler new, the unused MLM head not reported
        assert set(info["missing_keys"]) == {"pooler.dense.weight", "pooler.dense.bias"}
    else:
        assert set(info["missing_keys"]) == new, info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # transformers' own module names (what HF examples, Trainer and PEFT target).
    state = model.state_dict()
    prefix = "" if auto == "AutoModel" else "bert."
    assert f"{prefix}rel_pos_bias.weight" in state
    assert {f"{prefix}encoder.layer.{i}.attention.self.query.weight" for i in range(config.num_layers)} <= set(state)
    with torch.no_grad():
        output = model(**example_inputs(config, auto))
    expected_shape = {
        "AutoModel": (2, 12, config.hidden_size), "AutoModelForMaskedLM": (2, 12, config.vocab_size),
        "AutoModelForPreTraining": (2, 12, config.vocab_size), "AutoModelForSequenceClassification": (2, 2),
        "AutoModelForQuestionAnswering": (2, 12), "AutoModelForTokenClassification": (2, 12, 2),
        "AutoModelForMultipleChoice": (2, 2)}[auto]
    assert main_output(output).shape == expected_shape


def test_auto_model_computes_our_hidden_states(tiny):
    folder, ours, config = tiny
    model, _ = load("AutoModel", folder)
    inputs = example_inputs(config, padded=False)
    ids, types = inputs["input_ids"], inputs["token_type_ids"]
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    roles = torch.full_like(ids, CONTEXT)
    with torch.no_grad():
        expected = ours.bert(ids, positions, types, roles, torch.zeros_like(ids))
        hidden = model(**inputs).last_hidden_state
        # The masked LM and the pre-training heads give our logits.
        logits = load("AutoModelForMaskedLM", folder)[0](**inputs).logits
        pretraining = load("AutoModelForPreTraining", folder)[0](**inputs)
        expected_logits = ours.mlm_logits(expected)
    assert (hidden - expected).abs().max() < 1e-5
    assert (logits - expected_logits).abs().max() < 1e-4
    assert torch.allclose(pretraining.prediction_logits, logits, rtol=0, atol=1e-5)
    assert pretraining.seq_relationship_logits.shape == (2, 2)


@pytest.mark.parametrize("auto", sorted(ALL_AUTO))
def test_every_head_applies_the_relative_position_bias(auto, tiny):
    folder, _, config = tiny
    model, info = load(auto, folder)
    inputs = example_inputs(config, auto)
    weight = model.get_parameter("rel_pos_bias.weight" if auto == "AutoModel" else "bert.rel_pos_bias.weight")
    with torch.no_grad():
        for name in info["missing_keys"]:  # new heads start at N(0, 0.02): make them pass changes on visibly
            model.get_parameter(name).normal_(0.0, 1.0)
        before = main_output(model(**inputs)).clone()
        weight.add_(torch.randn_like(weight))
        after = main_output(model(**inputs))
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("auto", sorted(ALL_AUTO))
def test_save_pretrained_and_reload_give_identical_outputs(auto, tiny, tmp_path):
    folder, _, config = tiny
    model, _ = load(auto, folder)
    inputs = example_inputs(config, auto)
    with torch.no_grad():
        expected = main_output(model(**inputs))
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / "modeling_pmlm.py").is_file() and (tmp_path / "configuration_pmlm.py").is_file()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == json.loads((folder / "config.json").read_text())["auto_map"]
    again, info = load(auto, tmp_path)
    assert type(again).__name__ == type(model).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.equal(main_output(again(**inputs)), expected)


def test_run_glue_style_loading_with_a_config_and_labels(tiny):
    """What run_glue.py does with --model_name_or_path DIR --trust_remote_code."""
    folder, _, config = tiny
    hf_config = transformers.AutoConfig.from_pretrained(str(folder), num_labels=3, finetuning_task="mnli",
                                                        trust_remote_code=True)
    assert type(hf_config).__name__ == "PMLMConfig" and hf_config.rel_pos_bins == config.rel_pos_bins
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder), config=hf_config,
                                                                            trust_remote_code=True)
    output = model(**example_inputs(config), labels=torch.tensor([0, 2]))
    assert output.logits.shape == (2, 3) and output.loss.ndim == 0


def test_gradient_checkpointing_gives_the_same_gradients(tiny):
    folder, _, config = tiny
    inputs = example_inputs(config)
    labels = torch.tensor([1, 0])
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same new classifier both times
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(folder), trust_remote_code=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model.train()
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # transformers 5.x: deprecated alias, still supported
                model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
            assert all(layer.gradient_checkpointing for layer in model.bert.encoder.layer)
        model(**inputs, labels=labels).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    plain, checkpointed = grads
    assert set(plain) == set(checkpointed) and "bert.rel_pos_bias.weight" in plain
    assert plain["bert.rel_pos_bias.weight"].abs().max() > 0
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], rtol=1e-4, atol=1e-6), name


def test_auto_tokenizer_is_fast_keeps_p_whole_and_lower_cases_as_trained(tiny, tmp_path):
    folder, _, _ = tiny
    assert {"vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= \
        {p.name for p in folder.iterdir()}
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "BertTokenizer" and tokenizer_config["do_lower_case"] is True
    assert (folder / "vocab.txt").read_text() == "\n".join(VOCAB) + "\n"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))  # no remote code, no prompt
    assert tokenizer.is_fast and isinstance(tokenizer, transformers.BertTokenizerFast)
    assert tokenizer.tokenize("Hello [P] world") == ["hello", "[P]", "world"]
    assert tokenizer.tokenize("hello[P]world.") == ["hello", "[P]", "world", "."]
    assert "[P]" in tokenizer.all_special_tokens
    p_id = VOCAB.index("[P]")
    encoded = tokenizer("Hello [P] world", "the tower")
    assert encoded["input_ids"] == [2, 7, p_id, 8, 3, 9, 10, 3]
    assert encoded["token_type_ids"] == [0, 0, 0, 0, 0, 1, 1, 1]
    assert tokenizer.decode(encoded["input_ids"], skip_special_tokens=True) == "hello world the tower"
    # Cased: as trained, "Hello" stays "Hello".
    cased = tmp_path / "cased"
    write_tiny_folder(cased, write_vocab(tmp_path / "vocab.txt"), do_lower_case=False)
    assert json.loads((cased / "tokenizer_config.json").read_text())["do_lower_case"] is False
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(cased))
    assert tokenizer.tokenize("Hello [P] world") == ["Hello", "[P]", "world"]
    # The slow fallback (what vocab.txt alone gives) agrees.
    (cased / "tokenizer.json").unlink()
    assert transformers.AutoTokenizer.from_pretrained(str(cased)).tokenize("Hello [P] world") == \
        ["Hello", "[P]", "world"]


def test_real_bert_vocabulary_tokenizes_as_our_data_pipeline(bert_vocab, tmp_path):
    """A stock BERT vocabulary has no [P] (s2s-ft uses [MASK]): nothing extra is registered."""
    write_tiny_folder(tmp_path / "hf", bert_vocab)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer.is_fast and tokenizer.vocab_size == 30522
    assert "[P]" not in tokenizer.all_special_tokens
    assert "additional_special_tokens" not in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    texts = ["The Tower of London, built in 1078 by William the Conqueror.", "Ünïcödé naïve café [MASK] x"]
    ours = WordPieceTokenizer(bert_vocab)
    for text, expected in zip(texts, ours.encode_batch(texts)):
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == expected.tolist()


def test_plain_bert_class_drops_the_bias_and_says_so(tiny):
    """The pitfall docs/conversion.md warns about: BertForSequenceClassification loads the folder but not the
    bias (a different model from the one pre-trained); only the load report tells."""
    folder, _, config = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, info = transformers.BertForSequenceClassification.from_pretrained(str(folder),
                                                                                 output_loading_info=True)
    assert "bert.rel_pos_bias.weight" in info["unexpected_keys"]
    assert not hasattr(plain.bert, "rel_pos_bias")
    assert getattr(plain.config, "rel_pos_bins", None) == config.rel_pos_bins  # the other tell-tale
    torch.manual_seed(0)
    ours, _ = load("AutoModelForSequenceClassification", folder)
    plain.load_state_dict(ours.state_dict(), strict=False)  # same weights except the bias
    inputs = example_inputs(config)
    with torch.no_grad():
        assert (plain.eval()(**inputs).logits - ours(**inputs).logits).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------------
# What a load reports (issue 24, item 2) and folders written by save_pretrained (item 1)
# ------------------------------------------------------------------------------------------------

class LogLines(logging.Handler):
    """transformers' log records (its load reports and warnings), as text."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


@pytest.mark.parametrize("auto,kwargs,new", [
    ("AutoModel", {}, {"pooler.dense.weight", "pooler.dense.bias"}),
    ("AutoModelForSequenceClassification", {"num_labels": 3}, HEADS["AutoModelForSequenceClassification"][1]),
    ("AutoModelForQuestionAnswering", {}, HEADS["AutoModelForQuestionAnswering"][1]),
])
def test_export_load_report_lists_only_new_weights(auto, kwargs, new, tiny):
    """The export carries no 2-label id2label (num_labels=3 is not 'incompatible'); the pre-training
    heads a model does not use are not UNEXPECTED; the new head's weights are still reported."""
    folder, _, _ = tiny
    config = json.loads((folder / "config.json").read_text())
    assert "id2label" not in config and "label2id" not in config
    with LogLines() as log:
        model, info = load(auto, folder, **kwargs)
    text = "\n".join(log.lines)
    assert "id2label" not in text and "UNEXPECTED" not in text and "cls." not in text, text
    assert "MISSING" in text and all(key in text for key in new), text
    assert not info["unexpected_keys"] and set(info["missing_keys"]) == new
    if kwargs:
        assert model.config.num_labels == 3 and model.classifier.out_features == 3


@pytest.fixture(scope="module")
def saved_by_transformers(tiny, tmp_path_factory):
    """What a user has after AutoTokenizer(...).save_pretrained(D) + AutoModelFor...save_pretrained(D):
    tokenizer.json, and no vocab.txt."""
    folder, _, _ = tiny
    saved = tmp_path_factory.mktemp("save-pretrained") / "D"
    transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True).save_pretrained(saved)
    load("AutoModelForMaskedLM", folder)[0].save_pretrained(saved)  # the MLM head: s2s fine-tuning reads it too
    assert (saved / "tokenizer.json").is_file() and not (saved / "vocab.txt").exists()
    return saved


def test_save_pretrained_folder_vocabulary_is_read_from_tokenizer_json(saved_by_transformers, tiny, tmp_path):
    from megatron_pmlm.pretrained import load_model
    from megatron_pmlm.tasks.hf_trainer import check_model_path
    from megatron_pmlm.tokenizer import folder_vocabulary

    vocabulary = folder_vocabulary(saved_by_transformers)
    assert list(vocabulary.tokens) == VOCAB and vocabulary.do_lower_case is True and vocabulary.file is None
    assert check_model_path(saved_by_transformers) == "hf"
    loaded = load_model(saved_by_transformers)  # what finetune_s2s and decode_s2s read
    assert loaded.vocab_file is None and loaded.do_lower_case
    reference = WordPieceTokenizer(tiny[0] / "vocab.txt")
    in_memory = WordPieceTokenizer(loaded.vocabulary)
    assert in_memory.special == reference.special
    texts = ["Hello the tower of London.", "w1 w2 [P] hello"]
    assert [a.tolist() for a in in_memory.encode_batch(texts)] == [b.tolist() for b in reference.encode_batch(texts)]
    assert not (saved_by_transformers / "vocab.txt").exists()  # nothing written into the user's folder
    # Cased: the tokenizer's normalizer says so, whatever tokenizer_config.json lacks.
    cased = tmp_path / "cased"
    write_tiny_folder(cased, write_vocab(tmp_path / "vocab.txt"), do_lower_case=False)
    transformers.AutoTokenizer.from_pretrained(str(cased)).save_pretrained(tmp_path / "cased-saved")
    config = json.loads((tmp_path / "cased-saved" / "tokenizer_config.json").read_text())
    config.pop("do_lower_case", None)
    (tmp_path / "cased-saved" / "tokenizer_config.json").write_text(json.dumps(config))
    assert folder_vocabulary(tmp_path / "cased-saved").do_lower_case is False


def test_from_hf_import_writes_the_checkpoint_vocab_txt(saved_by_transformers, tmp_path):
    save = tmp_path / "ckpt"
    pmlm_adapter.import_from_hf(saved_by_transformers, save, log=lambda message: None)
    assert (save / "iter_0000000" / "vocab.txt").read_text().splitlines() == VOCAB
    assert not (saved_by_transformers / "vocab.txt").exists()


def test_non_wordpiece_tokenizer_json_is_named_in_one_line(saved_by_transformers, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    from megatron_pmlm.finetune_glue import main as finetune_glue

    folder = tmp_path / "bpe"
    folder.mkdir()
    for path in saved_by_transformers.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")])).save(str(folder / "tokenizer.json"))
    (tmp_path / "RTE").mkdir()
    for split in ("train", "dev"):
        (tmp_path / "RTE" / f"{split}.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n")
    code = finetune_glue(["--model", str(folder), "--task", "rte", "--data-dir", str(tmp_path),
                          "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert f"{folder / 'tokenizer.json'} is a BPE tokenizer, not WordPiece" in err


def test_glue_and_decode_run_from_a_save_pretrained_folder(saved_by_transformers, tmp_path, capsys):
    """finetune_glue fine-tunes it (its output gets a vocab.txt, for s2s-ft and older tools);
    decode_s2s decodes it, warning once that it was never fine-tuned for generation."""
    from megatron_pmlm import decode_s2s, finetune_glue

    (tmp_path / "RTE").mkdir()
    rows = "".join(f"{i}\thello the tower.\tw{i} of london.\t{('entailment', 'not_entailment')[i % 2]}\n"
                   for i in range(8))
    for split in ("train", "dev"):
        (tmp_path / "RTE" / f"{split}.tsv").write_text("index\tsentence1\tsentence2\tlabel\n" + rows)
    out = tmp_path / "glue"
    assert finetune_glue.main(["--model", str(saved_by_transformers), "--task", "rte", "--data-dir", str(tmp_path),
                               "--output-dir", str(out), "--max-steps", "1", "--per-device-train-batch-size", "4",
                               "--max-seq-length", "32", "--disable-tqdm"]) == 0
    assert (out / "vocab.txt").read_text().splitlines() == VOCAB
    assert not (saved_by_transformers / "vocab.txt").exists()
    capsys.readouterr()
    (tmp_path / "src.txt").write_text("hello the tower\nw1 w2 london\n")
    assert decode_s2s.main(["--model", str(saved_by_transformers), "--input", str(tmp_path / "src.txt"),
                            "--output", str(tmp_path / "pred.txt"), "--max-target-length", "4", "--device", "cpu",
                            "--no-progress"]) == 0
    warnings_given = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings_given) == 1 and "records no sequence-to-sequence fine-tuning" in warnings_given[0]
    assert len((tmp_path / "pred.txt").read_text().splitlines()) == 2


def test_finetune_s2s_from_a_save_pretrained_folder_records_its_vocabulary_in_save(saved_by_transformers, tmp_path):
    """finetune_s2s reads the tokenizer.json vocabulary in memory and keeps a vocab.txt in --save
    (not in the model's folder) for its export, which then decodes without a warning."""
    from pmlm_testing import run_module

    (tmp_path / "s.txt").write_text("".join(f"hello the tower w{i}\n" for i in range(8)))
    (tmp_path / "t.txt").write_text("".join(f"london w{i}\n" for i in range(8)))
    save = tmp_path / "save"
    result = run_module("megatron_pmlm.finetune_s2s", "--model", str(saved_by_transformers), "--train-src",
                        str(tmp_path / "s.txt"), "--train-tgt", str(tmp_path / "t.txt"), "--max-source-length", "16",
                        "--max-target-length", "8", "--micro-batch-size", "4", "--global-batch-size", "4",
                        "--train-iters", "1", "--save", str(save), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (save / "vocab.txt").read_text().splitlines() == VOCAB
    assert (save / "hf" / "vocab.txt").read_text().splitlines() == VOCAB
    assert not (saved_by_transformers / "vocab.txt").exists()
    (tmp_path / "src.txt").write_text("hello the tower\n")
    result = run_module("megatron_pmlm.decode_s2s", "--model", str(save), "--input", str(tmp_path / "src.txt"),
                        "--output", str(tmp_path / "pred.txt"), "--max-target-length", "4", "--device", "cpu",
                        "--no-progress", timeout=300)
    assert result.returncode == 0 and "warning:" not in result.stderr, result.stderr[-3000:]
