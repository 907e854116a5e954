"""Hugging Face configuration of a PALM checkpoint: BertConfig (the encoder) plus the decoder and
the pointer-generator.

Written into every converted PALM folder next to `modeling_palm.py` (remote code, `auto_map` in
config.json)."""

from transformers import BertConfig


class PalmConfig(BertConfig):
    model_type = "palm"

    def __init__(self, num_decoder_layers: int = 12, copy_attention_size: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.num_decoder_layers = num_decoder_layers
        self.copy_attention_size = copy_attention_size
        """Width of the copy attention's tanh layer (0: hidden_size)."""
