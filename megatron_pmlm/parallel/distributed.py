"""Process groups: ranks from torchrun / deepspeed / srun / MPI, megatron-core's parallel state,
and the `mpu` view of it that DeepSpeed consumes (kept in agreement, and checked).

With tensor and pipeline size 1 (every rank a whole model: data parallel only) megatron-core is not
imported at all: its import costs ~3 s per process start (more than torch and DeepSpeed together),
paid at every restart of a job, for groups that are then the world and one group of one rank per
rank; `DataParallelMPU` answers DeepSpeed's questions from torch.distributed instead.

Rank layout (megatron-core's default order tp-dp-pp, identical to DeepSpeed's
PipeModelDataParallelTopology axes pipe-data-model):
    rank = tp_rank + tp_size * (dp_rank + dp_size * pp_rank)
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from ..config import ConfigError
from .deepspeed_import import import_deepspeed


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("tensor and pipeline parallel sizes must be >= 1")
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.world_size % model_parallel:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by tensor parallel size "
                f"{self.tensor_parallel_size} x pipeline parallel size {self.pipeline_parallel_size}")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        tp = rank % self.tensor_parallel_size
        dp = rank // self.tensor_parallel_size % self.data_parallel_size
        pp = rank // (self.tensor_parallel_size * self.data_parallel_size)
        return tp, dp, pp


def _env_from_launcher() -> None:
    """Map SLURM or Open MPI rank variables to the torch.distributed ones if no launcher set them."""
    if "RANK" in os.environ:
        return
    for rank_key, size_key, local_key in (("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
                                          ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                           "OMPI_COMM_WORLD_LOCAL_RANK"),
                                          ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")):
        if rank_key in os.environ:
            os.environ["RANK"] = os.environ[rank_key]
            os.environ["WORLD_SIZE"] = os.environ.get(size_key, "1")
            os.environ["LOCAL_RANK"] = os.environ.get(local_key, "0")
            if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
                raise ConfigError(
                    f"launched by {rank_key.split('_')[0]} without MASTER_ADDR/MASTER_PORT; export them "
                    "(slurm/pretrain_base.sh derives MASTER_ADDR from `scontrol show hostnames`)")
            return
    # A lone process: a world of one.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


DEFAULT_TIMEOUT_MINUTES = 10
"""How long a collective may wait before the process group fails (and the job can requeue):
long enough for a checkpoint save or a slow data-loader start, short next to a hung job."""


def launcher_rank() -> int:
    """This process's global rank as the launcher set it (before torch.distributed exists)."""
    for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def launcher_world_size() -> int:
    """The number of processes as the launcher set it (before torch.distributed exists)."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if key in os.environ:
            return int(os.environ[key])
    return 1


def quiet_other_ranks() -> None:
    """Start-up warnings (missing optional kernels, DeepSpeed notices) once per job, not once per
    GPU: every rank but 0 drops Python warnings and DeepSpeed's info/warning logs."""
    if launcher_rank() != 0:
        warnings.simplefilter("ignore")
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def local_device_index(local_rank: int, visible_devices: int) -> int:
    """The GPU of a local rank: every GPU of the node visible (index = local rank), or a site that
    binds one GPU per task (one visible, index 0) — local rank modulo the visible count."""
    if visible_devices < 1:
        raise RuntimeError("CUDA is available but no GPU is visible to this process")
    return local_rank % visible_devices


def init_distributed(backend: str | None = None, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> None:
    """torch.distributed through DeepSpeed (gloo on CPU, nccl on GPU)."""
    deepspeed = import_deepspeed()

    if dist.is_available() and dist.is_initialized():
        return
    _env_from_launcher()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_device_index(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()))
    else:
        # On the CPU, DeepSpeed JIT-compiles a shared-memory all-reduce (used by its inference
        # engine, not by training) at every start, under a file lock that a process killed at that
        # moment leaves behind; every later start then waits on it forever. Training skips it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timedelta(minutes=timeout_minutes))


COLLECTIVE_WORKERS_DRAIN_SECONDS = 0.1
"""How long `end_distributed` lets gloo's worker threads run, the GIL free, before the groups go."""


def end_distributed() -> None:
    """End megatron-core's groups and every torch.distributed process group, if any are open.

    Left to interpreter teardown, a process group's C++ threads can outlive their owner: a run that
    finished can then abort at exit ("terminate called without an active exception", SIGABRT),
    which fails the launcher and, on a cluster, requeues a finished job. A core dump of one (a
    2-process gloo run on a loaded machine, ~1 exit in 30) showed how: a gloo worker thread
    (`ProcessGroupGloo::runLoop`) drops a finished collective only after the thread that waited for
    it has moved on; the last barrier's work holds an earlier all-reduce whose tensors are Python
    objects, and dropping them needs the GIL. Reached during interpreter teardown (the main thread
    in its final garbage collection, where DeepSpeed's reference cycles let go of the groups),
    taking the GIL ends the thread by a forced unwind through a noexcept destructor: std::terminate.
    So the workers get the GIL for a moment first, and the groups are freed here, not at teardown."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    time.sleep(COLLECTIVE_WORKERS_DRAIN_SECONDS)  # releases the GIL: the workers drop what they hold
    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    DataParallelMPU.destroy_groups()
    dist.destroy_process_group()
    gc.collect()  # what still holds a group through a reference cycle lets go now, workers idle


Main = TypeVar("Main", bound=Callable[..., int])


def ends_process_groups(main: Main) -> Main:
    """Decorate an entry point's `main`: whatever way it leaves (a result, an error, a signal turned
    into an early return), the process groups it opened are ended before the interpreter exits."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
        except BaseException:
            try:
                end_distributed()
            except Exception:  # noqa: BLE001 (the error already on its way out is the one to report)
                pass
            raise
        end_distributed()
        return result

    return wrapper  # type: ignore[return-value]


def initialize_model_parallel(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                              timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> ParallelLayout:
    """Initialise torch.distributed and the model-parallel groups (all with `timeout_minutes`):
    megatron-core's, or with tensor and pipeline size 1 `DataParallelMPU`'s (see the module
    docstring). `model_parallel_unit()` then gives DeepSpeed's `mpu` view of them."""
    if timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes must be positive, got {timeout_minutes}")
    init_distributed(timeout_minutes=timeout_minutes)
    layout = ParallelLayout(dist.get_world_size(), tensor_parallel_size, pipeline_parallel_size)
    if tensor_parallel_size == pipeline_parallel_size == 1 and not _megatron_initialized():
        DataParallelMPU.create_groups(timeout_minutes)
        return layout
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() != tensor_parallel_size
                or parallel_state.get_pipeline_model_parallel_world_size() != pipeline_parallel_size):
            raise ConfigError("model parallel state already initialised with other sizes")
        return layout
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        distributed_timeout_minutes=max(1, round(timeout_minutes)))
    check_layout_agrees(layout)
    return layout


def _megatron_initialized() -> bool:
    """Whether megatron-core's groups exist in this process (never imports it)."""
    if "megatron.core" not in sys.modules:
        return False
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def model_parallel_unit():
    """DeepSpeed's `mpu` for the groups `initialize_model_parallel` made: `MegatronMPU` where
    megatron-core's groups exist, else `DataParallelMPU`."""
    return MegatronMPU() if _megatron_initialized() else DataParallelMPU()


class DataParallelMPU:
    """The `mpu` interface DeepSpeed queries, for tensor and pipeline size 1: the model-parallel
    group of a rank is a group of that rank alone (as megatron-core's tensor-parallel groups are at
    size 1: gradient norms are not summed over replicas), the data-parallel group is the world."""

    _model_parallel_group = None
    """This rank's one-rank group (`create_groups`, once per process)."""

    @classmethod
    def create_groups(cls, timeout_minutes: float) -> None:
        """Every rank's one-rank group; each rank takes part in making each (torch.distributed's rule)."""
        if cls._model_parallel_group is not None:
            return
        rank, timeout = dist.get_rank(), timedelta(minutes=timeout_minutes)
        for member in range(dist.get_world_size()):
            group = dist.new_group([member], timeout=timeout)
            if member == rank:
                cls._model_parallel_group = group

    @classmethod
    def destroy_groups(cls) -> None:
        cls._model_parallel_group = None

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        if DataParallelMPU._model_parallel_group is None:
            raise RuntimeError("initialize_model_parallel() has not made the groups of this process")
        return DataParallelMPU._model_parallel_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_data_parallel_group(self):
        return dist.group.WORLD

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


def check_layout_agrees(layout: ParallelLayout) -> None:
    """Megatron-core's groups must be the ones our rank formula (and DeepSpeed's topology) implies."""
    from megatron.core import parallel_state

    rank = dist.get_rank()
    tp, dp, pp = layout.coordinates(rank)
    actual = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank(),
              parallel_state.get_pipeline_model_parallel_rank())
    if actual != (tp, dp, pp):
        raise RuntimeError(f"rank {rank}: megatron-core places it at (tp, dp, pp) {actual}, "
                           f"DeepSpeed's topology at {(tp, dp, pp)}")
    assert parallel_state.get_data_parallel_world_size() == layout.data_parallel_size


class MegatronMPU:
    """The `mpu` interface DeepSpeed queries, answered from megatron-core's parallel state.

    DeepSpeed's "model parallel" is the tensor-parallel group: gradient norms and checkpoint
    file names are per tensor-parallel rank.
    """

    def __init__(self) -> None:
        from megatron.core import parallel_state

        self.ps = parallel_state

    def get_model_parallel_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_src_rank()

    def get_data_parallel_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.ps.get_pipeline_model_parallel_world_size()


def collective_device() -> torch.device:
    """The device collectives run on: the current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
