"""Issue 34 items 2, 6 and 7: an output never replaces what is not ours (a device, FIFO or socket
whatever the flags, a folder without our marker even with --overwrite, `-` where a folder is
written); a count of 0 or less that would do nothing is refused by argparse naming the flag; a tool
that prints results ends quietly when its reader closes the pipe; a directory given for a file is
named as a directory. Every command with a folder output is run on the real command line parser."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from pmlm_testing import REPO_ROOT, run_module, run_tool

sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from data_prep import build_samples, preprocess  # noqa: E402
from megatron_pmlm import check_leakage, demo, evaluate_downstream, finetune_glue, finetune_squad  # noqa: E402
from megatron_pmlm.config import ConfigError  # noqa: E402
from megatron_pmlm.files import CLOSED_PIPE_STATUS, OUTPUT_MARKER, check_output_folder, OutputError  # noqa: E402
from megatron_pmlm.hf import convert  # noqa: E402
from megatron_pmlm.hf.folder import older_output  # noqa: E402
from megatron_pmlm.training.preflight import check_run_paths  # noqa: E402

SPECIAL = ("fifo", "link to /dev/null", "socket")


@pytest.fixture
def specials(tmp_path):
    """A real FIFO, a symbolic link to /dev/null (never the device itself) and a bound UNIX socket,
    each with a way to check it is still what it was."""
    made = tmp_path / "specials"
    made.mkdir()
    os.mkfifo(made / "fifo")
    os.symlink(os.devnull, made / "null")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(made / "sock"))
    paths = {"fifo": made / "fifo", "link to /dev/null": made / "null", "socket": made / "sock"}
    before = {name: (os.lstat(p).st_mode, os.path.realpath(p)) for name, p in paths.items()}
    yield paths
    server.close()
    for name, path in paths.items():  # nothing replaced: the same kind of file, the link pointing where it did
        assert (os.lstat(path).st_mode, os.path.realpath(path)) == before[name], name
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def argparse_error(err: str) -> str:
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------------------
# Item 2: outputs never replace what is not ours
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("overwrite", [False, True])
def test_convert_never_replaces_a_device_fifo_or_socket(specials, kind, overwrite, tmp_path, capsys):
    target = str(specials[kind])
    extra = ["--overwrite"] if overwrite else []
    for argv, flag in ((["--load", str(tmp_path / "ckpt"), "--output", target], "--output"),
                       (["--from-hf", str(tmp_path / "hf"), "--save", target], "--save")):
        assert convert.main(argv + extra, log=print) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"{flag} {target} is a " in line and "refused" in line and "--overwrite" not in line, line


def test_a_folder_output_named_dash_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["--load", "ckpt", "--output", "-"], ["--from-hf", "hf", "--save", "-", "--overwrite"]):
        assert convert.main(argv, log=print) == 2
        assert "writes a folder, not standard output" in one_error_line(capsys.readouterr().err)
    assert build_samples.main(["--data-path", "corpus", "--output", "-"]) == 2
    assert "--output -: this command writes a folder" in one_error_line(capsys.readouterr().err)
    assert preprocess.main(["--input", "corpus.txt", "--output-prefix", "-", "--vocab-file", "v.txt"]) == 2
    assert "--output-prefix -:" in one_error_line(capsys.readouterr().err)
    with pytest.raises(ConfigError, match="--save -: this command writes a folder"):
        check_run_paths("-", None)
    with pytest.raises(ConfigError, match="--tensorboard-dir -: this command writes a folder"):
        check_run_paths(str(tmp_path / "save"), None, tensorboard_dir="-")
    assert not (tmp_path / "-").exists() and list(tmp_path.iterdir()) == []


def test_overwrite_replaces_only_a_folder_this_project_wrote(tmp_path, capsys):
    downloaded = tmp_path / "bert-base-uncased"  # what a download holds: config.json is not enough
    downloaded.mkdir()
    (downloaded / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    (downloaded / "vocab.txt").write_text("[PAD]\n")
    for argv in (["--load", str(tmp_path / "ckpt"), "--output", str(downloaded), "--overwrite"],
                 ["--from-hf", str(tmp_path / "hf"), "--save", str(downloaded), "--overwrite"]):
        assert convert.main(argv, log=print) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "was not written by this project" in line and "remove it yourself" in line
    assert build_samples.main(["--data-path", "corpus", "--output", str(downloaded), "--overwrite"]) == 2
    assert "was not written by this project" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in downloaded.iterdir()) == ["config.json", "vocab.txt"]
    # With the marker the same folder is ours: --overwrite may replace it (without it, still refused).
    (downloaded / OUTPUT_MARKER).write_text("written by megatron-pmlm\n")
    check_output_folder(downloaded, "--output", overwrite=True)
    with pytest.raises(OutputError, match=r"already exists and is not empty \(pass --overwrite"):
        check_output_folder(downloaded, "--output", overwrite=False)
    # A regular file is replaced with --overwrite only.
    (tmp_path / "file").write_text("x")
    check_output_folder(tmp_path / "file", "--output", overwrite=True)
    with pytest.raises(OutputError, match="is a file"):
        check_output_folder(tmp_path / "file", "--output", overwrite=False)


def test_outputs_of_ours_written_before_the_marker_are_recognised(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"model_type": "pmlm"}))
    for name in ("pytorch_model.bin", "vocab.txt", "tokenizer.json", "modeling_pmlm.py"):
        (export / name).write_text("")
    assert older_output(export)
    (export / "notes.txt").write_text("mine")  # something an export never holds
    assert not older_output(export)
    (export / "notes.txt").unlink()
    (export / "config.json").write_text(json.dumps({"model_type": "bert"}))  # a BERT export looks downloaded
    assert not older_output(export)
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "iter_0000000").mkdir(parents=True)
    (checkpoint / "latest").write_text("iter_0000000")
    assert not older_output(checkpoint)
    (checkpoint / "iter_0000000" / "run_state.json").write_text("{}")
    assert older_output(checkpoint)
    samples = tmp_path / "samples"
    samples.mkdir()
    (samples / "metadata.json").write_text(json.dumps({"format_version": 1, "settings": {}, "splits": {}}))
    assert build_samples._older_samples(samples) and not build_samples._older_samples(export)


@pytest.mark.parametrize("kind", SPECIAL)
def test_data_prep_outputs_refuse_special_files(specials, kind, tmp_path, capsys):
    target = specials[kind]
    for extra in ([], ["--overwrite"]):
        assert build_samples.main(["--data-path", str(tmp_path / "corpus"), "--output", str(target), *extra]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "refused" in line and "--overwrite" not in line, line
    # preprocess replaces PREFIX.bin and PREFIX.idx: one of them being a special file is refused.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one two three.\n")
    prefix = tmp_path / "out" / "wiki"
    prefix.parent.mkdir()
    os.symlink(target, f"{prefix}.bin")
    for extra in ([], ["--overwrite"]):
        assert preprocess.main(["--input", str(corpus), "--output-prefix", str(prefix), "--train-vocab", "200",
                                "--no-progress", *extra]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"{prefix}.bin is a " in line and "--overwrite" not in line, line
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["wiki.bin"]


@pytest.mark.parametrize("kind", SPECIAL)
def test_training_and_fine_tuning_folders_refuse_special_files(specials, kind, tmp_path, capsys):
    target = str(specials[kind])
    with pytest.raises(ConfigError, match=f"--save {target} is a .*refused"):  # pretrain and finetune_s2s
        check_run_paths(target, None)
    with pytest.raises(ConfigError, match=f"--tensorboard-dir {target} is a .*refused"):
        check_run_paths(str(tmp_path / "save"), None, tensorboard_dir=target)
    with pytest.raises(SystemExit) as exited:
        demo.main(["--output-dir", target])
    assert exited.value.code == 2 and "refused" in argparse_error(capsys.readouterr().err)


def test_fine_tuning_output_dirs_refuse_dash_and_special_files(specials, tiny_hf_model, tmp_path, capsys,
                                                              monkeypatch):
    """finetune_glue, finetune_squad and evaluate_downstream, on valid data and model: only the output is wrong."""
    monkeypatch.chdir(tmp_path)  # where a folder named `-` would appear
    glue = tmp_path / "glue" / "RTE"
    glue.mkdir(parents=True)
    rows = "index\tsentence1\tsentence2\tlabel\n" + "".join(
        f"{i}\tA man walks {i}.\tA man moves.\t{'entailment' if i % 2 else 'not_entailment'}\n" for i in range(4))
    (glue / "train.tsv").write_text(rows)
    (glue / "dev.tsv").write_text(rows)
    squad = tmp_path / "dev.json"
    squad.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [{
        "context": "Paris is in France.", "qas": [{"id": "q1", "question": "Where is Paris?",
                                                   "answers": [{"text": "France", "answer_start": 12}]}]}]}]}))
    for target in ("-", str(specials["fifo"]), str(specials["link to /dev/null"])):
        glue_argv = ["--model", str(tiny_hf_model), "--task", "rte", "--data-dir", str(tmp_path / "glue"),
                     "--output-dir", target]
        assert finetune_glue.main(glue_argv) == 2
        assert "--output-dir " + target in one_error_line(capsys.readouterr().err)
        assert finetune_squad.main(["--model", str(tiny_hf_model), "--predict-file", str(squad),
                                    "--output-dir", target]) == 2
        assert "--output-dir " + target in one_error_line(capsys.readouterr().err)
        assert evaluate_downstream.main(["--model", str(tiny_hf_model), "--tasks", "rte", "--seeds", "1",
                                         "--data-dir", str(tmp_path / "glue"), "--output", str(tmp_path / "r.md"),
                                         "--work-dir", target]) == 2
        assert "--work-dir " + target in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "-").exists() and not (tmp_path / "r.md").exists()


# ------------------------------------------------------------------------------------------------
# Item 6: no vacuous pass
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("main, argv, flag", [
    (check_leakage.main, ["--examples", "0"], "--examples"),
    (check_leakage.main, ["--examples", "-3"], "--examples"),
    (build_samples.main, ["--data-path", "p", "--output", "o", "--seq-length", "0"], "--seq-length"),
    (build_samples.main, ["--data-path", "p", "--output", "o", "--documents-per-chunk", "0"], "--documents-per-chunk"),
    (preprocess.main, ["--input", "i", "--output-prefix", "o", "--train-vocab", "300", "--world-size", "0"],
     "--world-size"),
    (convert.main, ["--from-hf", "h", "--save", "s", "--make-vocab-size-divisible-by", "-8"],
     "--make-vocab-size-divisible-by"),
])
def test_counts_that_would_do_nothing_are_refused_naming_the_flag(main, argv, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert f"argument {flag}: must be" in argparse_error(capsys.readouterr().err)


def test_check_leakage_checks_at_least_one_example():
    with pytest.raises(ConfigError, match="--examples must be at least 1, got 0"):
        check_leakage.run_check("tiny", examples=0)


@pytest.mark.parametrize("module, argv, flag", [
    ("data_prep.inspect", ["p", "--sample", "-1"], "--sample"),
    ("megatron_pmlm.finetune_s2s", ["--model", "m", "--epochs", "0"], "--epochs"),
    ("megatron_pmlm.decode_s2s", ["--model", "m", "--input", "i", "--output", "o", "--no-repeat-ngram-size", "-2"],
     "--no-repeat-ngram-size"),
])
def test_counts_refused_by_other_commands(module, argv, flag):
    result = run_module(module, *argv, timeout=120)
    assert result.returncode == 2 and f"argument {flag}: must be" in argparse_error(result.stderr)


@pytest.mark.parametrize("script, argv, flag", [
    ("plot_curves.py", ["run.json", "--columns", "0"], "--columns"),
    ("bench_decode.py", ["--sources", "0"], "--sources"),
    ("bench_checksum.py", ["--repeats", "0"], "--repeats"),
])
def test_counts_refused_by_tools(script, argv, flag):
    result = run_tool(script, *argv, timeout=120)
    assert result.returncode == 2 and f"argument {flag}: must be" in argparse_error(result.stderr)


def test_zero_is_kept_where_it_means_something():
    from megatron_pmlm.pretrain import build_parser

    args = build_parser().parse_args(["--data-path", "samples", "--keep-last-checkpoints", "0", "--eval-iters", "0",
                                      "--make-vocab-size-divisible-by", "0"])
    assert (args.keep_last_checkpoints, args.eval_iters, args.make_vocab_size_divisible_by) == (0, 0, 0)


# ------------------------------------------------------------------------------------------------
# Item 7: closed pipes, empty inputs, directories given for files
# ------------------------------------------------------------------------------------------------

def run_into_closed_pipe(command: list[str]) -> tuple[int, str]:
    """Run `command` with its standard output a pipe whose reader has gone (`| head` that has
    finished): every write meets a closed pipe."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                               env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    process.stdout.close()
    err = process.stderr.read()
    process.stderr.close()
    return process.wait(timeout=300), err


def test_tools_that_print_results_end_quietly_on_a_closed_pipe(tmp_path, bert_vocab, tiny_hf_model):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The first document. It has two sentences.\n\nThe second one is short.\n")
    assert preprocess.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "wiki"), "--vocab-file",
                            str(bert_vocab), "--no-progress"]) == 0
    (tmp_path / "pred.txt").write_text("a cat sat\nthe dog ran\n")
    (tmp_path / "ref.txt").write_text("a cat sat down\nthe dog ran away\n")
    (tmp_path / "history.json").write_text(json.dumps([{"iteration": 1, "loss": 9.0}, {"iteration": 2, "loss": 8.0}]))
    (tmp_path / "src.txt").write_text("where is paris ?\n")
    (tmp_path / "save" / "iter_0000001").mkdir(parents=True)
    python = sys.executable
    commands = {
        "inspect": [python, "-m", "data_prep.inspect", str(tmp_path / "wiki"), "--sample", "0"],
        "eval_s2s": [python, "-m", "megatron_pmlm.eval_s2s", "--pred", str(tmp_path / "pred.txt"), "--ref",
                     str(tmp_path / "ref.txt"), "--tokenize", "none", "--output", "-"],
        "verify_checkpoint": [python, str(REPO_ROOT / "tools" / "verify_checkpoint.py"), str(tmp_path / "save")],
        "plot_curves": [python, str(REPO_ROOT / "tools" / "plot_curves.py"), str(tmp_path / "history.json"),
                        "-o", "-"],
        "decode_s2s": [python, "-m", "megatron_pmlm.decode_s2s", "--model", str(tiny_hf_model), "--input",
                       str(tmp_path / "src.txt"), "--output", "-", "--max-target-length", "3", "--device", "cpu",
                       "--no-progress"],
    }
    for name, command in commands.items():
        status, err = run_into_closed_pipe(command)
        assert status in (0, CLOSED_PIPE_STATUS) and "Traceback" not in err and "BrokenPipe" not in err \
            and "Broken pipe" not in err, (name, status, err[-2000:])


def test_an_empty_input_leaves_no_vocabulary_behind(tmp_path, capsys):
    for text in ("", "\n   \n\n"):
        corpus = tmp_path / "empty.txt"
        corpus.write_text(text)
        prefix = tmp_path / "out" / "empty"
        assert preprocess.main(["--input", str(corpus), "--output-prefix", str(prefix), "--train-vocab", "200",
                                "--no-progress"]) == 2
        assert "empty input" in one_error_line(capsys.readouterr().err)
        assert not prefix.parent.exists() or list(prefix.parent.iterdir()) == []


def test_a_directory_given_for_a_file_is_named_as_a_directory(tmp_path, capsys):
    folder = tmp_path / "vocab"
    folder.mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one two three.\n")
    assert preprocess.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--vocab-file",
                            str(folder), "--no-progress"]) == 2
    assert f"{folder} is a directory, not a file" in one_error_line(capsys.readouterr().err)
    result = run_module("megatron_pmlm.finetune_s2s", "--model", str(tmp_path), "--train-file", str(folder),
                        timeout=120)
    assert result.returncode == 2 and f"--train-file {folder} is a directory, not a file" in result.stderr
