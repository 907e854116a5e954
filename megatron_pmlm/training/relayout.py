"""Resuming on another tensor/pipeline-parallel layout (`--universal-checkpoint`), optimizer state
and schedule kept: the check made before anything is built, and the re-sharding of a ZeRO-1/2
checkpoint into DeepSpeed's universal format for the layout of this run.

DeepSpeed's universal *loading* is used as it is: every rank reads each of its parameters' full
fp32 weight, Adam moments and step from `zero/<parameter name>/` and takes its tensor-parallel
slice and its ZeRO partition. The *conversion* (`ds_to_universal`) is ours when the layout changes,
because DeepSpeed's cannot express three things of our models:
- the output bias `cls.predictions.bias` is split and padded with the vocabulary; DeepSpeed strips
  and re-pads only 2-D vocabulary tensors (`param[:vocab, :]`), so a TP 2 -> 1 resume would meet a
  bias of the old padded size;
- the pipeline stages name their parameters by layer index (`3.attention.self.query.weight`) and
  the plain model by module path (`bert.encoder.layer.1.attention.self.query.weight`), and DeepSpeed
  finds a parameter's folder by the name the loading model gives it;
- which parameters are split along which dimension is ours already (`parallel.layers.
  TENSOR_PARALLEL_SPLITS`, the converter's), so the merge uses that, not regex patterns.
The ZeRO partitions are read from the optimizer files' own fragment maps (`param_slice_mappings`),
as DeepSpeed's converter reads them. ZeRO-0 keeps its optimizer in the model file and ZeRO-3
partitions differently: both are refused with what to do instead.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ConfigError
from ..parallel.deepspeed_import import import_deepspeed
from .checkpoint_files import RUN_STATE_FILE, UNIVERSAL_SUFFIX, CheckpointError
from . import heartbeat

OPTIMIZER_STATES = ("fp32", "exp_avg", "exp_avg_sq")
"""What DeepSpeed's universal loader reads per parameter, besides `step`."""
VOCABULARY_SUFFIXES = ("word_embeddings.weight", "predictions.bias")
"""Parameters with one row per (padded) vocabulary entry: their padding follows the TP size."""
RESHARDED_ZERO_STAGES = (1, 2)


def layout_name(tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    return f"TP {tensor_parallel_size} x PP {pipeline_parallel_size}"


def saved_layout(run_state: dict[str, Any]) -> tuple[int, int]:
    """(tensor-parallel size, pipeline-parallel size) a checkpoint was written with."""
    args = run_state.get("args", {}) or {}
    return int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)


def relayout_tag(tag: str, tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """The folder a checkpoint is re-sharded into for one layout, next to it (`iter_N_universal_tp1_pp1`)."""
    return f"{tag}{UNIVERSAL_SUFFIX}_tp{tensor_parallel_size}_pp{pipeline_parallel_size}"


def check_resume_layout(args: Any, tensor_parallel_size: int, pipeline_parallel_size: int, zero_stage: int) -> None:
    """Before any process starts: a resume whose newest checkpoint was written with another
    tensor/pipeline layout needs --universal-checkpoint, ZeRO-1/2 on both sides, and no --finetune.
    Refusals are one line naming the saved and the requested layout and what to do."""
    if not getattr(args, "load", None):
        return
    from .checkpoint_files import newest_run_state

    saved = newest_run_state(Path(args.load))
    if saved is None:
        return
    then, now = saved_layout(saved), (tensor_parallel_size, pipeline_parallel_size)
    if then == now:
        return
    change = f"{layout_name(*then)} -> {layout_name(*now)}"
    where = f"{args.load} was saved with {layout_name(*then)}, this run asks for {layout_name(*now)}"
    keep = f"--tensor-model-parallel-size {then[0]} --pipeline-model-parallel-size {then[1]}"
    if args.finetune:
        # tools/convert_checkpoint.py --from-hf writes tensor-parallel shards, never pipeline stages.
        convert = (f", or convert it (tools/convert_checkpoint.py --load DIR --output HF, then --from-hf HF --save "
                   f"CKPT --tensor-model-parallel-size {now[0]}) and --finetune from CKPT") if now[1] == 1 else ""
        raise ConfigError(f"{where}: --finetune reads the weights back in the saved layout only; run with {keep}"
                          + convert)
    if not args.universal_checkpoint:
        raise ConfigError(f"{where} ({change}): add --universal-checkpoint to re-shard its weights and optimizer "
                          f"state for this layout, or resume with {keep}")
    saved_zero = int((saved.get("training_config") or {}).get("zero_stage") or 0)
    if saved_zero not in RESHARDED_ZERO_STAGES:
        raise ConfigError(f"{where} ({change}) with ZeRO-{saved_zero}: --universal-checkpoint re-shards ZeRO-1/2 "
                          f"optimizer partitions only; resume with {keep}, or take its weights only through "
                          "tools/convert_checkpoint.py and --finetune (fresh optimizer and schedule)")
    if zero_stage not in RESHARDED_ZERO_STAGES:
        raise ConfigError(f"{where} ({change}): --universal-checkpoint re-shards into ZeRO-1/2 optimizer partitions; "
                          f"use --zero-stage 1 or 2 (this run has ZeRO-{zero_stage})")


# ------------------------------------------------------------------------------------------------
# Parameter names: the plain model's (canonical) and the pipeline stages'
# ------------------------------------------------------------------------------------------------

def pipeline_parameter_name(canonical: str, num_layers: int) -> str:
    """The plain model's parameter name -> the pipeline stages' (the inverse of
    `models.pipeline.canonical_parameter_name`)."""
    from ..models.pipeline import TIED_KEY

    if canonical == "bert.embeddings.word_embeddings.weight":
        return f"tied_modules.{TIED_KEY}.word_embeddings.weight"
    if canonical.startswith("bert.embeddings."):
        return "1." + canonical[len("bert.embeddings."):]
    if canonical.startswith("bert.rel_pos_bias."):
        return "1." + canonical[len("bert."):]
    layer = re.fullmatch(r"bert\.encoder\.layer\.(\d+)\.(.*)", canonical)
    if layer:
        return f"{int(layer.group(1)) + 2}.{layer.group(2)}"
    if canonical.startswith("bert.pooler."):
        return f"{num_layers + 2}.{canonical[len('bert.'):]}"
    if canonical.startswith("cls.predictions.transform."):
        return f"{num_layers + 2}.{canonical[len('cls.predictions.'):]}"
    if canonical.startswith("cls.predictions."):
        return f"{num_layers + 4}.{canonical[len('cls.predictions.'):]}"
    if canonical.startswith("cls.seq_relationship."):
        return f"{num_layers + 4}.{canonical[len('cls.'):]}"
    raise ValueError(f"no pipeline parameter for {canonical!r}")


# ------------------------------------------------------------------------------------------------
# Reading the ZeRO-1/2 partitions back to full tensors
# ------------------------------------------------------------------------------------------------

def _optimizer_file(tag_dir: Path, data_parallel_rank: int, model_parallel_rank: int) -> Path:
    name = f"zero_pp_rank_{data_parallel_rank}_mp_rank_{model_parallel_rank:02d}_optim_states.pt"
    for candidate in (tag_dir / name, tag_dir / f"bf16_{name}"):
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"{tag_dir / name} is missing: the checkpoint is incomplete")


def _read_shard_states(tag_dir: Path, model_parallel_rank: int, data_parallel_size: int, canonical: Callable[[str], str]
                       ) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
    """One model-parallel rank's (one TP rank of one stage) full fp32 weights and Adam moments,
    {state: {canonical name: tensor}}, from its data-parallel ranks' ZeRO partitions; and the step."""
    from .checkpoint_reader import torch_load

    model_states = torch_load(tag_dir / f"mp_rank_{model_parallel_rank:02d}_model_states.pt")
    shapes = {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {state: defaultdict(list) for state in OPTIMIZER_STATES}
    step = None
    for data_parallel_rank in range(data_parallel_size):
        path = _optimizer_file(tag_dir, data_parallel_rank, model_parallel_rank)
        optimizer = torch_load(path)["optimizer_state_dict"]
        heartbeat.progress()  # one data-parallel partition read
        try:
            groups = zip(optimizer["param_slice_mappings"], optimizer["single_partition_of_fp32_groups"],
                         optimizer["base_optimizer_state"]["state"].values())
        except KeyError as error:
            raise CheckpointError(f"{path} has no {error} (not a ZeRO-1/2 optimizer partition)") from None
        for fragments, fp32, adam in groups:
            step = adam.get("step", step)
            flat = {"fp32": fp32, "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
            for name, fragment in fragments.items():  # in data-parallel order: concatenated below
                for state, tensor in flat.items():
                    pieces[state][name].append(tensor.narrow(0, fragment.start, fragment.numel))
    return ({state: {canonical(name): torch.cat(parts).view(shapes[name]).float() for name, parts in by_name.items()}
             for state, by_name in pieces.items()}, step)


def _resize_vocabulary(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The padded vocabulary rows of another TP size: cut, or zero rows added (padding entries are
    never looked up and their logits are -inf, so their weights and moments stay zero)."""
    if tensor.shape[0] >= rows:
        return tensor[:rows].clone()
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def relayout_to_universal(tag_dir: Path, run_state: dict[str, Any], tensor_parallel_size: int,
                          pipeline_parallel_size: int, embedding_rows: int, log: Callable[[str], None]) -> Path:
    """Re-shard `tag_dir` (ZeRO-1/2, any TP x PP x DP) into DeepSpeed's universal format for a run
    of `tensor_parallel_size` x `pipeline_parallel_size` (any DP) whose vocabulary is padded to
    `embedding_rows`, next to it (written under a temporary name and renamed)."""
    import_deepspeed()
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM

    from ..models.pipeline import canonical_parameter_name
    from ..parallel.layers import merge_state_dicts, tensor_parallel_split_dim

    target = tag_dir.with_name(relayout_tag(tag_dir.name, tensor_parallel_size, pipeline_parallel_size))
    if (target / RUN_STATE_FILE).is_file():
        return target
    saved_tp, saved_pp = saved_layout(run_state)
    data_parallel_size = int(run_state.get("data_parallel_size") or 1)
    num_layers = int(run_state["args"]["model_config"]["num_layers"])
    saved_rows = int(run_state["args"]["model_config"].get("padded_vocab_size")
                     or run_state["args"]["model_config"]["vocab_size"])
    log(f"re-sharding {tag_dir} ({layout_name(saved_tp, saved_pp)}, data-parallel size {data_parallel_size}) for "
        f"{layout_name(tensor_parallel_size, pipeline_parallel_size)} into {target}")

    def canonical(name: str) -> str:
        return canonical_parameter_name(name, num_layers) if saved_pp > 1 else name

    # Model-parallel ranks are numbered stage-major: rank = stage x TP size + TP rank.
    per_tp_rank: list[dict[str, dict[str, torch.Tensor]]] = [{s: {} for s in OPTIMIZER_STATES} for _ in range(saved_tp)]
    step = None
    for model_parallel_rank in range(saved_tp * saved_pp):
        heartbeat.beat(f"start-up: universal conversion of {tag_dir.name}, reading model-parallel rank "
                       f"{model_parallel_rank}")
        states, step = _read_shard_states(tag_dir, model_parallel_rank, data_parallel_size, canonical)
        for state, tensors in states.items():
            for name, tensor in tensors.items():  # the tied embedding: on the first and the last stage
                per_tp_rank[model_parallel_rank % saved_tp][state].setdefault(name, tensor)

    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    zero = staging / "zero"
    full = {state: merge_state_dicts([rank[state] for rank in per_tp_rank]) for state in OPTIMIZER_STATES}
    heartbeat.beat(f"start-up: universal conversion of {tag_dir.name}, writing parameters")
    for name in full["fp32"]:
        heartbeat.progress()
        folder_name = pipeline_parameter_name(name, num_layers) if pipeline_parallel_size > 1 else name
        folder = zero / folder_name
        folder.mkdir(parents=True)
        vocabulary = name.endswith(VOCABULARY_SUFFIXES) and full["fp32"][name].shape[0] == saved_rows
        for state in OPTIMIZER_STATES:
            tensor = full[state][name]
            if vocabulary:
                tensor = _resize_vocabulary(tensor, embedding_rows)
            # DeepSpeed's loader keeps a tensor whole when its shape is the rank's, else chunks along CAT_DIM.
            torch.save({PARAM: tensor, CAT_DIM: tensor_parallel_split_dim(name) or 0}, folder / f"{state}.pt")
        torch.save(step, folder / "step.pt")

    # What the optimizer keeps beside the partitions (loss scale, clipping, hyper-parameters per group).
    from .checkpoint_reader import torch_load

    optimizer = torch_load(_optimizer_file(tag_dir, 0, 0))["optimizer_state_dict"]
    common = {k: v for k, v in optimizer.items()
              if k not in ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")}
    common["param_groups"] = optimizer["base_optimizer_state"]["param_groups"]
    torch.save(common, zero / "optimizer_state.pt")
    # The model-state files carry the schedule and client state DeepSpeed restores (not the weights).
    for path in tag_dir.glob("mp_rank_*_model_states.pt"):
        _link_or_copy(path, staging / path.name)
    for path in [tag_dir / RUN_STATE_FILE, *tag_dir.glob("rng_state_rank*.pt")]:
        shutil.copy2(path, staging / path.name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def _link_or_copy(source: Path, destination: Path) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
