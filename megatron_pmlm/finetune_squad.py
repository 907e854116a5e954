"""Fine-tune and evaluate extractive question answering on SQuAD v1.1 / v2.0 with Hugging Face's `Trainer`.

    python -m megatron_pmlm.finetune_squad --model DIR --train-file train-v1.1.json \\
        --predict-file dev-v1.1.json --output-dir out/squad1 [--version-2-with-negative]

The command line; features, post-processing, the official evaluation and the run are in
megatron_pmlm/tasks/squad.py (`--help` says it all). Bad input stops with one `error:` line, exit
status 2.
"""

from __future__ import annotations

import sys
from typing import Sequence

from .parallel.distributed import ends_process_groups
from .tasks.hf_trainer import run_command
from .tasks.squad import build_parser, run


@ends_process_groups
def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
