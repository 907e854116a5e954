"""Fine-tune on a GLUE task with Hugging Face's `Trainer` (run_glue.py's recipe, thin).

    python -m megatron_pmlm.finetune_glue --model DIR --task mrpc --data-dir ../shared/data/glue \\
        --output-dir out/mrpc [--max-steps N] [--seed 1] [--bf16]

The command line; the tasks, data reading, metrics and the run are in megatron_pmlm/tasks/glue.py
(`--help` says it all). Bad input stops with one `error:` line, exit status 2.
"""

from __future__ import annotations

import sys
from typing import Sequence

from .parallel.distributed import ends_process_groups
from .tasks.glue import build_parser, run
from .tasks.hf_trainer import run_command


@ends_process_groups
def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
