#!/usr/bin/env python
"""Pre-training checkpoint <-> Hugging Face folder (see megatron_pmlm/hf/convert.py, docs/conversion.md).

    python tools/convert_checkpoint.py --load SAVE_DIR [--tag iter_N] --output HF_DIR [--verify]
    python tools/convert_checkpoint.py --from-hf HF_DIR --save SAVE_DIR
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu" if not __import__("torch").cuda.is_available() else "cuda")

from megatron_pmlm.hf.convert import main  # noqa: E402  (the driver: PMLM and PALM checkpoints)

if __name__ == "__main__":
    sys.exit(main())
