"""Files others can read and outputs written through (megatron_pmlm/files.py): everything the
project writes follows the umask (0644/0755 under 022, 0640/0750 under 027), atomic writes
included; `-` is standard output; FIFOs, devices and links to them are written into, never
replaced; regular files are still replaced atomically."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

import pmlm_testing
from pmlm_testing import REPO_ROOT, RUN_ENVIRONMENT, SHARED_DATA

TINY = ["--preset", "tiny", "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-4",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
        "--train-iters", "2"]


def run_python(*args: str, umask: int | None = None, cwd: Path | None = None, timeout: int = 300,
               text: bool = True) -> subprocess.CompletedProcess:
    """`python ARGS` (a module with -m, or a script), under `umask` when given, output captured
    (forked from the suite's preloaded interpreter, which sets the umask first, as a new one would)."""
    return pmlm_testing.run_python(list(args), env={**os.environ, **RUN_ENVIRONMENT}, cwd=cwd, timeout=timeout,
                                   umask=umask, text=text)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (result.stdout or "")[-3000:] + result.stderr[-3000:]
    return result


def wrong_modes(root: Path, umask: int) -> list[str]:
    """Every file and folder under `root` whose permission bits are not 0o666 / 0o777 less `umask`."""
    wrong = []
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        expected = (0o777 if stat.S_ISDIR(mode) else 0o666) & ~umask
        if stat.S_IMODE(mode) != expected:
            wrong.append(f"{path.relative_to(root)}: {stat.S_IMODE(mode):04o}, expected {expected:04o}")
    return wrong


# ------------------------------------------------------------------------------------------------
# Every tool's files under the umask
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_every_file_and_folder_written_follows_the_umask(umask, tmp_path, pretraining_samples, wikitext,
                                                         bert_vocab):
    """One tiny pre-training run and every tool on its outputs, all under `umask`; then every file
    and folder they wrote is checked (inputs live apart, in `inputs/`)."""
    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    corpus = inputs / "wiki.txt"
    corpus.write_text(wikitext.read_text(encoding="utf-8")[:20_000].rsplit("\n\n", 1)[0] + "\n", encoding="utf-8")
    questions = SHARED_DATA / "qg"
    (inputs / "src.txt").write_text("".join((questions / "src-dev.txt").read_text().splitlines(True)[:2]))
    (inputs / "tgt.txt").write_text("".join((questions / "tgt-dev.txt").read_text().splitlines(True)[:2]))

    steps = {
        "preprocess": ["-m", "data_prep.preprocess", "--input", str(corpus), "--output-prefix",
                       str(out / "data" / "wiki"), "--vocab-file", str(bert_vocab), "--no-progress"],
        "build_samples": ["-m", "data_prep.build_samples", "--data-path", str(out / "data" / "wiki"), "--output",
                          str(out / "data" / "samples"), "--seq-length", "64", "--no-progress"],
        "pretrain": ["-m", "megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY,
                     "--save", str(out / "ckpt"), "--history-json", str(out / "history.json"),
                     "--tensorboard-dir", str(out / "tb")],
        "convert": [str(REPO_ROOT / "tools" / "convert_checkpoint.py"), "--load", str(out / "ckpt"), "--output",
                    str(out / "hf")],
        "finetune_s2s": ["-m", "megatron_pmlm.finetune_s2s", "--model", str(out / "hf"), "--train-src",
                         str(inputs / "src.txt"), "--train-tgt", str(inputs / "tgt.txt"), "--max-source-length", "40",
                         "--max-target-length", "12", "--micro-batch-size", "2", "--global-batch-size", "2",
                         "--train-iters", "1", "--save", str(out / "s2s")],
        "decode_s2s": ["-m", "megatron_pmlm.decode_s2s", "--model", str(out / "s2s"), "--input",
                       str(inputs / "src.txt"), "--output", str(out / "pred.txt"), "--max-target-length", "4",
                       "--device", "cpu", "--no-progress"],
        "eval_s2s": ["-m", "megatron_pmlm.eval_s2s", "--pred", str(out / "pred.txt"), "--ref",
                     str(inputs / "tgt.txt"), "--output", str(out / "scores.json"), "--tokenize", "none"],
        "plot_curves": [str(REPO_ROOT / "tools" / "plot_curves.py"), str(out / "tb"), "-o", str(out / "curves.png")],
        "evaluate_downstream": ["-m", "megatron_pmlm.evaluate_downstream", "--model", str(out / "hf"), "--tasks",
                                "mrpc", "--seeds", "1", "--max-steps", "1", "--max-train-samples", "8",
                                "--max-eval-samples", "8", "--max-seq-length", "64",
                                "--output", str(out / "eval" / "results.md")],
    }
    timings = {}
    for name, args in steps.items():
        started = time.perf_counter()
        ok(run_python(*args, umask=umask))
        timings[name] = round(time.perf_counter() - started, 1)
    print(f"umask {umask:03o}: {timings}")

    expected_files = ["data/wiki.bin", "data/wiki.json", "data/samples/metadata.json", "ckpt/latest",
                      "ckpt/iter_0000002/run_state.json", "ckpt/iter_0000002/mp_rank_00_model_states.pt",
                      "history.json", "hf/config.json", "hf/pytorch_model.bin", "hf/vocab.txt", "s2s/latest",
                      "s2s/hf/config.json", "pred.txt",
                      "scores.json", "curves.png", "eval/results.md", "eval/results.json",
                      "eval/results-runs/mrpc/seed-1/all_results.json"]
    for name in expected_files:
        assert (out / name).is_file(), name
    assert list((out / "tb").rglob("events.out.tfevents.*"))
    assert json.loads((out / "s2s" / "hf" / "config.json").read_text())["checkpoint_tag"] == "iter_0000001"
    assert not list(out.rglob(".*.tmp*")), "temporary files left behind"
    assert wrong_modes(out, umask) == []

    # `-`: the predictions, one per line, are all that standard output holds; no file named `-`.
    decode_to_stdout = [arg if arg != str(out / "pred.txt") else "-" for arg in steps["decode_s2s"]]
    to_stdout = ok(run_python(*decode_to_stdout, umask=umask, cwd=out))
    assert to_stdout.stdout == (out / "pred.txt").read_text() and "wrote -" in to_stdout.stderr
    image = run_python(*steps["plot_curves"][:-1], "-", umask=umask, cwd=out, text=False)
    assert image.returncode == 0 and image.stdout == (out / "curves.png").read_bytes(), image.stderr[-2000:]
    assert not (out / "-").exists()


# ------------------------------------------------------------------------------------------------
# Where outputs go: `-`, FIFOs, devices, links, regular files
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def scored(tmp_path) -> tuple[Path, Path]:
    """A prediction and a reference file for eval_s2s (the cheapest tool with an --output)."""
    pred, ref = tmp_path / "pred.txt", tmp_path / "ref.txt"
    pred.write_text("what is the capital of france ?\nwho wrote it ?\n")
    ref.write_text("what is the capital of france ?\nwho wrote the book ?\n")
    return pred, ref


def eval_s2s(scored, output: str, cwd: Path) -> subprocess.CompletedProcess:
    pred, ref = scored
    return run_python("-m", "megatron_pmlm.eval_s2s", "--pred", str(pred), "--ref", str(ref), "--output", output,
                      "--tokenize", "none", cwd=cwd, timeout=120)


def test_dash_is_standard_output_and_the_table_goes_to_standard_error(scored, tmp_path):
    result = ok(eval_s2s(scored, "-", cwd=tmp_path))
    assert json.loads(result.stdout)["examples"] == 2  # nothing but the JSON on standard output
    assert "ROUGE-L" in result.stderr
    assert not (tmp_path / "-").exists()


def test_a_fifo_is_written_through_and_stays_a_fifo(scored, tmp_path):
    fifo = tmp_path / "scores.fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    result = ok(eval_s2s(scored, str(fifo), cwd=tmp_path))
    reader.join(timeout=30)
    assert json.loads(received[0])["examples"] == 2
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert "ROUGE-L" in result.stdout  # not standard output: the table stays there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred.txt", "ref.txt", "scores.fifo"]


def test_links_to_devices_are_written_through_never_replaced(scored, tmp_path):
    """A link to /dev/null stays a link; a link to /dev/stdout (this process's own standard output,
    through /proc) delivers the data on standard output and stays a link."""
    null = tmp_path / "null"
    null.symlink_to("/dev/null")
    ok(eval_s2s(scored, str(null), cwd=tmp_path))
    assert null.is_symlink() and os.readlink(null) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)

    stdout = tmp_path / "stdout"
    stdout.symlink_to("/dev/stdout")
    result = ok(eval_s2s(scored, str(stdout), cwd=tmp_path))
    assert json.loads(result.stdout)["examples"] == 2 and "ROUGE-L" in result.stderr
    assert stdout.is_symlink() and os.readlink(stdout) == "/dev/stdout"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null", "pred.txt", "ref.txt", "stdout"]


def test_a_regular_file_is_replaced_atomically_and_a_link_keeps_pointing_at_it(tmp_path):
    from megatron_pmlm.files import open_output, write_text_atomically, written_through

    target = tmp_path / "out.txt"
    target.write_text("old\n")
    before = target.stat().st_ino
    write_text_atomically(target, "new\n")
    assert target.read_text() == "new\n" and target.stat().st_ino != before  # a new file, renamed over it
    assert not written_through(target)

    # A failure half-way leaves the old contents and no temporary file.
    with pytest.raises(RuntimeError):
        with open_output(target) as handle:
            handle.write("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]

    # A link to a regular file: the file it names is replaced, the link stays.
    link = tmp_path / "link.txt"
    link.symlink_to("out.txt")
    write_text_atomically(link, "through the link\n")
    assert link.is_symlink() and target.read_text() == "through the link\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "out.txt"]


def test_outputs_that_cannot_be_written_are_named(tmp_path):
    from megatron_pmlm.files import OutputError, check_output, written_through

    (tmp_path / "folder").mkdir()
    cases = [(tmp_path / "folder", "is a folder"), (tmp_path / "missing" / "out.txt", "does not exist"),
             ("/proc/self/fd/999999", "does not exist")]
    for path, message in cases:
        with pytest.raises(OutputError, match=message):
            check_output(path)
    for fine in ("-", tmp_path / "new.txt", "/dev/null"):
        check_output(fine)
    assert written_through("-") and written_through("/dev/null") and written_through("/dev/stderr")
