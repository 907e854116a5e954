"""Check pre-training checkpoints without converting or training: is each complete and intact?

    python tools/verify_checkpoint.py checkpoints/pmlm-base              # every iter_N, newest first
    python tools/verify_checkpoint.py checkpoints/pmlm-base/iter_0012000 --fast

A checkpoint is usable when its run_state.json exists and every file of its manifest has the size
and the checksum it was saved with: what `pretrain --load` checks before choosing one (it reads
every file once). `--fast` compares sizes only (catches a missing or truncated file, not bytes
changed in place); `--deep` also loads every .pt file with torch.load. A checkpoint saved before
checksums existed is checked by size, and said so. `--show` also prints what produced each
checkpoint (its run identity: code version, resolved configuration, data, libraries, hardware). Exit 0 when the checkpoint given (or, for a
save directory, the newest one) is usable, 1 when not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pmlm.files import exit_quietly_on_closed_pipe  # noqa: E402
from megatron_pmlm.training.checkpoint_files import (LATEST_FILE, RUN_STATE_FILE, checkpoint_dirs, checksum_note,  # noqa: E402
                                                     verify)
from megatron_pmlm.training.run_identity import IDENTITY_KEY, identity_lines  # noqa: E402


def shown_identity(path: Path) -> list[str]:
    """The run identity lines of one checkpoint's run state (or why there are none)."""
    try:
        identity = json.loads((path / RUN_STATE_FILE).read_text()).get(IDENTITY_KEY)
    except (OSError, ValueError) as error:
        return [f"run identity: unreadable ({type(error).__name__}: {error})"]
    if not isinstance(identity, dict):
        return ["run identity: not recorded (saved before run identities were)"]
    return identity_lines(identity)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("path", type=Path, help="a --save directory, or one checkpoint (DIR/iter_N) in it")
    parser.add_argument("--fast", action="store_true", help="compare sizes only, not checksums (reads no file)")
    parser.add_argument("--deep", action="store_true", help="also load every .pt file with torch.load")
    parser.add_argument("--show", action="store_true",
                        help="also print each checkpoint's run identity (code version, configuration, data, "
                             "libraries, hardware)")
    args = parser.parse_args(argv)
    if not args.path.is_dir():
        print(f"error: {args.path} is not a directory", file=sys.stderr)
        return 2
    candidates = checkpoint_dirs(args.path)
    if not candidates:
        if (args.path / RUN_STATE_FILE).exists() or args.path.name.startswith("iter_"):
            candidates = [(0, args.path)]
        else:
            print(f"error: {args.path} holds no checkpoint (no iter_N directories)", file=sys.stderr)
            return 2
    latest = (args.path / LATEST_FILE).read_text().strip() if (args.path / LATEST_FILE).is_file() else None
    usable = None
    for _, path in sorted(candidates, reverse=True):
        problem = verify(path, contents=not args.fast, deep=args.deep)
        marker = " (latest)" if path.name == latest else ""
        note = None if args.fast or problem else checksum_note(path)
        checked = "sizes only (--fast)" if args.fast else "sizes only" if note else "sizes and checksums match"
        print(f"{path}{marker}: " + (f"complete, {checked}" if problem is None else f"UNUSABLE: {problem}"))
        if note:
            print(f"  note: {note}")
        if args.show:
            for line in shown_identity(path):
                print(f"  {line}")
        if problem is None and usable is None:
            usable = path
    if usable is None:
        print("no usable checkpoint")
        return 1
    if len(candidates) > 1:
        print(f"resuming would use {usable}" + (" (if its checksums match: --fast compared sizes only)"
                                                if args.fast else ""))
    newest = max(candidates)[1]
    return 0 if usable == newest else 1


if __name__ == "__main__":
    sys.exit(exit_quietly_on_closed_pipe(main))
