"""Count what would make the host wait for the device, on any machine, the CPU included.

On a GPU an op whose result size or value the host must know (`.item()`, `nonzero`, boolean
indexing, `.cpu()`, `.tolist()`) stalls the launch queue until every kernel before it has run
(SPEC §14). `torch.cuda.set_sync_debug_mode` reports them on a GPU only; this counter sees the same
ops on the CPU, so the tests and `tools/bench_train.py` can hold the step to zero without a GPU.

Each sync is attributed to the innermost frame outside torch and this module: ours
(`megatron_pmlm`), DeepSpeed's, megatron-core's, or other code, so DeepSpeed's own per-step syncs
(its overflow check) can be listed apart from ours.

Only the thread that enters the counter is watched (torch's dispatch modes are per thread, and the
patched methods follow suit): a loader thread reading its own CPU batch stalls no launch queue.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SYNCING_OPS = {
    aten._local_scalar_dense.default: "item",  # .item(), float(t), int(t), bool(t), if t:
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.unique_consecutive.default: "unique",
    aten._unique2.default: "unique",
    aten.repeat_interleave.Tensor: "repeat_interleave",
}
"""ATen ops whose output shape or value the host needs: each waits for the device."""

BOOLEAN_INDEXED_OPS = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                       aten._index_put_impl_.default)
"""Indexing ops that sync when an index is boolean (it becomes `nonzero` first)."""

PATCHED_METHODS = ("item", "cpu", "tolist", "numpy")
"""Tensor methods that copy to the host; on a CPU tensor `.cpu()`, `.tolist()` and `.numpy()`
dispatch nothing, so they are counted by patching the methods."""
DEVICE_SYNCHRONIZE = "device synchronize"
"""What an explicit wait for the whole device is recorded as: `torch.cuda.synchronize()`, or
DeepSpeed's `get_accelerator().synchronize()` (a no-op on DeepSpeed's CPU accelerator, counted all
the same: on a GPU it is `torch.cuda.synchronize()`). DeepSpeed's throughput timer, on by default,
calls it at every micro batch's forward and step."""

_THIS_FILE = str(Path(__file__).resolve())
_WARNINGS_FILE = str(Path(warnings.__file__).resolve())
"""Skipped too: the warnings machinery between a sync-debug warning and CudaSyncWarnings' record."""
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
OWNERS = (("megatron_pmlm", "ours"), ("deepspeed", "deepspeed"), ("megatron", "megatron-core"))


def _owner_and_place() -> tuple[str, str]:
    """(owner, "file:line") of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        filename = str(Path(frame.filename).resolve()) if frame.filename and not frame.filename.startswith("<") else ""
        if not filename or filename in (_THIS_FILE, _WARNINGS_FILE) or filename.startswith(_TORCH_DIR):
            continue
        parts = Path(filename).parts
        for package, owner in OWNERS:
            if package in parts:
                index = parts.index(package)
                return owner, f"{'/'.join(parts[index:])}:{frame.lineno}"
        return "other", f"{filename}:{frame.lineno}"
    return "other", "?"


class HostSyncCounter(TorchDispatchMode):
    """Counts host-device synchronisation points while active (a context manager).

        with HostSyncCounter() as syncs:
            step()
        syncs.count("ours")   # 0 is the goal
        syncs.report()        # one line per (owner, what, where)

    Counted: the ops of `SYNCING_OPS`, indexing with a boolean index, calls of the Tensor
    methods `PATCHED_METHODS`, and explicit device synchronizations (`DEVICE_SYNCHRONIZE`: patched
    `torch.cuda.synchronize` and, when DeepSpeed is imported, its accelerator's `synchronize`). A
    call that dispatches a counted op (`.item()`) or calls another counted one counts once.

    Compiled code (`--compile`) runs eagerly while the counter is active (torch.compiler's
    "force_eager" stance) and compiled again after: the counter sees the eager step's ops. Without
    the stance dynamo met the patched methods, gave up on the compiled regions' code and ran it
    eagerly for the rest of the process (torch 2.13), so a step timed or profiled after was eager.
    (Here and in the other counters, not imported from one place: tools/bench_before_after.py loads
    each counter file on its own.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._in_method = 0
        self._originals: dict[str, object] = {}
        self._synchronizes: list[tuple[object, str, object, bool]] = []
        self._thread = threading.get_ident()
        self._eager = contextlib.ExitStack()

    supports_higher_order_operators = True
    """Higher-order operators (flex_attention) pass through and run unobserved inside: none syncs."""

    # ---------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = SYNCING_OPS.get(func)
        if what is None and func in BOOLEAN_INDEXED_OPS and _has_boolean_index(args, kwargs):
            what = "boolean index"
        if what is not None and not self._in_method:
            self._record(what)
        return func(*args, **kwargs)

    # ---------------------------------------------------------------- methods
    def __enter__(self):
        self._thread = threading.get_ident()
        self._eager.enter_context(torch.compiler.set_stance("force_eager"))
        for name in PATCHED_METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._counting(f".{name}()", original))
        for owner, name in _synchronize_functions():
            original = getattr(owner, name)
            # An instance's method comes from its class: patched on the instance, deleted after.
            self._synchronizes.append((owner, name, original, name in vars(owner)))
            setattr(owner, name, self._counting(DEVICE_SYNCHRONIZE, original))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, original)
            self._originals.clear()
            for owner, name, original, own_attribute in reversed(self._synchronizes):
                if own_attribute:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)
            self._synchronizes.clear()
            self._eager.close()

    def _counting(self, what: str, original):
        """`original`, recording `what` once per outermost call from the watched thread."""
        counter = self

        def method(*args, **kwargs):
            if counter._in_method or threading.get_ident() != counter._thread:
                return original(*args, **kwargs)
            counter._record(what)
            counter._in_method += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._in_method -= 1

        method.__name__ = original.__name__
        return method

    def _record(self, what: str) -> None:
        owner, place = _owner_and_place()
        self.events[(owner, what, place)] += 1

    # ---------------------------------------------------------------- results
    def count(self, owner: str | None = None) -> int:
        """Syncs seen (of one owner: "ours", "deepspeed", "megatron-core", "other")."""
        return sum(n for (who, _, _), n in self.events.items() if owner is None or who == owner)

    def report(self, owner: str | None = None) -> str:
        lines = [f"{n:5d}  {who:13s} {what:18s} {place}" for (who, what, place), n in
                 sorted(self.events.items(), key=lambda item: (-item[1], item[0]))
                 if owner is None or who == owner]
        return "\n".join(lines) if lines else "(no host-device synchronisation)"


class CudaSyncWarnings:
    """What CUDA itself reports as synchronising while active, attributed like HostSyncCounter's
    events: `torch.cuda.set_sync_debug_mode("warn")` makes every call that waits for the device warn
    (also what the dispatch counter cannot see: a blocking host-to-device copy of pageable memory, a
    `torch.tensor(..., device="cuda")` of host values, a stream or device synchronize), and each such
    warning is recorded with its owner, place and thread instead of being printed. On a machine
    without CUDA it records nothing (`active` is False).

        with CudaSyncWarnings() as cuda_syncs:
            step()
        cuda_syncs.count("ours", main_thread_only=True)   # 0 is the goal
    """

    MESSAGE = "synchroniz"
    """What torch's sync-debug warnings say ("called a synchronizing CUDA operation")."""

    def __init__(self) -> None:
        self.events: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.active = torch.cuda.is_available()
        self.main_thread = threading.current_thread().name
        self._previous_mode = None
        self._warnings = None

    def __enter__(self):
        self.main_thread = threading.current_thread().name
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if self.MESSAGE not in str(message):
                return shown(message, category, filename, lineno, file, line)
            owner, place = _owner_and_place()
            self.events[(owner, place, threading.current_thread().name)] += 1

        warnings.showwarning = record
        if self.active:
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.active:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._warnings.__exit__(*exc)
        return False

    def count(self, owner: str | None = None, main_thread_only: bool = False) -> int:
        return sum(n for (who, _, thread), n in self.events.items()
                   if (owner is None or who == owner) and (not main_thread_only or thread == self.main_thread))

    def report(self) -> str:
        lines = [f"{n:5d}  {who:13s} {thread:16s} {place}" for (who, place, thread), n in
                 sorted(self.events.items(), key=lambda item: (-item[1], item[0]))]
        return "\n".join(lines) if lines else "(no synchronising CUDA call)"


def _synchronize_functions() -> list[tuple[object, str]]:
    """(owner, attribute) of the device-wide waits to count: torch.cuda's, and the DeepSpeed
    accelerator's where DeepSpeed is imported already (counting never imports it)."""
    functions: list[tuple[object, str]] = [(torch.cuda, "synchronize")]
    accelerator_module = sys.modules.get("deepspeed.accelerator")
    if accelerator_module is not None:
        functions.append((accelerator_module.get_accelerator(), "synchronize"))
    return functions


def _has_boolean_index(args, kwargs) -> bool:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
               for index in (indices or ()) if index is not None)


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m megatron_pmlm.training.host_syncs
    with HostSyncCounter() as counter:
        x = torch.randn(4)
        x[x > 0].sum().item()
    print(counter.report(), file=sys.stdout)
