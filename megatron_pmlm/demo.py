"""`make demo`: the whole pipeline, small, on the CPU.

    python -m megatron_pmlm.demo [--input FILE ...] [--vocab-file VOCAB] [--output-dir outputs/demo]

1. corpus: the documentation text every CPython ships (`pydoc_data.topics`, ~465 KB of English),
   or --input files;
2. `data_prep.preprocess`: sentences tokenized into a Megatron .bin/.idx (training a WordPiece
   vocabulary on the corpus unless --vocab-file is given);
3. `data_prep.build_samples`: `[SOS] S1 [EOS] S2 [EOS]` samples with precomputed block masks;
4. `megatron_pmlm.pretrain` under torchrun, 2 processes, DeepSpeed ZeRO-2: a tiny PMLM trains,
   stops half way with a checkpoint (--exit-interval), then resumes from it to the end;
5. `tools/convert_checkpoint.py --verify`: the final checkpoint as a Hugging Face folder, its
   logits checked against ours on the validation samples.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .config import positive_int
from .files import OutputError, check_output_folder, write_text_atomically
from .models.objectives import OBJECTIVES, get_objective


def write_pydoc_corpus(path: Path) -> int:
    """One document per pydoc topic; blank lines inside a topic collapsed so it stays one document."""
    from pydoc_data.topics import topics

    documents = [re.sub(r"\n\s*\n", "\n", text.strip()) for _, text in sorted(topics.items())]
    text = "\n\n".join(d for d in documents if d) + "\n"
    write_text_atomically(path, text)
    return len(text.encode("utf-8"))


def _run(step: str, command: list[str], env: dict | None = None) -> None:
    print(f"\n$ {' '.join(command)}", flush=True)
    result = subprocess.run(command, env={**os.environ, **(env or {})})
    if result.returncode:
        raise SystemExit(f"demo: {step} failed (exit code {result.returncode})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", help="text files (documents separated by blank lines) or JSONL")
    parser.add_argument("--vocab-file", help="use this WordPiece vocab.txt instead of training one")
    parser.add_argument("--output-dir", default="outputs/demo")
    parser.add_argument("--vocab-size", type=positive_int, default=8000)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--objective", default="ae+par", help=f"one of {', '.join(OBJECTIVES)}")
    parser.add_argument("--nproc", type=positive_int, default=2, help="training processes (data parallel)")
    args = parser.parse_args(argv)
    started = time.time()
    python = sys.executable
    try:  # `-`, a file, a device, FIFO or socket: refused before anything is made
        check_output_folder(args.output_dir, "--output-dir")
    except OutputError as error:
        parser.error(str(error))
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.train_iters < 4:
        parser.error("--train-iters must be at least 4")
    if args.objective not in OBJECTIVES:
        parser.error(f"unknown objective {args.objective!r}; choose one of: {', '.join(OBJECTIVES)}")

    if args.input:
        missing = [p for p in args.input if not Path(p).exists()]
        if missing:
            print(f"error: input not found: {', '.join(missing)}", file=sys.stderr)
            return 2
        inputs = list(args.input)
        print(f"[1/5] corpus: {len(inputs)} input(s)")
    else:
        corpus = out / "corpus.txt"
        size = write_pydoc_corpus(corpus)
        inputs = [str(corpus)]
        print(f"[1/5] corpus: pydoc_data.topics -> {corpus} ({size / 1e3:.0f} KB)")

    print("[2/5] tokenizing into a Megatron indexed dataset (data_prep.preprocess)")
    prefix = out / "corpus"
    vocab_args = ["--vocab-file", args.vocab_file] if args.vocab_file else ["--train-vocab", str(args.vocab_size)]
    _run("preprocess", [python, "-m", "data_prep.preprocess", "--input", *inputs, "--output-prefix", str(prefix),
                        *vocab_args, "--workers", "2", "--overwrite"])

    print("[3/5] building samples with precomputed block masks (data_prep.build_samples)")
    samples = out / "samples"
    _run("build_samples", [python, "-m", "data_prep.build_samples", "--data-path", str(prefix), "--output",
                           str(samples), "--seq-length", "128", "--split", "95,5,0", "--mask-epochs", "4",
                           "--seed", "1234", "--overwrite"])

    half = args.train_iters // 2
    print(f"[4/5] pre-training a tiny {'UniLM v1' if get_objective(args.objective).is_unilm else 'PMLM'} "
          f"({args.objective}) on DeepSpeed ZeRO-2 with {args.nproc} processes: "
          f"stop at iteration {half} with a checkpoint, then resume to {args.train_iters}")
    checkpoints, tensorboard = out / "checkpoints", out / "tensorboard"
    common = ["-m", "megatron_pmlm.pretrain", "--preset", "tiny", "--objective", args.objective,
              "--data-path", str(samples), "--micro-batch-size", "8", "--global-batch-size", str(8 * args.nproc),
              "--train-iters", str(args.train_iters), "--lr", "1e-3",
              "--lr-warmup-iters", str(max(1, args.train_iters // 10)),
              "--log-interval", str(max(1, args.train_iters // 10)), "--eval-interval", str(half),
              "--eval-iters", "4", "--zero-stage", "2", "--save", str(checkpoints), "--load", str(checkpoints),
              "--tensorboard-dir", str(tensorboard)]
    # --standalone: torchrun picks the port itself (no race with other processes for a free one).
    launcher = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1"}
    import shutil

    for owned in (checkpoints, tensorboard):  # the demo starts from scratch every time: one run per TB folder
        if owned.exists():
            shutil.rmtree(owned)
    histories = []
    for phase, extra in (("first half", ["--exit-interval", str(half)]), ("resumed", [])):
        history = out / f"history_{phase.split()[0]}.json"
        _run(f"pre-training ({phase})", [*launcher, *common, *extra,
                                        "--history-json", str(history)], env)
        histories.append(json.loads(history.read_text()))

    hf_dir = out / "hf"
    print("\n[5/5] converting the final checkpoint to a Hugging Face folder, verified against our model on "
          "the validation samples (tools/convert_checkpoint.py --verify)")
    _run("conversion", [python, "-m", "megatron_pmlm.hf.convert", "--load", str(checkpoints), "--output",
                        str(hf_dir), "--verify", "--overwrite"], env)

    train = [h for history in histories for h in history if "loss" in h]
    valid = [h for history in histories for h in history if "valid_loss" in h]
    first, last = train[0], train[-1]
    # The objective's own losses: loss_ae / loss_par (PMLM) or loss_unilm_* / loss_nsp (UniLM v1).
    loss_keys = [key for key in first if key.startswith("loss_") and key in last and key not in ("loss_mlm", "loss_scale")]
    print("\nlosses (training, averaged over a log interval):")
    for key in loss_keys:
        if first[key] or last[key]:
            print(f"  {key:<15} {first[key]:.3f} at iteration {first['iteration']} -> "
                  f"{last[key]:.3f} at iteration {last['iteration']}")
    for record in valid:
        print(f"  validation at iteration {record['iteration']}: loss {record['valid_loss']:.3f}, "
              f"mlm_acc {record['valid_mlm_acc']:.3f}")
    print(f"\nthe run stopped at iteration {half} with checkpoint {checkpoints / f'iter_{half:07d}'}, "
          f"then resumed from it (--load) and trained iterations {half + 1}-{args.train_iters}")
    # NSP starts at chance (ln 2) and a tiny model hardly moves it in a demo: the LM losses must fall.
    falling = all(last[k] < first[k] for k in loss_keys if first[k] and k != "loss_nsp")
    print(f"{'the losses fell' if falling else 'WARNING: the losses did not fall'}; demo took {time.time() - started:.0f} s")
    print(f"outputs under {out}:")
    print(f"  tokenized corpus   {prefix}.bin / .idx")
    print(f"  samples + masks    {samples}  (python -m data_prep.inspect {samples} --sample 0)")
    print(f"  checkpoints        {checkpoints} (DeepSpeed, latest: {(checkpoints / 'latest').read_text().strip()})")
    print(f"  TensorBoard        {tensorboard} (tensorboard --logdir {tensorboard}; "
          f"python tools/plot_curves.py {tensorboard} -o curves.png)")
    auto = "AutoModelForPreTraining" if get_objective(args.objective).next_sentence_prediction else "AutoModelForMaskedLM"
    print(f"  Hugging Face       {hf_dir} ({auto}.from_pretrained(..., trust_remote_code=True))")
    return 0 if falling else 1


if __name__ == "__main__":
    sys.exit(main())
