"""A fork server for the suite's command-line runs: `python -m <module> ...`, `python -c ...` and
`python script.py ...` served by forking a process that has already imported torch, torch._dynamo,
DeepSpeed and the project, instead of starting a new interpreter that imports them again (~3.5 s of
CPU a run; the suite starts hundreds: docs/benchmarks.md, "Twenty-first session").

A forked run is the run a new interpreter would make: its own argv, environment, working directory,
stdin (/dev/null), stdout and stderr (captured), its own process group, a fresh `__main__`, the
interpreter's exit sequence (non-daemon threads joined, atexit handlers, exit code as `python`'s).
What it cannot take over is what the preloaded modules read from the environment at import: the
server records every variable read during its imports (and treats the prefixes read by native code
as read), and a request whose environment differs from the server's in one of them is refused; the
caller then starts a new interpreter (`run_python` does so itself). Nor does it import anything or
tear the interpreter down at exit: tests whose subject is a process's imports or its clean exit
(test_deepspeed_import.py, test_clean_exit.py, PYTHONPROFILEIMPORTTIME runs) start their own.

Server: `python tests/preloaded_python.py NAME` (started by `PreloadedPython`, one per pytest
process, on the Linux abstract socket NAME; it ends with the process that started it). torchrun's
workers: `torchrun ... tests/preloaded_python.py --worker -m module args` with ADDRESS_ENV set."""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
import types

PRELOADED = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.run", "deepspeed",
             "megatron_pmlm.pretrain", "megatron_pmlm.finetune_s2s")
"""What the server imports before it serves: what the suite's runs import first and longest (inductor:
1-1.8 s of each `--compile` run)."""
WARM_UPS = (("torch._inductor.cpu_vec_isa", "valid_vec_isa_list"),)
"""Functions the server calls once, after its imports, whose cached results its runs inherit: the
vector ISAs inductor's C++ backend may use (a build and a probe process each, ~2.5 s of every process
that compiles on this CPU; their environment reads, CXX among them, recorded as the imports' are)."""
RESET_AFTER_WARM_UPS = (("torch._dynamo.utils", "CHROMIUM_EVENT_LOG", None),)
"""(module, name, value) of process state a warm-up may leave that a new interpreter does not have,
set back after WARM_UPS: dynamo's Chromium event logger, made by the ISA probe's build when the probe
misses inductor's on-disk cache (the first server of a suite; the other finds the probe cached), and
logged as made under TORCH_LOGS=dynamo by the first compilation of a process that has none, which a
forked run of that server then did not log."""
CLEARED_AFTER_WARM_UPS = (("torch._dynamo.utils", "compilation_time_metrics"),
                          ("torch._dynamo.utils", "cumulative_time_spent_ns"))
"""(module, name) of dicts a warm-up may fill that a new interpreter starts empty, cleared in place
after WARM_UPS (other modules hold them by name): dynamo's compile-time metrics, where the ISA probe's
build, when it misses inductor's on-disk cache, times its `compile_file` and a `gc`; a forked run
under TORCH_LOGS=dynamo then listed them in its compile-time summary at exit, which a new
interpreter, finding the probe cached, does not."""
REREAD_AT_RUN = {"TORCH_LOGS": ("torch._logging._internal", "_init_logs", "+")}
"""Variables read at import by a function a forked run calls again with its own environment when its
value differs from the server's (module, function, and a mark that makes a value read elsewhere at
import too): torch's own tests re-read TORCH_LOGS so (the logging settings are its only reader), and
such a run is forked too, logging as a new interpreter would. Not a DEBUG ("+") setting: modules
decide on it at import too (symbolic_shapes' cache statistics at exit) and its logs print the Python
stack, which in a forked run holds the server's frames."""
SETTING_ENV = "PMLM_TEST_PRELOADED_PYTHON"
"""`0`: every run in a new interpreter (the server unused); a file path: each run appends a line there
saying how it was served (forked, or why a new interpreter)."""
ADDRESS_ENV = "PMLM_PRELOADED_PYTHON_ADDRESS"
"""The server's address, given to torchrun's workers (`--worker`) so that they are forked too."""
PREFIXES_READ = ("TORCH", "PYTORCH", "TRITON", "CUDA", "NCCL", "GLOO", "OMP_", "GOMP_", "KMP_", "MKL", "OPENBLAS",
                 "DNNL", "ONEDNN", "LD_", "MALLOC", "JE_", "ARROW", "PYTHON", "DS_")
"""Variables that native code (libtorch, OpenMP, the allocators, the interpreter) may have read at
import, where Python's os.environ does not see it: treated as read by the server's imports."""
RUNTIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")
"""torchrun's variables for its workers, read when the run starts its process group (by Python, or by
libtorch then, which sees the run's environment): only the recorded reads at import count."""
KNOWN_SCANS = {"tqdm/utils.py": "TQDM_", "networkx/utils/backends.py": "NETWORKX_"}
"""Who scans the whole environment at import, and for which prefix (tqdm's `envwrap`, networkx's
backend settings, imported with inductor): any other
scan makes every variable count as read (and the server refuses every run whose environment differs)."""
ENVIRONMENT_COPIES = {"python_subprocess_env": "torch/_inductor/utils.py",
                      "get_compiler_version_info": "torch/_inductor/cpp_builder.py"}
"""Functions that copy the whole environment for a child process, and where they live: inductor's ISA
probe (WARM_UPS) starts a Python that loads a library, an outcome the interpreter's and the loader's
variables decide (PYTHON*, LD_*: counted as read already), and asks the compiler its version (the
compiler found on PATH, a read recorded where it is looked up), so their copies read nothing more."""
PRESENCE_ONLY = {"PYTEST_CURRENT_TEST"}
"""Read at import only to ask whether it is set (mlflow's "are we in a test?"); its value is per
test, so only its presence must match."""
LABELS = {"_MLFLOW_TELEMETRY_SESSION_ID"}
"""Read at import as a label only (mlflow's telemetry session, a random id each process that imports
mlflow sets): any value, or none, makes the same run."""
LENGTH = struct.Struct("!Q")
STDOUT_AND_STDERR = 2


# -- server ---------------------------------------------------------------------------------------


def _import_recording_environment_reads(modules, warm_ups=()) -> set[str]:
    """Import `modules`, then call each (module, function) of `warm_ups`; the names of the variables
    read through os.environ meanwhile."""
    environ_type = type(os.environ)
    original_getitem, original_iter = environ_type.__getitem__, environ_type.__iter__
    read: set[str] = set()

    def copied_for_a_child(frames) -> bool:
        return any(frame.name in ENVIRONMENT_COPIES and frame.filename.endswith(ENVIRONMENT_COPIES[frame.name])
                   for frame in frames)

    def getitem(self, key):
        caller = sys._getframe(1).f_code
        if caller.co_name != "__iter__" and not copied_for_a_child(traceback.extract_stack(limit=3)):
            read.add(key.decode() if isinstance(key, bytes) else key)  # not items() or values() of a scan
        return original_getitem(self, key)

    def iterate(self):
        frames = traceback.extract_stack(limit=6)
        if not copied_for_a_child(frames):
            callers = [frame.filename for frame in frames]
            scans = [prefix for path, prefix in KNOWN_SCANS.items() if any(name.endswith(path) for name in callers)]
            read.add(f"{scans[0]}*" if scans else "*")  # a scan for a prefix; an unknown one reads everything
        return original_iter(self)

    environ_type.__getitem__, environ_type.__iter__ = getitem, iterate
    try:
        for module in modules:
            importlib.import_module(module)
        for module, function in warm_ups:
            getattr(importlib.import_module(module), function)()
        if warm_ups:
            for module, name, value in RESET_AFTER_WARM_UPS:
                setattr(importlib.import_module(module), name, value)
            for module, name in CLEARED_AFTER_WARM_UPS:
                getattr(importlib.import_module(module), name).clear()
    finally:
        environ_type.__getitem__, environ_type.__iter__ = original_getitem, original_iter
    return read


def environment_problem(requested: dict[str, str], served: dict[str, str], read: set[str],
                        imports_set: dict[str, str]) -> str | None:
    """Why a run with environment `requested` cannot be forked from a server started with `served`
    whose imports read `read` and set `imports_set` (None when it can). A variable the imports set
    may also come with the value they set (DeepSpeed's `setdefault` seen by a process that imported it)."""
    prefixes = PREFIXES_READ + tuple(entry[:-1] for entry in read if entry.endswith("*"))
    for name in sorted(set(requested) | set(served)):
        if name.startswith(RUNTIME_PREFIXES) and name not in read:
            continue
        if name in REREAD_AT_RUN and REREAD_AT_RUN[name][2] not in requested.get(name, "") + served.get(name, ""):
            continue
        if name in LABELS or (name in PRESENCE_ONLY and (name in requested) == (name in served)):
            continue
        if name in imports_set and requested.get(name) == imports_set[name]:
            continue
        if requested.get(name) != served.get(name) and (name in read or name.startswith(prefixes)):
            return f"{name} differs from the server's (read at import)"
    return None


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, LENGTH.size, STDOUT_AND_STDERR)
    (length,) = LENGTH.unpack(header)
    payload = b""
    while len(payload) < length:
        chunk = connection.recv(length - len(payload))
        if not chunk:
            raise ConnectionError("request cut short")
        payload += chunk
    return json.loads(payload), fds


def _request(connection: socket.socket, address: str, request: dict, fds: list[int]):
    """The client's half of `_receive`: connect, send `request` with the run's stdout and stderr
    `fds`; (the replies as lines, the first: {"pid": ...} or {"refused": why})."""
    payload = json.dumps(request).encode()
    connection.connect(address)
    socket.send_fds(connection, [LENGTH.pack(len(payload))], fds)
    connection.sendall(payload)
    replies = connection.makefile("r")
    return replies, json.loads(replies.readline())


def _reply(connection: socket.socket, **message) -> None:
    connection.sendall(json.dumps(message).encode() + b"\n")


def serve(address: str) -> None:
    from slurm_cluster import _terminate_with_parent  # the SLURM daemons' PR_SET_PDEATHSIG

    _terminate_with_parent()
    served = dict(os.environ)
    read = _import_recording_environment_reads(PRELOADED, WARM_UPS)
    imports_set = {name: value for name, value in os.environ.items() if served.get(name) != value}
    imports_unset = set(served) - set(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the supervisors reap themselves
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        with connection:
            uid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():
                continue
            request, fds = _receive(connection)
            problem = environment_problem(request["env"], served, read, imports_set)
            if problem:
                _reply(connection, refused=problem)
            elif os.fork() == 0:
                try:
                    listener.close()
                    request["env"] = {name: value for name, value in {**request["env"], **imports_set}.items()
                                      if name not in imports_unset}  # what the imports did to a new process's
                    _supervise(connection, request, fds)
                finally:
                    os._exit(1)  # a child never returns to the server's loop
            for fd in fds:
                os.close(fd)


def _supervise(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """In a child of the server: fork the run, tell the client its pid, then its wait status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        try:
            connection.close()
            _run(request, fds)
        finally:
            os._exit(1)
    _reply(connection, pid=pid)
    try:
        run = os.pidfd_open(pid)
    except OSError:  # Linux before 5.3: the run is waited for without watching the client
        run = None
    while run is not None and not select.select([run, connection], [], [])[0].count(run):
        if not connection.recv(1):  # the client is gone (a torchrun worker killed): so is its run
            os.killpg(pid, signal.SIGKILL)
            break
    _, status = os.waitpid(pid, 0)
    try:
        _reply(connection, status=status)
    except OSError:
        pass
    os._exit(0)


def _run(request: dict, fds: list[int]) -> None:
    """In the run's process: become what `python ARGV` would be, run it, exit as the interpreter does."""
    os.setpgid(0, 0)  # its own process group: a timeout kills it with whatever it started
    if request.get("umask") is not None:  # as `preexec_fn=lambda: os.umask(...)` gives a new interpreter
        os.umask(request["umask"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((stdin, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(source, target)
        os.close(source)
    if request.get("unbuffered"):  # `python -u`, as torchrun starts its workers
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(stream.fileno(), "w", closefd=False), stream.encoding,
                                                stream.errors, write_through=True))
    os.chdir(request["cwd"])
    served = {name: os.environ.get(name) for name in REREAD_AT_RUN}
    os.environ.clear()
    os.environ.update(request["env"])
    for name, (module, function, _) in REREAD_AT_RUN.items():
        if os.environ.get(name) != served[name]:
            getattr(importlib.import_module(module), function)()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # its global generator seeded afresh, as in a new process
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    option, *rest = request["argv"]
    code = 0
    try:
        if option == "-m":
            module, *arguments = rest
            sys.argv = ["-m", *arguments]
            sys.path[0] = os.getcwd()
            sys.modules.pop(module, None)  # preloaded: run it afresh as __main__, as `python -m` does
            import runpy

            runpy._run_module_as_main(module, alter_argv=True)
        elif option == "-c":
            sys.argv = ["-c", *rest[1:]]
            sys.path[0] = ""
            exec(compile(rest[0], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [option, *rest]
            sys.path[0] = os.path.dirname(os.path.realpath(option))
            try:
                with open(option, "rb") as script:
                    source = script.read()
            except OSError as error:
                print(f"{sys.executable}: can't open file {os.path.abspath(option)!r}: [Errno {error.errno}] "
                      f"{error.strerror}", file=sys.stderr)
                os._exit(2)
            main.__file__ = option
            exec(compile(source, option, "exec"), main.__dict__)
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except BaseException as error:
        error.__traceback__ = error.__traceback__.tb_next  # without this function's frame
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    threading._shutdown()  # the interpreter's exit: join non-daemon threads, then the atexit handlers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# -- client ---------------------------------------------------------------------------------------


class PreloadedPython:
    """The client: one server for this process, started on first use."""

    def __init__(self, env: dict[str, str]):
        self.name = name = f"pmlm-preloaded-python-{os.getpid()}-{secrets.token_hex(6)}"
        self.address = "\0" + name  # Linux's abstract namespace: no file to clean up
        import tempfile

        self.log = tempfile.TemporaryFile()  # the server's stderr: read if it fails to start
        self.server = subprocess.Popen([sys.executable, __file__, name], env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=self.log, text=True)
        atexit.register(self.close)
        if self.server.stdout.readline().strip() != "ready":
            self.server.kill()
            self.server.wait()
            raise RuntimeError(f"the preloaded-python server did not start: {_text(self.log)[-3000:]}")

    def close(self) -> None:
        if self.server.poll() is None:
            self.server.terminate()
            self.server.wait()

    def run(self, argv: list[str], env: dict[str, str], cwd: str, timeout: float | None, umask: int | None = None,
            text: bool = True) -> tuple[subprocess.CompletedProcess | None, str]:
        """(`python *argv` forked from the server under `umask` (None: the server's), output captured
        as text (or bytes), "forked"), or (None, why the server refused it: its environment differs in
        a variable read at import)."""
        import tempfile

        command = [sys.executable, *argv]
        output = _text if text else _bytes
        with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            replies, first = _request(connection, self.address, {"argv": argv, "env": env, "cwd": cwd, "umask": umask},
                                      [stdout.fileno(), stderr.fileno()])
            if "refused" in first:
                return None, "new interpreter: " + first["refused"]
            connection.settimeout(timeout)
            try:
                status = json.loads(replies.readline())["status"]
            except (TimeoutError, socket.timeout):
                os.killpg(first["pid"], signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout, output(stdout), output(stderr)) from None
            return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), output(stdout),
                                               output(stderr)), "forked"


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def worker(argv: list[str]) -> None:
    """torchrun's worker (`torchrun ... tests/preloaded_python.py --worker -m module args`): the run
    forked from the server at ADDRESS_ENV with this process's environment, standard output and error;
    the signals torchrun (or a test) sends here go to the run's process group, and this process ends
    as the run ended. Where the server refuses, or none is given, it becomes `python -u ARGV`."""
    address = os.environ.get(ADDRESS_ENV)
    if address:
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "unbuffered": True}
        replies, first = _request(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), "\0" + address, request, [1, 2])
        trace(f"torchrun worker: {'forked' if 'pid' in first else 'new interpreter: ' + first['refused']}", argv)
        if "pid" in first:
            def forward(signum, frame):
                try:
                    os.killpg(first["pid"], signum)
                except ProcessLookupError:
                    pass

            for signum in FORWARDED_SIGNALS:
                signal.signal(signum, forward)
            status = json.loads(replies.readline())["status"]
            if os.WIFSIGNALED(status):
                signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
                os.kill(os.getpid(), os.WTERMSIG(status))
            os._exit(os.waitstatus_to_exitcode(status))
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def trace(served: str, argv: list[str]) -> None:
    """A line in the file SETTING_ENV names, if it names one: how a run was served."""
    path = os.environ.get(SETTING_ENV, "")
    if path not in ("", "0"):
        with open(path, "a") as lines:
            lines.write(f"{served}\t{' '.join(argv[:2])[:100]!r}\n")


def _bytes(handle) -> bytes:
    """The bytes written to `handle`."""
    handle.seek(0)
    return handle.read()


def _text(handle) -> str:
    """The bytes written to `handle`, decoded as `subprocess.run(text=True)` decodes them."""
    return io.TextIOWrapper(io.BytesIO(_bytes(handle))).read()


if __name__ == "__main__":
    worker(sys.argv[2:]) if sys.argv[1] == "--worker" else serve("\0" + sys.argv[1])
