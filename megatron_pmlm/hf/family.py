"""Which model family a `--model` / `--load` path holds, read from its file names and one small JSON
file: a Hugging Face folder's config.json (`model_type` "palm"), or a checkpoint directory's newest
run_state.json (`args.model`, which `pretrain --model` records; "pmlm" when absent). The commands
that take only one family refuse the other with one line naming what the path holds and which
command takes it (`wrong_family`)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ..config import ConfigError
from ..training.checkpoint_files import LATEST_FILE, RUN_STATE_FILE, newest_complete_checkpoint

PMLM, PALM = "pmlm", "palm"
DESCRIPTION = {PMLM: "a PMLM/UniLM/BERT model (encoder only)", PALM: "a PALM model (encoder-decoder)"}
USE = {PMLM: "PMLM/UniLM/BERT models fine-tune with finetune_glue, finetune_squad or finetune_s2s and decode "
             "with decode_s2s",
       PALM: "PALM continues text with decode_palm (or decode_s2s)"}


def model_family(path: str | os.PathLike) -> str | None:
    """PMLM or PALM for a Hugging Face folder or a checkpoint directory; None when `path` is neither
    (or unreadable: whoever loads it then says why)."""
    path = Path(path)
    if (path / "config.json").is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError, AttributeError):
            return PALM if json.loads((path / "config.json").read_text()).get("model_type") == PALM else PMLM
        return None
    if (path / LATEST_FILE).is_file():
        return checkpoint_family(path)
    return None


def checkpoint_family(directory: str | os.PathLike, tag: str | None = None) -> str | None:
    """The family of checkpoint `tag` (default: the newest complete one) in `directory`."""
    directory = Path(directory)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if tag is None:
            tag, _ = newest_complete_checkpoint(directory)
        if tag is None:
            tag = (directory / LATEST_FILE).read_text().strip()
        run_state = json.loads((directory / tag / RUN_STATE_FILE).read_text())
        return PALM if run_state.get("args", {}).get("model") == PALM else PMLM
    return None


def wrong_family(flag: str, path: str | os.PathLike, family: str, tool: str, takes: str = PMLM) -> str:
    """One line: what `path` holds, what `tool` takes, and where the other family goes.

    e.g. "--model X is a PALM model (encoder-decoder); finetune_glue takes PMLM/UniLM/BERT models;
    PALM continues text with decode_palm (or decode_s2s)"."""
    wanted = "PMLM/UniLM/BERT models" if takes == PMLM else "PALM models"
    return f"{flag} {path} is {DESCRIPTION[family]}; {tool} takes {wanted}; {USE[family]}"


def check_family(flag: str, path: str | os.PathLike, tool: str, takes: str = PMLM,
                 error: type[ValueError] = ConfigError) -> None:
    """`error` (one line, exit 2 in every command) when `path` holds the other family."""
    family = model_family(path)
    if family is not None and family != takes:
        raise error(wrong_family(flag, path, family, tool, takes))
