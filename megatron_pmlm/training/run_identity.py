"""What produced a run: code version, resolved configuration, data, libraries, hardware.

Written into every checkpoint's run state (`run_identity`), printed in the first log lines, given
to W&B as the run's config and to MLflow as its parameters; `tools/verify_checkpoint.py --show`
prints it back.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("torch", "deepspeed", "megatron-core", "transformers")
IDENTITY_KEY = "run_identity"
"""Its key in a checkpoint's run state."""


def code_version() -> dict[str, Any]:
    """{"git_commit", "git_dirty"} when the package runs from a git checkout, else {"package_version"}."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True,
                             text=True, timeout=30)
        lines = top.stdout.split()
        if top.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == PACKAGE_ROOT:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PACKAGE_ROOT,
                                    capture_output=True, text=True, timeout=60)
            return {"git_commit": lines[1], "git_dirty": bool(status.stdout.strip()) if status.returncode == 0
                    else None}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"package_version": _version("megatron-pmlm")}


def library_versions() -> dict[str, str | None]:
    return {name: _version(name) for name in LIBRARIES}


def hardware(world_size: int) -> dict[str, Any]:
    """The accelerator's name and how many a node has, and the run's process count."""
    import torch

    if torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name(0), "devices_per_node": torch.cuda.device_count(),
                "world_size": world_size}
    import os

    return {"device": f"cpu ({_cpu_name()})", "devices_per_node": os.cpu_count(), "world_size": world_size}


def data_identity_of(run_args: dict[str, Any]) -> dict[str, Any] | None:
    """The samples' identity (data/samples.py data_identity) when the run records one, else the
    vocabulary's sha256 (fine-tuning)."""
    identity = run_args.get("data_identity")
    if isinstance(identity, dict):
        return identity
    vocab = run_args.get("vocab_file")
    if vocab and Path(vocab).is_file():
        return {"vocab_sha256": hashlib.sha256(Path(vocab).read_bytes()).hexdigest()}
    return None


def run_identity(run_args: dict[str, Any], training_config: dict[str, Any], deepspeed_config: dict[str, Any],
                 world_size: int) -> dict[str, Any]:
    """The identity of this run; plain JSON values (as run_state.json stores them)."""
    identity = {
        "code": code_version(),
        "config": {"args": {k: v for k, v in run_args.items() if k != "data_identity"},
                   "training": training_config, "deepspeed": deepspeed_config},
        "data": data_identity_of(run_args),
        "libraries": library_versions(),
        "hardware": hardware(world_size),
    }
    return json.loads(json.dumps(identity, default=str))


def identity_lines(identity: dict[str, Any]) -> list[str]:
    """The identity as log lines: code, libraries, hardware and data one line each, the resolved
    configuration as one JSON line."""
    code = identity.get("code") or {}
    code_text = (f"git {code['git_commit'][:12]}" + (" (dirty tree)" if code.get("git_dirty") else "")
                 if code.get("git_commit") else f"package version {code.get('package_version')}")
    hw = identity.get("hardware") or {}
    data = identity.get("data") or {}
    data_text = (f"samples digest {data['digest']}" if data.get("digest") else "") + \
        (f", vocabulary sha256 {data['vocab_sha256'][:16]}" if data.get("vocab_sha256") else "")
    return [f"run identity: code {code_text}",
            "run identity: libraries " + ", ".join(f"{k} {v}" for k, v in (identity.get("libraries") or {}).items()),
            f"run identity: hardware {hw.get('device')} x {hw.get('devices_per_node')} per node, "
            f"world size {hw.get('world_size')}",
            f"run identity: data {data_text.lstrip(', ') or '(not recorded)'}",
            "run identity: config " + json.dumps(identity.get("config"), sort_keys=True, default=str)]


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
