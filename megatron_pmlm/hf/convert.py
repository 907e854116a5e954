"""Pre-training checkpoints <-> Hugging Face folders (SPEC §10), verified: the converter's driver.
It reads which family a checkpoint holds (`pretrain --model`, in its run_state.json) and runs the
export with that family's adapter: hf/pmlm_adapter.py (PMLM/UniLM/BERT) or hf/palm_adapter.py
(PALM, whose folder is verified on held-out pairs: docs/unilm_palm.md); what both share is in
hf/folder.py.

    python tools/convert_checkpoint.py --load SAVE_DIR [--tag iter_N] --output HF_DIR [--verify]
    python tools/convert_checkpoint.py --from-hf HF_DIR --save SAVE_DIR

To Hugging Face: whatever the layout the checkpoint was written with (ZeRO 0-3, tensor and/or
pipeline parallel), the full fp32 state dict is rebuilt - ZeRO-3 partitions consolidated with
DeepSpeed's own `zero_to_fp32`, tensor-parallel shards merged along `TENSOR_PARALLEL_SPLITS`,
pipeline layer files renamed with `pipeline.canonical_parameter_name` (the tied word embedding
stored once) - then the vocabulary padding is cut off and the folder is written: config.json,
the weights (SPEC §10 names), vocab.txt + tokenizer_config.json and, with the relative position
bias, the remote code `configuration_pmlm.py` / `modeling_pmlm.py`. `--verify` runs our model and
the Hugging Face model on held-out samples (the AE view: the corrupted sequence) and fails above
a logit difference of 1e-4.

From Hugging Face: a BERT (or converted PMLM) folder becomes a DeepSpeed checkpoint that
`python -m megatron_pmlm.pretrain --load SAVE_DIR --finetune` starts from (a PALM folder is refused:
importing PALM back is not supported).

Every output is written to a temporary folder next to its destination and renamed into place only
when complete. Bad input raises `ConversionError`, whose message names the culprit (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import ConfigError, HelpFormatter, non_negative_int, positive_int
from ..files import OutputError, check_output_folder, quiet_libraries
from ..training.checkpoint_files import add_no_checksums_argument
from ..training.checkpoint_reader import ConversionError, resolve_tag, run_state_of
from . import palm_adapter, pmlm_adapter
from .family import PALM, PMLM, check_family
from .folder import NO_HELD_OUT_NOTE, VERIFY_TOLERANCE, Verification, VerificationFailed, find_vocab_file, \
    held_out_samples, older_output, staged_output
from .pmlm_adapter import import_from_hf

ADAPTERS = {PMLM: pmlm_adapter, PALM: palm_adapter}


def checkpoint_adapter(load_dir: str | os.PathLike, tag: str):
    """The adapter of the family `pretrain --model` recorded in checkpoint `tag` (PMLM when the run
    state is unreadable: its reader then says what is wrong)."""
    try:
        _, _, run_state = run_state_of(load_dir, tag, checksums=None)
    except ConversionError:
        return pmlm_adapter
    return ADAPTERS[PALM if run_state.get("args", {}).get("model") == PALM else PMLM]


def export_to_hf(load_dir: str | os.PathLike, output: str | os.PathLike, tag: str | None = None,
                 vocab_file: str | None = None, run_verify: bool = False, data_path: str | None = None,
                 verify_samples: int = 64, weights_format: str = "bin", overwrite: bool = False,
                 log: Callable[[str], None] = print, checksums: bool | None = True) -> Verification | None:
    """Checkpoint -> Hugging Face folder with its family's adapter; verified with `run_verify`.
    The checkpoint's files are checked against its manifest first (unless `checksums` is False, or
    None: the caller verified `tag`): checkpoint_reader.resolve_tag."""
    load_dir, tag = resolve_tag(load_dir, tag, checksums, log)
    adapter = checkpoint_adapter(load_dir, tag)
    checkpoint = adapter.load_checkpoint(load_dir, tag, checksums=None)
    config = checkpoint.model_config
    log(adapter.describe(checkpoint))
    vocab = find_vocab_file(checkpoint, vocab_file)
    args = checkpoint.run_state.get("args", {})
    verify_data = None
    if run_verify:
        verify_data = data_path or args.get("data_path")
        if not verify_data:
            raise ConversionError(f"--verify needs held-out {adapter.NOUN}: the checkpoint names no data_path, pass "
                                  "--data-path")
        samples, _ = held_out_samples(verify_data, adapter.NOUN, adapter.LAYOUT)  # a bad path before writing
        if samples.split == "train":
            log(NO_HELD_OUT_NOTE.format(data_path=verify_data, noun=adapter.NOUN))
    hf_state = adapter.export_state(checkpoint.state_dict, config)
    result = None
    output = Path(output)
    with staged_output(output, overwrite) as staging:
        adapter.write_folder(staging, hf_state, config, vocab, bool(args.get("do_lower_case", True)), weights_format)
        if run_verify:
            result = adapter.verify(staging, checkpoint.state_dict, config, verify_data, verify_samples)
            log(result.line())
            if not result.passed:
                raise VerificationFailed(result)
    log(adapter.wrote(output, hf_state, config))
    return result


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="python tools/convert_checkpoint.py",
        description="Pre-training checkpoint -> Hugging Face folder (--load ... --output ...), verified with "
                    "--verify; or a Hugging Face BERT/PMLM folder -> a checkpoint pre-training can --load "
                    "--finetune (--from-hf ... --save ...).")
    to_hf = parser.add_argument_group("to Hugging Face")
    to_hf.add_argument("--load", help="a pre-training --save directory")
    to_hf.add_argument("--tag", help="the checkpoint to convert, e.g. iter_0000300 (default: the one 'latest' names)")
    to_hf.add_argument("--output", help="the Hugging Face folder to write")
    to_hf.add_argument("--vocab-file", help="vocab.txt (default: the one the run's samples were built with)")
    to_hf.add_argument("--verify", action="store_true",
                       help=f"compare our model and the Hugging Face model on held-out samples; exit 1 above "
                            f"{VERIFY_TOLERANCE:g}")
    to_hf.add_argument("--data-path", help="samples for --verify (default: the run's --data-path)")
    to_hf.add_argument("--verify-samples", type=int, default=64, help="held-out samples --verify runs")
    to_hf.add_argument("--format", choices=("bin", "safetensors"), default="bin",
                       help="pytorch_model.bin (what s2s-ft loads) or model.safetensors")
    add_no_checksums_argument(to_hf)
    from_hf = parser.add_argument_group("from Hugging Face")
    from_hf.add_argument("--from-hf", help="a Hugging Face BERT or PMLM folder (config.json + weights + vocab.txt or "
                                            "the tokenizer.json save_pretrained writes)")
    from_hf.add_argument("--save", help="the checkpoint directory to write")
    from_hf.add_argument("--tensor-model-parallel-size", type=positive_int, default=1,
                         help="write tensor-parallel shards for a run of this size")
    from_hf.add_argument("--make-vocab-size-divisible-by", type=non_negative_int, default=128,
                         help="vocabulary padding, as the run will use it")
    from_hf.add_argument("--objective", default="ae+par",
                         help="the objective the run will train: a UniLM v1 one (unilm, unilm-bi, ...) keeps BERT's "
                              "pooler and next-sentence head and grows its 2 segment embeddings to UniLM v1's 6")
    from_hf.add_argument("--add-rel-pos", action="store_true",
                         help="a BERT without relative position bias: add a zero one (outputs unchanged)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output: a regular file or a folder this project wrote (never a "
                             "device, FIFO or socket)")
    return parser


def main(argv: Sequence[str] | None = None, log: Callable[[str], None] = print) -> int:
    quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.load) == bool(args.from_hf):
        parser.error("give either --load SAVE_DIR --output HF_DIR, or --from-hf HF_DIR --save SAVE_DIR")
    for flag, destination in (("--output", args.output), ("--save", args.save)):
        # Before anything is read (a large checkpoint takes minutes): an occupied output is refused, and
        # --overwrite replaces only a regular file or a folder this project wrote.
        if destination is not None:
            try:
                check_output_folder(destination, flag, args.overwrite, recognise=older_output)
            except OutputError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
    try:
        if args.load:
            if not args.output:
                parser.error("--load needs --output (the Hugging Face folder to write)")
            if args.verify_samples < 1:
                parser.error("--verify-samples must be >= 1")
            export_to_hf(args.load, args.output, args.tag, args.vocab_file, args.verify, args.data_path,
                         args.verify_samples, args.format, args.overwrite, log, args.checksums)
        else:
            if not args.save:
                parser.error("--from-hf needs --save (the checkpoint directory to write)")
            check_family("--from-hf", args.from_hf, "convert_checkpoint --from-hf", error=ConversionError)
            import_from_hf(args.from_hf, args.save, args.tensor_model_parallel_size,
                           args.make_vocab_size_divisible_by, args.add_rel_pos, objective=args.objective,
                           overwrite=args.overwrite, log=log)
    except VerificationFailed as failure:
        print(f"error: verification failed, nothing written: {failure}", file=sys.stderr)
        return 1
    except (ConversionError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    sys.exit(main())
