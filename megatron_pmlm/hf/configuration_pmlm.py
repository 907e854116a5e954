"""Hugging Face configuration of a PMLM (UniLMv2) checkpoint: BertConfig plus the relative position bias.

Written into every converted folder next to `modeling_pmlm.py` (remote code, `auto_map` in
config.json). `rel_pos_bins` and `max_rel_pos` are the keys the public UniLMv2 s2s-ft toolkit reads
(without them it silently drops the bias).
"""

from transformers import BertConfig


class PMLMConfig(BertConfig):
    model_type = "pmlm"

    def __init__(self, rel_pos_bins: int = 32, max_rel_pos: int = 128, **kwargs):
        super().__init__(**kwargs)
        self.rel_pos_bins = rel_pos_bins
        self.max_rel_pos = max_rel_pos
