#!/usr/bin/env bash
# The question-generation figure of docs/benchmarks.md: does pre-training here help generation?
#
#   tools/qg_experiment.sh PRETRAINED OUT [FINETUNE_ARGS...]
#
# PRETRAINED: a pre-training --save directory (or any model folder). The SQuAD QG pairs of
# ../shared/data/qg are split deterministically: the first 9,570 lines train, the last 1,000 are dev.
# The same fine-tuning runs twice, from PRETRAINED and from random initialisation (the same
# architecture, random weights), then both decode the dev sources with beam 5 and are scored.
set -euo pipefail
PRETRAINED=${1:?usage: tools/qg_experiment.sh PRETRAINED OUT [FINETUNE_ARGS...]}
OUT=${2:?usage: tools/qg_experiment.sh PRETRAINED OUT [FINETUNE_ARGS...]}
shift 2
QG=${QG:-../shared/data/qg}
PY=${PY:-.venv/bin/python}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
mkdir -p "$OUT"
head -n 9570 "$QG/src-dev.txt" > "$OUT/train.src"; head -n 9570 "$QG/tgt-dev.txt" > "$OUT/train.tgt"
tail -n 1000 "$QG/src-dev.txt" > "$OUT/dev.src";   tail -n 1000 "$QG/tgt-dev.txt" > "$OUT/dev.tgt"

# Random initialisation of the same architecture: the pre-trained folder's config, fresh weights.
"$PY" - "$PRETRAINED" "$OUT/random_init" <<'EOF'
import sys
from pathlib import Path
from megatron_pmlm.hf.convert import write_hf_folder
from megatron_pmlm.hf.pmlm_adapter import to_hf_state_dict
from megatron_pmlm.models.model import PMLMForPreTraining
from megatron_pmlm.hf.family import check_family
from megatron_pmlm.pretrained import load_model
check_family("PRETRAINED", sys.argv[1], "tools/qg_experiment.sh")
loaded = load_model(sys.argv[1])
model = PMLMForPreTraining(loaded.config, init_seed=1)
write_hf_folder(Path(sys.argv[2]), to_hf_state_dict(model.state_dict(), loaded.config), loaded.config,
                loaded.vocab_file, loaded.do_lower_case)
EOF

for init in pretrained random_init; do
    model=$PRETRAINED; [ "$init" = random_init ] && model=$OUT/random_init
    "$PY" -m megatron_pmlm.finetune_s2s --model "$model" --train-src "$OUT/train.src" --train-tgt "$OUT/train.tgt" \
        --valid-src "$OUT/dev.src" --valid-tgt "$OUT/dev.tgt" --save "$OUT/ft_$init" \
        --history-json "$OUT/history_$init.json" "$@" 2>&1 | grep -v -i warn | tee "$OUT/finetune_$init.log"
    "$PY" -m megatron_pmlm.decode_s2s --model "$OUT/ft_$init" --input "$OUT/dev.src" --output "$OUT/dev_$init.pred" \
        --beam-size 5 --length-penalty 1.3 --min-length 5 --max-target-length 32 --batch-size 32 --no-progress
    "$PY" -m megatron_pmlm.eval_s2s --pred "$OUT/dev_$init.pred" --ref "$OUT/dev.tgt" --output "$OUT/scores_$init.json"
done
