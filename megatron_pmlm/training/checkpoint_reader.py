"""The one reader of our checkpoints: any layout a training run writes (ZeRO 0-3, tensor and/or
pipeline parallel) back to the full fp32 state dict, with the run state saved beside it. Used by
conversion (hf/convert.py and its adapters), fine-tuning and decoding (pretrained.py).

Which checkpoint: `resolve_tag` (a named tag, or the one DIR/latest names), verified there before
anything is read: every file of its manifest must have the checksum it was saved with (as a
resume checks, with the same checkpoint_files.newest_verified_checkpoint). A damaged checkpoint
`latest` names is passed over for the newest one that verifies, naming the bad file and the tag
used; a damaged `--tag` is refused; `checksums=False` (`--no-checksums`) skips the check, saying
so. Bad input raises `ConversionError`, whose message names the culprit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ConfigError, ModelConfig
from ..files import read_json
from ..parallel.deepspeed_import import import_deepspeed
from .checkpoint_files import LATEST_FILE, RUN_STATE_FILE, checkpoint_problem, checksum_note, newest_verified_checkpoint


class ConversionError(ValueError):
    """Bad input for reading or converting a checkpoint: the message names the file, key or option at fault."""


@dataclasses.dataclass
class PretrainingCheckpoint:
    """One checkpoint of ours, as the full (TP=1, PP=1, padded-vocabulary) fp32 state dict."""

    directory: Path
    tag: str
    run_state: dict[str, Any]
    model_config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    layout: str
    """What was read, for the log: e.g. 'ZeRO-3, data parallel 2, tensor parallel 1, pipeline 1'."""

    @property
    def tag_dir(self) -> Path:
        return self.directory / self.tag


def torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file: say which
        raise ConversionError(f"{path} cannot be read ({type(error).__name__}: {error})") from None


def warn(message: str) -> None:
    """Where the reader's notes go by default: stderr (a decode may write its output to stdout)."""
    print(message, file=sys.stderr, flush=True)


def _existing_tag(load_dir: Path, tag: str | None) -> str:
    """`tag`, or the one DIR/latest names; refused when it is not there."""
    if not load_dir.is_dir():
        raise ConversionError(f"checkpoint directory {load_dir} does not exist")
    if tag is None:
        latest = load_dir / LATEST_FILE
        if not latest.is_file():
            tags = sorted(p.name for p in load_dir.iterdir() if p.is_dir() and (p / RUN_STATE_FILE).is_file())
            if tags:
                raise ConversionError(f"{load_dir} has no '{LATEST_FILE}' file (the last save did not complete); "
                                      f"name a checkpoint with --tag, one of: {', '.join(tags)}")
            raise ConversionError(f"no checkpoint in {load_dir}: neither a '{LATEST_FILE}' file nor checkpoint "
                                  "folders (the --save directory of a pre-training run)")
        tag = latest.read_text().strip()
        if not (load_dir / tag).is_dir():
            raise ConversionError(f"{latest} names {tag!r} but {load_dir / tag} does not exist")
    elif not (load_dir / tag).is_dir():
        tags = sorted(p.name for p in load_dir.iterdir() if p.is_dir() and (p / RUN_STATE_FILE).is_file())
        raise ConversionError(f"--tag {tag}: {load_dir / tag} does not exist"
                              + (f" (there are: {', '.join(tags)})" if tags else " (no checkpoints there)"))
    return tag


def resolve_tag(load_dir: str | os.PathLike, tag: str | None = None, checksums: bool | None = True,
                log: Callable[[str], None] = warn) -> tuple[Path, str]:
    """(checkpoint directory, tag): `tag`, or the one DIR/latest names, verified (see the module's
    docstring). `checksums`: False skips the check and says so; None: the caller has verified
    this very tag already (it came from resolve_tag), nothing is checked or said."""
    load_dir = Path(load_dir)
    named = tag
    tag = _existing_tag(load_dir, tag)
    if checksums is None:
        return load_dir, tag
    if not checksums:
        log(f"not checking the checksums of {load_dir / tag} (--no-checksums)")
        return load_dir, tag
    if named is not None:
        problem = checkpoint_problem(load_dir / tag, contents=True)
        if problem:
            raise ConversionError(f"--tag {tag}: {load_dir / tag} fails its check: {problem} (tools/verify_checkpoint.py "
                                  f"{load_dir} lists those that pass; --no-checksums reads it anyway)")
        note = checksum_note(load_dir / tag)
    else:
        chosen, skipped, note = newest_verified_checkpoint(load_dir, first=tag)
        if chosen is None:
            raise ConversionError(f"no checkpoint in {load_dir} passes its check: {'; '.join(skipped)} (--no-checksums "
                                  "reads the one 'latest' names anyway)")
        if chosen != tag:
            log(f"warning: {'; '.join(skipped)}; using {load_dir / chosen}, the newest checkpoint that verifies")
        tag = chosen
    if note:
        log(note)
    return load_dir, tag


def run_state_of(load_dir: str | os.PathLike, tag: str | None = None, checksums: bool | None = True,
                 log: Callable[[str], None] = warn) -> tuple[Path, str, dict[str, Any]]:
    directory, tag = resolve_tag(load_dir, tag, checksums, log)
    return directory, tag, read_json(directory / tag / RUN_STATE_FILE, ConversionError,
                                     missing=f"{directory / tag} is not a megatron-pmlm checkpoint")


def read_run_state(tag_dir: Path) -> tuple[dict[str, Any], ModelConfig]:
    path = tag_dir / RUN_STATE_FILE
    run_state = read_json(path, ConversionError,
                          missing=f"{tag_dir} is not a megatron-pmlm checkpoint (or an incomplete one)")
    saved = run_state.get("args", {}).get("model_config") if isinstance(run_state, dict) else None
    if not isinstance(saved, dict):
        raise ConversionError(f"{path} has no args.model_config: not a megatron-pmlm checkpoint")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ConversionError(f"{path}: args.model_config has fields this version does not know: {', '.join(unknown)}")
    try:
        # The weights do not depend on the attention backend the run computed with; whoever reads
        # them (conversion, fine-tuning) gets the default one and may choose again.
        config = ModelConfig(**{**saved, "attention_backend": ModelConfig.attention_backend})
    except (ConfigError, TypeError) as error:
        raise ConversionError(f"{path}: invalid args.model_config ({error})") from None
    return run_state, config


def _drop_extra_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """megatron-core layers add `*._extra_state` entries (not weights)."""
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


def _rank_files(tag_dir: Path, pattern: re.Pattern, what: str, expected: int) -> list[Path]:
    """Files whose name matches `pattern` (group 1: the rank), one per rank 0..expected-1, or an error."""
    found: dict[int, Path] = {}
    for path in tag_dir.iterdir():
        match = pattern.fullmatch(path.name)
        if match:
            found[int(match.group(1))] = path
    missing = [r for r in range(expected) if r not in found]
    if missing:
        example = pattern.pattern.replace(r"(\d+)", f"{missing[0]:02d}").replace("\\", "")
        raise ConversionError(f"{tag_dir}: {what} rank(s) {', '.join(map(str, missing))} of {expected} missing "
                              f"(no {example}); the checkpoint is incomplete")
    extra = sorted(r for r in found if r >= expected)
    if extra:
        raise ConversionError(f"{tag_dir}: {what} files for rank(s) {', '.join(map(str, extra))}, but run_state.json "
                              f"says {what} size {expected}: mismatched shards")
    return [found[r] for r in range(expected)]


def read_module_states(tag_dir: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    """ZeRO 0-2, no pipeline: mp_rank_NN_model_states.pt['module'] per tensor-parallel rank."""
    shards = []
    for path in _rank_files(tag_dir, re.compile(r"mp_rank_(\d+)_model_states\.pt"), "tensor-parallel", tp):
        module = torch_load(path).get("module")
        if not isinstance(module, dict) or not module:
            raise ConversionError(f"{path} holds no module weights")
        shards.append(_drop_extra_state(module))
    return shards


def read_zero_states(tag_dir: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    """ZeRO (stage 3, or 1/2 with fp16/bf16 weights): DeepSpeed's consolidation of the fp32
    partitions, one tensor-parallel rank at a time (zero_to_fp32 expects one model-parallel rank
    per folder: each rank's files are linked into a scratch folder)."""
    import_deepspeed()
    from deepspeed.utils import zero_to_fp32

    shards = []
    with tempfile.TemporaryDirectory(prefix="pmlm-zero-") as scratch:
        for rank in range(tp):
            suffix = f"mp_rank_{rank:02d}_"
            files = [p for p in tag_dir.iterdir() if suffix in p.name and p.name.endswith(
                ("_model_states.pt", "_optim_states.pt"))]
            if not any(p.name.endswith("_optim_states.pt") for p in files):
                raise ConversionError(f"{tag_dir}: no *_{suffix}optim_states.pt files (the ZeRO partitions of "
                                      f"tensor-parallel rank {rank} of {tp}): the checkpoint is incomplete")
            if not any(p.name.endswith("_model_states.pt") for p in files):
                raise ConversionError(f"{tag_dir}: no *_{suffix}model_states.pt file (tensor-parallel rank {rank} "
                                      f"of {tp}): the checkpoint is incomplete")
            folder = Path(scratch) / f"rank{rank}"
            folder.mkdir()
            for path in files:
                os.symlink(path.resolve(), folder / path.name)
            log = io.StringIO()
            try:
                with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                    state = zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint(str(folder), False)
                    state = zero_to_fp32.to_torch_tensor(state)
            except (ValueError, FileNotFoundError, KeyError, AssertionError, RuntimeError) as error:
                raise ConversionError(f"{tag_dir}: DeepSpeed could not consolidate the ZeRO partitions of "
                                      f"tensor-parallel rank {rank} ({type(error).__name__}: {error})") from None
            shards.append(_drop_extra_state({k: v.float() if v.is_floating_point() else v for k, v in state.items()}))
    return shards


_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")


def read_pipeline_states(tag_dir: Path, tp: int, config: ModelConfig) -> list[dict[str, torch.Tensor]]:
    """DeepSpeed pipeline layout: layer_XX-model_YY-model_states.pt, names relative to layer XX."""
    from ..models.pipeline import TIED_KEY, canonical_parameter_name

    num_layers = config.num_layers
    tied_indices = (0, num_layers + 3)
    files: dict[tuple[int, int], Path] = {}
    for path in tag_dir.iterdir():
        match = _LAYER_FILE.fullmatch(path.name)
        if match:
            files[int(match.group(1)), int(match.group(2))] = path
    if not files:
        raise ConversionError(f"{tag_dir}: no layer_XX-model_YY-model_states.pt files, but run_state.json says "
                              "pipeline parallel: the checkpoint is incomplete")
    layer_indices = sorted({index for index, _ in files})
    # The layers that hold weights: the word embedding (0, or its tied copy), 1, every transformer
    # layer, the head transform and the loss (output bias); index L+3 is the tied softmax.
    needed = [1, *range(2, num_layers + 2), num_layers + 2, num_layers + 4]
    for index in needed + [None]:
        indices = [0, num_layers + 3] if index is None else [index]
        for rank in range(tp):
            if not any((i, rank) in files for i in indices):
                which = "the word embedding (layer_00)" if index is None else f"layer_{index:02d}"
                raise ConversionError(f"{tag_dir}: {which} of tensor-parallel rank {rank} is missing "
                                      f"(no layer_{indices[0]:02d}-model_{rank:02d}-model_states.pt): the "
                                      "checkpoint is incomplete")
    extra_ranks = sorted({rank for _, rank in files if rank >= tp})
    if extra_ranks:
        raise ConversionError(f"{tag_dir}: layer files for tensor-parallel rank(s) {extra_ranks}, but run_state.json "
                              f"says tensor parallel size {tp}: mismatched shards")
    unknown = [i for i in layer_indices if i > num_layers + 4]
    if unknown:
        raise ConversionError(f"{tag_dir}: layer_{unknown[0]:02d} files, but a {num_layers}-layer model has pipeline "
                              f"layers 0-{num_layers + 4}: a checkpoint of another model")
    shards = []
    for rank in range(tp):
        state: dict[str, torch.Tensor] = {}
        for index in layer_indices:
            if (index, rank) not in files:
                continue
            layer_state = _drop_extra_state(torch_load(files[index, rank]))
            for name, tensor in layer_state.items():
                pipe_name = (f"tied_modules.{TIED_KEY}.{name}" if index in tied_indices else f"{index}.{name}")
                try:
                    canonical = canonical_parameter_name(pipe_name, num_layers)
                except ValueError as error:
                    raise ConversionError(f"{files[index, rank]}: {error}") from None
                if canonical in state:  # the tied softmax: the same weight as the embedding, stored once
                    continue
                state[canonical] = tensor
        shards.append(state)
    return shards


def expected_shapes(config: ModelConfig, nsp_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every parameter of PMLMForPreTraining(config) (TP=1) and its shape, without building it;
    `nsp_head`: the UniLM v1 objectives' pooler and next-sentence head (BertForPreTraining names)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "bert.embeddings.word_embeddings.weight": (config.embedding_rows, h),
        "bert.embeddings.position_embeddings.weight": (config.max_position_embeddings, h),
        "bert.embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
        "bert.embeddings.LayerNorm.weight": (h,), "bert.embeddings.LayerNorm.bias": (h,),
    }
    if config.rel_pos:
        shapes["bert.rel_pos_bias.weight"] = (config.num_attention_heads, config.rel_pos_bins)
    for i in range(config.num_layers):
        p = f"bert.encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (h, h)
            shapes[f"{p}attention.self.{name}.bias"] = (h,)
        shapes.update({f"{p}attention.output.dense.weight": (h, h), f"{p}attention.output.dense.bias": (h,),
                       f"{p}attention.output.LayerNorm.weight": (h,), f"{p}attention.output.LayerNorm.bias": (h,),
                       f"{p}intermediate.dense.weight": (f, h), f"{p}intermediate.dense.bias": (f,),
                       f"{p}output.dense.weight": (h, f), f"{p}output.dense.bias": (h,),
                       f"{p}output.LayerNorm.weight": (h,), f"{p}output.LayerNorm.bias": (h,)})
    shapes.update({"cls.predictions.bias": (config.embedding_rows,),
                   "cls.predictions.transform.dense.weight": (h, h), "cls.predictions.transform.dense.bias": (h,),
                   "cls.predictions.transform.LayerNorm.weight": (h,),
                   "cls.predictions.transform.LayerNorm.bias": (h,)})
    if nsp_head:
        shapes.update({"bert.pooler.dense.weight": (h, h), "bert.pooler.dense.bias": (h,),
                       "cls.seq_relationship.weight": (2, h), "cls.seq_relationship.bias": (2,)})
    return shapes


def trained_with_nsp_head(run_state: dict[str, Any]) -> bool:
    """Whether the run's objective (UniLM v1 with the bidirectional LM) has the next-sentence head."""
    from ..models.objectives import OBJECTIVES

    objective = OBJECTIVES.get(run_state.get("args", {}).get("objective") or "ae+par")
    return bool(objective is not None and objective.next_sentence_prediction)


def has_nsp_head(state: dict[str, torch.Tensor]) -> bool:
    return "cls.seq_relationship.weight" in state


def check_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, source: str,
                     nsp_head: bool = False) -> None:
    """The state dict is exactly the model's: same names and shapes, else an error naming them."""
    expected = expected_shapes(config, nsp_head)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} weight(s): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        raise ConversionError(f"{source} does not hold the model its run_state.json describes (a checkpoint of "
                              f"another model?): {'; '.join(parts)}")
    wrong = [f"{k} {tuple(state[k].shape)} (expected {v})" for k, v in expected.items() if tuple(state[k].shape) != v]
    if wrong:
        raise ConversionError(f"{source}: weights of the wrong shape for the model in run_state.json: "
                              f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")


def load_pretraining_checkpoint(load_dir: str | os.PathLike, tag: str | None = None, checksums: bool | None = True,
                                log: Callable[[str], None] = warn) -> PretrainingCheckpoint:
    """The full fp32 state dict of any checkpoint our pre-training writes (which one, and its
    verification: `resolve_tag`)."""
    from ..parallel.layers import merge_state_dicts

    directory, tag = resolve_tag(load_dir, tag, checksums, log)
    tag_dir = directory / tag
    run_state, config = read_run_state(tag_dir)
    args = run_state.get("args", {})
    training = run_state.get("training_config", {})
    tp = int(args.get("tensor_model_parallel_size") or 1)
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    zero_stage = int(training.get("zero_stage") or 0)
    precision = training.get("precision", "fp32")
    if pp > 1:
        shards = read_pipeline_states(tag_dir, tp, config)
        source = "pipeline layer files"
    elif zero_stage == 3 or (zero_stage > 0 and precision != "fp32"):
        shards = read_zero_states(tag_dir, tp)
        source = "ZeRO fp32 partitions (DeepSpeed zero_to_fp32)"
    else:
        shards = read_module_states(tag_dir, tp)
        source = "mp_rank model states"
    names = set(shards[0])
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard) != names:
            raise ConversionError(f"{tag_dir}: tensor-parallel rank {rank} holds different weights than rank 0 "
                                  f"({', '.join(sorted(names ^ set(shard))[:4])}): mismatched shards")
    try:
        state = merge_state_dicts(shards)
    except RuntimeError as error:
        raise ConversionError(f"{tag_dir}: tensor-parallel shards do not fit together ({error})") from None
    state = {k: v.detach().float().contiguous() for k, v in state.items()}
    check_state_dict(state, config, str(tag_dir), trained_with_nsp_head(run_state))
    layout = (f"ZeRO-{zero_stage}, {precision}, data parallel {run_state.get('data_parallel_size', '?')}, "
              f"tensor parallel {tp}, pipeline parallel {pp}; read from the {source}")
    return PretrainingCheckpoint(directory, tag, run_state, config, state, layout)
