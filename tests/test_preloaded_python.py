"""The suite's fork server (tests/preloaded_python.py): a forked run behaves as a new interpreter's
(the same output, exit code, argv, path, environment, exit sequence), a variable read at import
sends the run to a new interpreter, a timeout kills the run with what it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pmlm_testing import PRELOADED_ENV, REPO_ROOT, RUN_ENVIRONMENT, preloaded_server, run_python, torchrun
from preloaded_python import ADDRESS_ENV, environment_problem

PROBE = r'''
import atexit, os, sys, threading, time

print("argv", sys.argv[1:], "argv0", os.path.basename(sys.argv[0]), "path0", sys.path[0])
print("cwd", os.getcwd(), "variable", os.environ.get("PROBE_VARIABLE"), "stdin", repr(sys.stdin.read()))
print("main", __name__, sorted(name for name in dir(sys.modules["__main__"]) if not name.startswith("__")))
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran after the thread:", finished))
finished = []
threading.Thread(target=lambda: (time.sleep(0.2), finished.append(True))).start()
outcome = sys.argv[1]
if outcome == "raise":
    raise ValueError("the probe failed")
if outcome == "message":
    sys.exit("a message to stderr")
if outcome == "signal":
    import signal
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
sys.exit(int(outcome))
'''


@pytest.fixture(autouse=True)
def _server_on(monkeypatch):
    """These tests are the server's: they run it also where PRELOADED_ENV=0 turns it off for the rest."""
    monkeypatch.delenv(PRELOADED_ENV, raising=False)


def _environment(**extra) -> dict:
    return {**os.environ, **RUN_ENVIRONMENT, **extra}


def _fresh(monkeypatch, argv, **kwargs) -> subprocess.CompletedProcess:
    with monkeypatch.context() as patch:
        patch.setenv(PRELOADED_ENV, "0")
        return run_python(argv, **kwargs)


def _traced(monkeypatch, tmp_path, argv, **kwargs) -> tuple[subprocess.CompletedProcess, str]:
    """run_python's result and how it was served (forked, or why a new interpreter)."""
    trace = tmp_path / f"trace-{time.monotonic_ns()}"
    with monkeypatch.context() as patch:
        patch.setenv(PRELOADED_ENV, str(trace))
        result = run_python(argv, **kwargs)
    return result, trace.read_text().split("\t")[0]


@pytest.mark.parametrize("outcome", ["0", "3", "raise", "message", "signal"])
@pytest.mark.parametrize("form", ["-m", "-c", "script"])
def test_a_forked_run_is_what_a_new_interpreter_makes(form, outcome, monkeypatch, tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    argv = {"-m": ["-m", "probe_module"], "-c": ["-c", PROBE], "script": [str(tmp_path / "probe_module.py")]}[form]
    argv = [*argv, outcome, "second argument"]
    kwargs = dict(env=_environment(PROBE_VARIABLE="seen"), cwd=tmp_path, timeout=120)
    forked, served = _traced(monkeypatch, tmp_path, argv, **kwargs)
    assert served == "forked"
    fresh = _fresh(monkeypatch, argv, **kwargs)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == {"0": 0, "3": 3, "raise": 1, "message": 1, "signal": -signal.SIGTERM}[outcome]
    assert "variable seen stdin ''" in forked.stdout
    if outcome != "signal":
        assert "atexit ran after the thread: [True]" in forked.stdout


def test_the_suites_runs_are_forked_with_the_project_already_imported(monkeypatch, tmp_path):
    """What run_module passes is served by the server (a scan of the environment at import by some
    new dependency would make every run a new interpreter again: this test says so)."""
    result, served = _traced(monkeypatch, tmp_path, ["-c", "import sys; print('deepspeed' in sys.modules)"],
                             env=_environment(MASTER_PORT="29999"), timeout=60)
    assert served == "forked", served
    assert result.stdout == "True\n"


def test_which_environments_a_server_can_serve():
    """A variable read at import must match the server's, except one the imports set themselves
    when it comes with their value (DeepSpeed's PYTORCH_NVML_BASED_CUDA_CHECK, set in every pytest
    process that imported it), PYTEST_CURRENT_TEST whose presence alone is read and mlflow's telemetry
session id (a label)."""
    served, read = {"READ": "a", "PYTEST_CURRENT_TEST": "first"}, {"READ", "SET", "PYTEST_CURRENT_TEST", "TQDM_*"}
    imports_set = {"SET": "1"}

    def problem(**requested):
        return environment_problem({**served, **requested}, served, read, imports_set)

    assert problem(OTHER="anything", PYTEST_CURRENT_TEST="second", SET="1", _MLFLOW_TELEMETRY_SESSION_ID="4") is None
    assert problem(READ="b") == "READ differs from the server's (read at import)"
    assert problem(SET="2") == "SET differs from the server's (read at import)"
    assert problem(TQDM_DISABLE="1") == "TQDM_DISABLE differs from the server's (read at import)"
    assert problem(OMP_NUM_THREADS="4") == "OMP_NUM_THREADS differs from the server's (read at import)"
    assert environment_problem({"READ": "a"}, served, read, imports_set) == \
        "PYTEST_CURRENT_TEST differs from the server's (read at import)"


@pytest.mark.parametrize("interpreted", [False, True], ids=["compiled", "interpreted"])
def test_a_variable_read_at_import_sends_the_run_to_a_new_interpreter(interpreted, monkeypatch, tmp_path):
    """The kernels' settings are read when the modules load: a forked run would keep the server's;
    the run starts a new interpreter and sees the value. Triton's interpreter too, but the suite
    runs so many of those that they have a server of their own, which imported everything with it:
    such runs are forked from it (and refused by it alike for another setting)."""
    probe = ("import os, sys, megatron_pmlm.models.bucket_attention as kernels; "
             "print(kernels.INTERPRETED, kernels._DQ_KERNEL)")
    interpreter = {"TRITON_INTERPRET": "1"} if interpreted else {}
    result, served = _traced(monkeypatch, tmp_path, ["-c", probe], env=_environment(**interpreter), timeout=120)
    assert served == "forked" and result.returncode == 0, (served, result.stderr[-2000:])
    assert result.stdout.split() == [str(interpreted), "False"]
    result, served = _traced(monkeypatch, tmp_path, ["-c", probe],
                             env=_environment(**interpreter, PMLM_TRITON_DQ="kernel"), timeout=120)
    assert served == "new interpreter: PMLM_TRITON_DQ differs from the server's (read at import)"
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(interpreted), "True"]


TORCH_LOGS_PROBE = r'''
import torch
import torch._logging._internal as logs

print(sorted(logs.log_state.get_log_level_pairs()))
torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))
'''


@pytest.mark.parametrize("setting", ["dynamo", "dynamo,recompiles", "+dynamo", None])
def test_torch_logs_is_read_again_by_a_forked_run_which_logs_as_a_new_interpreter(setting, monkeypatch, tmp_path):
    """TORCH_LOGS (the suite's compiled runs set it, and the server does not) is read by torch's
    logging settings alone: a forked run reads it again, logging what a new interpreter logs. A
    DEBUG ("+") setting, which modules also read at import, goes to a new interpreter."""
    env = _environment(TORCH_LOGS=setting) if setting else {k: v for k, v in _environment().items() if k != "TORCH_LOGS"}
    forked, served = _traced(monkeypatch, tmp_path, ["-c", TORCH_LOGS_PROBE], env=env, timeout=120)
    assert served == ("forked" if "+" not in (setting or "") else
                      "new interpreter: TORCH_LOGS differs from the server's (read at import)")
    fresh = _fresh(monkeypatch, ["-c", TORCH_LOGS_PROBE], env=env, timeout=120)
    assert forked.returncode == fresh.returncode == 0, forked.stderr[-2000:] + fresh.stderr[-2000:]
    assert forked.stdout == fresh.stdout
    varying = r"[0-9a-f]{8}([-_][0-9a-f]{4}){3}[-_][0-9a-f]{12}|\d+"  # ids (graphs' too), times, pids
    assert [re.sub(varying, "#", line) for line in forked.stderr.splitlines()] == \
        [re.sub(varying, "#", line) for line in fresh.stderr.splitlines()]
    assert ("torchdynamo start tracing <lambda>" in forked.stderr) == (setting is not None), forked.stderr[-2000:]


def test_the_warm_ups_leave_no_state_a_new_interpreter_lacks(tmp_path):
    """The server's ISA probe, built anew (an empty inductor cache, as the first server of a suite
    finds it), made dynamo's Chromium event logger, so that a run forked from that server, compiling
    under TORCH_LOGS=dynamo, did not log its making as a new interpreter does (the TORCH_LOGS test
    above failed on whichever worker had that server); and timed its build and a collection into
    dynamo's compile-time metrics, which such a run listed at exit (cleared now)."""
    probe = ("import preloaded_python as served, torch._dynamo.utils as dynamo_utils\n"
             "served._import_recording_environment_reads([], served.WARM_UPS)\n"
             "print(dynamo_utils.CHROMIUM_EVENT_LOG is None, not dynamo_utils.compilation_time_metrics,\n"
             "      not dynamo_utils.cumulative_time_spent_ns)\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests"), str(REPO_ROOT)])}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["True"] * 3, result.stdout + result.stderr[-2000:]


def test_a_timeout_kills_the_run_and_what_it_started(tmp_path):
    source = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(120)']); print(child.pid, flush=True); time.sleep(120)")
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_python(["-c", source], env=_environment(), timeout=5)
    grandchild = int(raised.value.output)
    for _ in range(100):
        try:
            with open(f"/proc/{grandchild}/stat") as status:
                if status.read().split(") ")[-1][:1] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, signal.SIGKILL)
        pytest.fail(f"the run's child {grandchild} outlived the timeout")


WORKER = r'''
import os, signal, sys, time

rank = int(os.environ["RANK"])
print(f"rank {rank} forked {'deepspeed' in sys.modules} argv {sys.argv[1:]}", flush=True)
if rank == 1:
    time.sleep(1)
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda signum, frame: (print("rank 0 got SIGTERM", flush=True), os._exit(0)))
time.sleep(120)
'''


def test_torchrun_s_workers_are_forked_get_its_signals_and_end_as_their_runs(tmp_path):
    """run_module under torchrun forks the workers too (tests/preloaded_python.py --worker): each
    is a forked run with torchrun's environment; a worker's exit code reaches torchrun, whose SIGTERM
    to the other worker's process group reaches that worker's run."""
    probe = tmp_path / "probe_worker.py"
    probe.write_text(WORKER)
    server = preloaded_server()
    shim = str(Path(__file__).with_name("preloaded_python.py"))
    result = run_python([*torchrun(2)[1:], shim, "--worker", str(probe), "an argument"], timeout=120,
                        env=_environment(**{ADDRESS_ENV: server.name}))
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} forked True argv ['an argument']" in result.stdout, result.stdout
    assert "rank 0 got SIGTERM" in result.stdout, result.stdout
    assert "exitcode  : 3" in result.stderr, result.stderr[-3000:]
