"""Writing outputs so that nothing half-written is ever left behind, with the permissions the user's
umask asks for, and without ever replacing what is not a regular file.

Every output path (`--output`, `--json`, ...) follows the same rules (`open_output`):
  `-`                      standard output (the program's own messages then go to standard error:
                           `logs_to_stderr`);
  a FIFO, a device (`/dev/null`), a link to one, or one of this process's open files named through
  /proc (`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`)
                           written through: opened and written, never replaced (appended to when
                           it is a regular file the shell opened for us, so nothing it holds is lost);
  anything else            a regular file, written to a temporary file beside it and renamed over
                           it: readers see the old file (or none) or the whole new one. A symbolic
                           link to a regular file keeps pointing where it did: the file it names is
                           the one replaced.
A folder output (`check_output_folder`, `replacing_folder`) is never `-`, a device, a FIFO or a socket
(or a link to one), whatever the flags; `--overwrite` replaces a regular file, or a folder holding
OUTPUT_MARKER (which every folder written through `replacing_folder` gets), never someone else's.
Files and folders are created with mode 0o666 / 0o777 less the umask (0644 / 0755 under umask 022),
as any program the user runs creates them: teammates can resume, convert and read results.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import IO, Any, Callable, Iterator

STDOUT = "-"
"""The output path that means standard output."""

_data_stdouts: list[IO] = []
"""The real standard output while `logs_to_stderr` sends everything printed to standard error."""


class OutputError(ValueError):
    """An output path that cannot be written (a folder, a missing or read-only folder): one line."""


class InputError(ValueError):
    """Bad input (files, options, data, a model); the message names what is at fault (the file and
    line where there is one), and a command line prints it as one `error:` line and exits 2."""


def _stdout() -> IO:
    return _data_stdouts[-1] if _data_stdouts else sys.stdout


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except (OSError, ValueError):
        return False


def writes_to_stdout(path: str | os.PathLike | None) -> bool:
    """`-`, or a path naming this process's standard output (/dev/stdout, /dev/fd/1, or the file or
    pipe it is redirected to)."""
    if path is None:
        return False
    if os.fspath(path) == STDOUT:
        return True
    try:
        fd = _stdout().fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        fd = 1
    return _same_file(os.fspath(path), fd)


def _through_proc(path: str) -> bool:
    """Whether `path` is, or leads through links to, /proc's per-process links (/dev/stdout ->
    /proc/self/fd/1, /dev/fd/N): files some process holds open, never ours to replace."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on a chain of links
        current = os.path.join(os.path.realpath(os.path.dirname(current)), os.path.basename(current))
        if current == "/proc" or current.startswith("/proc/"):
            return True
        if not os.path.islink(current):
            return False
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    return False


def written_through(path: str | os.PathLike) -> bool:
    """True when `open_output` writes into `path` as it is (standard output, a FIFO, a device, an
    open file named through /proc) rather than replacing it."""
    path = os.fspath(path)
    if writes_to_stdout(path) or _through_proc(path):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path)
    except OSError:  # nothing there yet (or a dangling link): a regular file will be created
        return False


def check_output(path: str | os.PathLike, flag: str = "--output", create_folders: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written: a folder, a folder that does not
    exist (unless `create_folders`: the tool makes it), a place without write permission (OutputError,
    one line naming the flag and the path)."""
    text = os.fspath(path)
    if written_through(text):
        if writes_to_stdout(text):
            return
        if not os.path.exists(text):
            raise OutputError(f"{flag} {text} does not exist")
        if not os.access(text, os.W_OK):
            raise OutputError(f"{flag} {text}: no permission to write it")
        return
    if os.path.isdir(text):
        raise OutputError(f"{flag} {text} is a folder; give a file name")
    target = os.path.realpath(text)
    folder = os.path.dirname(target) or "."
    while create_folders and not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # the first folder that exists is the one written in
    if not os.path.isdir(folder):
        problem = "is not a folder" if os.path.lexists(folder) else "does not exist"
        raise OutputError(f"{flag} {text}: the output folder {folder} {problem}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {text}: no permission to write in {folder}")
    if os.path.exists(target) and not os.access(target, os.W_OK):  # renaming over it would bypass that
        raise OutputError(f"{flag} {text}: the file is read-only")


# ------------------------------------------------------------------------------------------------
# Folder outputs: never `-`, never a device, FIFO or socket, and --overwrite only over what is ours
# ------------------------------------------------------------------------------------------------

OUTPUT_MARKER = ".megatron-pmlm"
"""The small file every output folder this project writes holds (what wrote it): `--overwrite`
replaces a non-empty folder only when it holds this (or is recognised as an older output of ours),
so that a mistyped path never deletes a folder someone else wrote (a downloaded bert-base has a
config.json too)."""


def special_file_kind(path: str | os.PathLike) -> str | None:
    """'a FIFO', 'a device', 'a socket' (or 'a process's open file' under /proc) for what `path` is or
    names through links; None for a regular file, a folder or nothing."""
    text = os.fspath(path)
    try:
        mode = os.stat(text).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if _through_proc(text):
        return "a process's open file"
    return None


def holds_output_marker(folder: str | os.PathLike) -> bool:
    """Whether `folder` is an output folder this project wrote (it holds OUTPUT_MARKER)."""
    return os.path.isfile(os.path.join(os.fspath(folder), OUTPUT_MARKER))


def write_output_marker(folder: str | os.PathLike) -> None:
    """OUTPUT_MARKER in `folder`, naming the program that wrote it (not its arguments: two builds of
    the same data stay identical byte for byte)."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    Path(folder, OUTPUT_MARKER).write_text(f"written by megatron-pmlm ({program}); --overwrite may replace this "
                                           "folder\n", encoding="utf-8")


def check_output_folder(path: str | os.PathLike, flag: str, overwrite: bool | None = None,
                        recognise: Callable[[Path], bool] | None = None,
                        error: type[Exception] = OutputError) -> None:
    """Refuse, before any work and in one line naming `flag`, a folder output that is `-`, a device,
    FIFO or socket (or a link to one) whatever the flags, or a file. `overwrite` None: the command
    adds to an existing folder (fine-tuning outputs, --save). `overwrite` False/True: the command
    replaces the folder, so a non-empty one needs --overwrite, and --overwrite replaces only a
    regular file or a folder this project wrote (OUTPUT_MARKER, or `recognise`: an older output of
    ours written before the marker existed). The refusal is an `error`."""
    text = os.fspath(path)
    if text == STDOUT:
        raise error(f"{flag} -: this command writes a folder, not standard output; give a folder name")
    kind = special_file_kind(text)
    if kind is not None:
        link = " (through a link)" if os.path.islink(text) else ""
        raise error(f"{flag} {text} is {kind}{link}, not a folder: refused, nothing is written there")
    if os.path.lexists(text) and not os.path.isdir(text):
        if overwrite is None:
            raise error(f"{flag} {text} is a file, not a directory")
        if not overwrite:
            raise error(f"{flag} {text} already exists and is a file (pass --overwrite to replace it)")
        return
    if overwrite is None or not os.path.isdir(text) or not any(os.scandir(text)):
        return
    if not overwrite:
        raise error(f"{flag} {text} already exists and is not empty (pass --overwrite to replace it)")
    if not holds_output_marker(text) and not (recognise is not None and recognise(Path(text))):
        raise error(f"{flag} {text} was not written by this project (it holds no {OUTPUT_MARKER}): not "
                          "replaced, even with --overwrite; remove it yourself or choose another folder")


def file_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be read as a file ('does not exist', 'is a directory, not a file'), or None."""
    if os.path.isdir(path):
        return "is a directory, not a file"
    if not os.path.exists(path):
        return "does not exist"
    return None


def _new_temporary_file(folder: Path, name: str, binary: bool) -> tuple[Path, IO]:
    """A fresh hidden file in `folder`, created with mode 0o666 less the umask (tempfile's are 0600)."""
    for _ in range(100):
        tmp = folder / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        return tmp, (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8"))
    raise FileExistsError(f"no free temporary name for {folder / name}")


def new_temporary_folder(destination: str | os.PathLike) -> Path:
    """A fresh hidden folder beside `destination`, created with mode 0o777 less the umask (mkdtemp's
    are 0700), to be renamed to `destination` once complete."""
    destination = Path(destination)
    for _ in range(100):
        staging = destination.parent / f".{destination.name}.tmp-{secrets.token_hex(4)}"
        try:
            staging.mkdir(mode=0o777)
        except FileExistsError:
            continue
        return staging
    raise FileExistsError(f"no free temporary name for {destination}")


@contextlib.contextmanager
def replacing_folder(destination: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder beside `destination` (holding OUTPUT_MARKER), renamed to it when the block
    completes (an existing `destination` is moved aside first and then deleted); removed if the block
    fails. A device, FIFO or socket at `destination` is never replaced (OutputError)."""
    destination = Path(destination)
    kind = special_file_kind(destination)
    if kind is not None:  # never replaced, whoever calls (the commands refuse it first: check_output_folder)
        raise OutputError(f"{destination} is {kind}, not a folder: refused, nothing is written there")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = new_temporary_folder(destination)
    try:
        write_output_marker(staging)
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if destination.exists() or destination.is_symlink():
        old = destination.parent / f".{destination.name}.old-{os.getpid()}"
        os.replace(destination, old)
    os.replace(staging, destination)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() and not old.is_symlink() else old.unlink()


@contextlib.contextmanager
def open_output(path: str | os.PathLike, binary: bool = False) -> Iterator[IO]:
    """A handle to write `path`'s new contents to, by the rules in the module docstring: standard
    output for `-`, written through for what is not a regular file, else a temporary file renamed
    over the target (the link's target for a symbolic link) when the block ends without an error,
    and deleted if it ends with one."""
    text = os.fspath(path)
    if writes_to_stdout(text):
        stream = _stdout()
        handle = stream.buffer if binary else stream
        yield handle
        handle.flush()
        return
    if written_through(text):
        # Append: nothing to truncate in a FIFO or a device, and a file the shell opened keeps its start.
        with open(text, "ab" if binary else "a", **({} if binary else {"encoding": "utf-8"})) as handle:
            yield handle
        return
    target = Path(os.path.realpath(text)) if os.path.islink(text) else Path(text)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp, handle = _new_temporary_file(target.parent, target.name, binary)
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """`text` as `path`'s whole contents, by `open_output`'s rules (atomic for regular files)."""
    with open_output(path) as handle:
        handle.write(text)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only once numpy is imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _finite(value.item())
    return value


def read_json(path: str | os.PathLike, error: type[Exception], missing: str | None = None) -> Any:
    """A JSON file's contents. A file that is not JSON (or not text) raises `error` naming it, not a
    parser traceback; with `missing` (why the file matters), so does an absent one."""
    path = Path(path)
    if missing is not None and not path.is_file():
        raise error(f"{path} is missing: {missing}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as reason:
        raise error(f"{path} is not valid JSON ({reason})") from None


def write_json_atomically(path: str | os.PathLike, data: Any, indent: int = 2) -> None:
    """Strict JSON (NaN and infinities, which strict readers refuse, become null; numpy scalars
    become numbers) by `open_output`'s rules."""
    write_text_atomically(path, json.dumps(_finite(data), indent=indent, allow_nan=False) + "\n")


@contextlib.contextmanager
def logs_to_stderr(*outputs: str | os.PathLike | None) -> Iterator[None]:
    """When one of `outputs` is standard output, everything printed inside the block goes to standard
    error, so that progress lines never mix with the data; `open_output` still reaches the real
    standard output."""
    if not any(writes_to_stdout(path) for path in outputs):
        yield
        return
    _data_stdouts.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _data_stdouts.pop()


CLOSED_PIPE_STATUS = 128 + 13
"""The exit status of a tool whose reader went away (`| head`): what the shell reports for `cat`,
killed by SIGPIPE."""


def exit_quietly_on_closed_pipe(main: Callable[[], int | None]) -> int | None:
    """Run a tool that prints results (`main()`, its status returned) so that `tool | head` ends
    quietly: when the reader has closed the pipe, the rest of the output is dropped, standard output
    is pointed at /dev/null (so that Python's own flush at exit finds no pipe either, as Python's
    documentation on SIGPIPE recommends) and the status is CLOSED_PIPE_STATUS, without a traceback.
    Training commands do not use it: a log piped to `tee` that dies should stop a run loudly."""
    try:
        status = main()
        sys.stdout.flush()  # what is still buffered meets the closed pipe here, not at exit
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return CLOSED_PIPE_STATUS


# ------------------------------------------------------------------------------------------------
# What the console shows: one line per real event
# ------------------------------------------------------------------------------------------------

NOISE_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
)
"""megatron-core warns of the first from four modules at every launch (the torch fallbacks are what
we use); torch deprecates the collectives DeepSpeed's ZeRO-2/3 call (DeepSpeed's code, nothing a
user of this project can change)."""
CPU_NOISE_WARNINGS = (
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)
"""megatron-core's tensor-parallel layers ask for CUDA_DEVICE_MAX_CONNECTIONS=1, which orders CUDA
kernels: meaningless on the CPU (filtered there), a real request on a GPU (kept)."""
NOISE_LOGS = {"DeepSpeed": ("Setting accelerator to CPU",)}
"""DeepSpeed's note when it finds no GPU: a CPU run knows it (GPU runs check their device themselves)."""


class _DropMessages:
    """A logging filter dropping records that start with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_libraries() -> None:
    """Third-party start-up noise that asks nothing of the user, filtered in one place; every command
    calls this first. Progress bars of Hugging Face loads and saves only on a terminal (a job log or a
    captured stderr gets none; HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back)."""
    import logging
    import re
    import warnings

    from .models.accelerated import training_device_type

    for message in NOISE_WARNINGS + (CPU_NOISE_WARNINGS if training_device_type() == "cpu" else ()):
        warnings.filterwarnings("ignore", message=re.escape(message))
    for name, prefixes in NOISE_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
            if "huggingface_hub" in sys.modules:
                sys.modules["huggingface_hub"].utils.disable_progress_bars()
            if "transformers" in sys.modules:
                sys.modules["transformers"].utils.logging.disable_progress_bar()
