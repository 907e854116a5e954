"""Helpers shared by the test modules (a plain module: conftest files are not importable by name
once several test folders have one)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from preloaded_python import ADDRESS_ENV, SETTING_ENV, PreloadedPython, trace

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def run_module(module: str, *args: str, timeout: int = 300, nproc: int = 1,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m module args` (or under torchrun with `nproc` processes), output captured; `env`
    values of None unset those variables. torchrun's workers are forked from the preloaded server too
    (tests/preloaded_python.py `--worker`)."""
    full_env = {**os.environ, **RUN_ENVIRONMENT, **(env or {})}
    full_env = {key: value for key, value in full_env.items() if value is not None}
    command = [sys.executable, "-m", module, *args]
    if nproc > 1:
        server = preloaded_server(interpreted=full_env.get(INTERPRETER_ENV) == "1")
        worker = [str(Path(__file__).with_name("preloaded_python.py")), "--worker"] if server else []
        command = [*torchrun(nproc), *worker, "-m", module, *args]
        if server:
            full_env[ADDRESS_ENV] = server.name
    return run_python(command[1:], env=full_env, timeout=timeout)


def run_tool(script: str, *args: str, timeout: int = 300, env: dict | None = None,
             cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`python tools/<script> args` as run_module runs a module (the same environment, output captured)."""
    full_env = {**os.environ, **RUN_ENVIRONMENT, **(env or {})}
    return run_python([str(REPO_ROOT / "tools" / script), *args], env=full_env, cwd=cwd, timeout=timeout)


RUN_ENVIRONMENT = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
"""What run_module adds to the environment: DeepSpeed on the CPU, one thread a process."""
PRELOADED_ENV = SETTING_ENV
"""`0`: every run in a new interpreter (tests/preloaded_python.py's server unused); a file path: each
run appends a line there saying how it was served (forked, or why a new interpreter)."""
INTERPRETER_ENV = "TRITON_INTERPRET"
"""`1`: Triton's interpreter, read when the kernels' modules load: such runs are forked from a
server of their own (started on first use, like the other), which imported everything with it set."""
_preloaded: dict[bool, PreloadedPython] = {}
_preloaded_lock = threading.Lock()


def preloaded_server(interpreted: bool = False):
    """This process's preloaded-python server (started on first use) for runs in Triton's interpreter
    or not, or None where PRELOADED_ENV is 0."""
    if os.environ.get(PRELOADED_ENV) == "0":
        return None
    with _preloaded_lock:
        if interpreted not in _preloaded:
            _preloaded[interpreted] = PreloadedPython({**os.environ, **RUN_ENVIRONMENT,
                                                       **({INTERPRETER_ENV: "1"} if interpreted else {})})
    return _preloaded[interpreted]


def run_python(argv: list[str], *, env: dict | None = None, cwd: str | Path | None = None,
               timeout: float | None = None, umask: int | None = None, text: bool = True) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], capture_output=True, text=text, ...)` (under `umask`
    when given), forked from this process's preloaded-python server (torch, DeepSpeed and the project
    already imported) unless `env` differs from the server's in what its imports read, or
    PRELOADED_ENV is `0`."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    server = preloaded_server(interpreted=env.get(INTERPRETER_ENV) == "1")
    if server:
        result, served = server.run(list(argv), env, cwd, timeout, umask=umask, text=text)
        trace(served, argv)
        if result is not None:
            return result
    return subprocess.run([sys.executable, *argv], capture_output=True, text=text, timeout=timeout, env=env, cwd=cwd,
                          preexec_fn=None if umask is None else lambda: os.umask(umask))


def run_interpreted(source: str, timeout: int = 600, unset: tuple[str, ...] = ()) -> dict:
    """The JSON `python -c source` printed with our Triton kernels in Triton's interpreter
    (`TRITON_INTERPRET=1`, which must be set before the kernels are defined: a process of its own,
    forked from the interpreter's preloaded server), from the repository's root, tests/ importable,
    the variables `unset` unset."""
    env = {key: value for key, value in {**os.environ, **RUN_ENVIRONMENT, INTERPRETER_ENV: "1"}.items()
           if key not in unset}
    source = f"import sys; sys.path.insert(0, {str(REPO_ROOT / 'tests')!r})\n" + source
    result = run_python(["-c", source], cwd=REPO_ROOT, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def check_kernel_switch(monkeypatch, module, variable: str, cases: dict[str, bool], wrong: str) -> None:
    """A kernel module's switch read from the environment (`module._from_environment()`, which its
    import calls): each value of `cases` turns the kernel on or off; `wrong` leaves it off with a
    problem naming the variable and its choices, with which the model refuses to start (and builds
    without it)."""
    from megatron_pmlm.config import ConfigError, model_config_from_preset
    from megatron_pmlm.models.model import BertModel

    for value, enabled in cases.items():
        monkeypatch.setenv(variable, value)
        assert module._from_environment() == (enabled, None), value
    monkeypatch.setenv(variable, wrong)
    enabled, problem = module._from_environment()
    default = next(value for value, on in cases.items() if on)
    assert not enabled and problem.startswith(f"{variable}={wrong!r}: give {default} (the default"), problem
    monkeypatch.setattr(module, "ENVIRONMENT_PROBLEM", None)
    BertModel(model_config_from_preset("tiny"))
    monkeypatch.setattr(module, "ENVIRONMENT_PROBLEM", problem)
    with pytest.raises(ConfigError, match=f"{variable}={wrong!r}"):
        BertModel(model_config_from_preset("tiny"))


@contextlib.contextmanager
def one_thread():
    """torch's intra-op threads set to one inside, restored after: tiny tensors gain nothing from a
    second thread and lose when another process holds the core; inductor generates its C++ kernels
    for the thread count, so a compilation in a test matches the single-threaded runs it starts."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def torchrun(nproc: int) -> list[str]:
    """The launcher for `nproc` local processes. --standalone: the agent binds its store on a port
    of its own choosing and the workers use it, so no port is picked here and then lost to another
    process before torchrun binds it (a race that fails runs on a busy machine)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def plotted_panels(runs: list[Path], output: Path, labels: list[str] | None = None) -> dict[str, list[str]]:
    """tools/plot_curves.py on real runs: the PNG it writes opens, every panel has a legend; returns
    panel title -> legend entries."""
    from matplotlib import image

    from tools import plot_curves

    figure = plot_curves.plot(runs, None, output, labels)
    assert image.imread(output).ndim == 3  # a PNG that opens
    panels = {}
    for axis in figure.axes:
        legend = axis.get_legend()
        assert legend is not None, f"panel {axis.get_title()} has no legend"
        panels[axis.get_title()] = [text.get_text() for text in legend.get_texts()]
    return panels


def unilm_rows(batch_size: int, seed: int, vocab_size: int, min_length: int = 12, max_length: int = 64):
    """(ids, lengths, second) of [SOS] A [EOS] B [EOS] rows of random ordinary tokens (ids >= 6),
    right-padded; `second` marks segment B. Special ids as `unilm_special_ids()`."""
    import numpy as np

    special = unilm_special_ids()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_length, max_length + 1, batch_size)
    ids = np.zeros((batch_size, lengths.max()), dtype=np.int64)
    second = np.zeros_like(ids, dtype=bool)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(6, vocab_size, length)
        split = int(rng.integers(2, length - 2))
        ids[row, 0], ids[row, split], ids[row, length - 1] = special.cls, special.sep, special.sep
        second[row, split + 1:length] = True
    return ids, lengths, second


def unilm_special_ids():
    from megatron_pmlm.tokenizer import SpecialTokenIds

    return SpecialTokenIds(pad=0, unk=1, cls=2, sep=3, mask=4, pseudo=5)


def unilm_mixture_batch(vocab_size: int, seed: int, batch_size: int = 8, max_length: int = 64):
    """A UniLM v1 batch with every LM type in turn (bi, l2r, r2l, s2s) and NSP labels on the
    bidirectional rows (0, 1, 0, ...), as data/unilm_batches.py builds it."""
    import numpy as np

    from megatron_pmlm.data.unilm_batches import build_unilm_batch, sample_keys

    ids, lengths, second = unilm_rows(batch_size, seed, vocab_size, max_length=max_length)
    rows = np.arange(batch_size)
    nsp = np.where(rows % 4 == 0, (rows // 4) % 2, -1)
    return build_unilm_batch(ids, lengths, second, rows % 4, nsp, sample_keys(3, 0, rows), unilm_special_ids(),
                             vocab_size)


def damage_in_place(path: Path) -> None:
    """4 KB in the middle of `path` flipped, its size unchanged (a bad disk block, a stray write)."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        block = handle.read(4096)
        handle.seek(size // 2)
        handle.write(bytes(b ^ 0x5A for b in block))
    assert path.stat().st_size == size


def kernel_code(*flags: str) -> dict:
    """tools/bench_kernel_code.py's figures (Triton's compiler and cuobjdump, no GPU)."""
    env = {key: value for key, value in {**os.environ, **RUN_ENVIRONMENT}.items() if key != "TRITON_INTERPRET"}
    result = run_python([str(REPO_ROOT / "tools" / "bench_kernel_code.py"), *flags, "--json", "-"], cwd=REPO_ROOT,
                        env=env, timeout=600)
    if result.returncode and "is missing" in result.stderr:
        pytest.skip(result.stderr.strip().splitlines()[-1][:200])
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def compiled_for_gpus(source: str):
    """The JSON a script printed after compiling Triton kernels for GPUs without one (Triton's own
    compiler; its ptxas ships with Triton: the test is skipped, saying so, where it is missing)."""
    env = {**os.environ, **RUN_ENVIRONMENT}
    env.pop("TRITON_INTERPRET", None)
    # set in the run (Triton reads it at each compilation), not given: a forked run needs the server's environment
    source = 'import os; os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")\n' + source
    result = run_python(["-c", source], cwd=REPO_ROOT, env=env, timeout=600)
    if result.returncode and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("Triton's ptxas is missing here: " + result.stderr.strip().splitlines()[-1][:200])
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def philox_keep_bits(seed: int, rows: int, columns: int, threshold: int, rounds: int = 7):
    """numpy's reference for `hidden_dropout.dropout_keep_bits` (Salmon et al.'s Philox4x32, written
    from the paper's round function, not Triton's code): uint8 [rows, ceil(columns / 8)], bit k of
    byte c set where the k-th 16-bit half of Philox(key = seed, counter = (c, row, 0, 0)) >= threshold."""
    import numpy as np

    byte_columns = (columns + 7) // 8
    word = np.uint64(0xFFFFFFFF)
    c0 = np.tile(np.arange(byte_columns, dtype=np.uint64), (rows, 1))
    c1 = np.tile(np.arange(rows, dtype=np.uint64)[:, None], (1, byte_columns))
    c2, c3 = np.zeros_like(c0), np.zeros_like(c0)
    k0, k1 = np.uint64(seed) & word, (np.uint64(seed) >> np.uint64(32)) & word
    for _ in range(rounds):
        product0, product2 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # exact in 64 bits
        c0, c1, c2, c3 = (((product2 >> np.uint64(32)) ^ c1 ^ k0) & word, product2 & word,
                          ((product0 >> np.uint64(32)) ^ c3 ^ k1) & word, product0 & word)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & word, (k1 + np.uint64(0xBB67AE85)) & word
    halves = [part for c in (c0, c1, c2, c3) for part in (c & np.uint64(0xFFFF), c >> np.uint64(16))]
    keep = np.stack(halves, -1) >= threshold
    keep &= (np.arange(byte_columns * 8) < columns).reshape(byte_columns, 8)
    return (keep.astype(np.uint32) << np.arange(8, dtype=np.uint32)).sum(-1).astype(np.uint8)
