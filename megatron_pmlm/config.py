"""Configuration dataclasses with the paper's values as defaults (UniLMv2 §4.1, Table 7).

Every component reads its settings from one of these; the command line overrides fields by name
(see `add_dataclass_arguments`). Invalid values fail here, in `__post_init__`, with a message naming
the field, rather than deep inside torch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration value a user supplied is invalid; the message names it."""


ATTENTION_BACKENDS = ("sdpa", "flex", "triton")
"""The attention backends a model computes with (`ModelConfig.attention_backend`)."""
ATTENTION_BACKEND_CHOICES = ("auto",) + ATTENTION_BACKENDS
"""What the entry points' --attention-backend takes: `auto` (their default) picks the fastest backend
that runs here when the run starts (`models.model.resolve_attention_backend`)."""


@dataclass
class ModelConfig:
    """BERT architecture plus UniLMv2's shared relative position bias (SPEC §5)."""

    vocab_size: int = 30522
    """WordPiece vocabulary size (bert-base-uncased: 30,522)."""
    padded_vocab_size: int = 0
    """Rows of the embedding/softmax (0: vocab_size). Padding (Megatron's
    --make-vocab-size-divisible-by) only makes matmuls efficient and splittable: padded entries are
    zero-initialised and masked out of the softmax, so losses do not depend on it."""
    hidden_size: int = 768
    num_layers: int = 12
    num_attention_heads: int = 12
    ffn_hidden_size: int = 3072
    max_position_embeddings: int = 512
    """Longest input (before the appended pseudo-mask tokens, which reuse their twins' positions)."""
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-12
    init_std: float = 0.02
    rel_pos: bool = True
    """Relative position bias on; False gives exactly BERT (the paper's "- rel pos")."""
    rel_pos_bins: int = 32
    max_rel_pos: int = 128
    attention_backend: str = "sdpa"
    """sdpa: torch's scaled_dot_product_attention over a dense additive bias (mask + relative
    position); flex: FlexAttention with a block mask built from roles/steps and the bias as a
    score_mod (no dense [B, heads, T, T] tensor; no attention dropout); triton: our flash attention
    reading the bias per tile from the table (CUDA, SM 8.0+). The entry points' `auto` resolves to
    triton or sdpa before a config is built."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "ffn_hidden_size", "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.padded_vocab_size and self.padded_vocab_size < self.vocab_size:
            raise ConfigError(f"model config: padded_vocab_size {self.padded_vocab_size} is smaller than "
                              f"vocab_size {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model config: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model config: {name} must be in [0, 1), got {getattr(self, name)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"model config: attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")
        if self.rel_pos and (self.rel_pos_bins < 4 or self.rel_pos_bins % 2):
            raise ConfigError(f"model config: rel_pos_bins must be an even number >= 4, got {self.rel_pos_bins}")
        if self.rel_pos and self.max_rel_pos <= self.rel_pos_bins // 4:
            raise ConfigError(
                f"model config: max_rel_pos ({self.max_rel_pos}) must exceed the exact range "
                f"rel_pos_bins/4 ({self.rel_pos_bins // 4})")

    @property
    def embedding_rows(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, dict[str, Any]] = {
    # The paper's BASE model (~110M parameters).
    "base": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072),
    # The LARGE shape (24/1024/16/4096, ~335M parameters).
    "large": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096),
    # For tests and the CPU demo: seconds per hundred steps on two cores.
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                 max_position_embeddings=128),
}


def model_config_from_preset(preset: str, **overrides: Any) -> ModelConfig:
    """The preset's ModelConfig with `overrides` (None values ignored) applied."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(sorted(PRESETS))}")
    values = dict(PRESETS[preset])
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(values) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"unknown model config field(s): {', '.join(sorted(unknown))}")
    return ModelConfig(**values)


@dataclass
class MaskingConfig:
    """Blockwise masking, Algorithm 1 of UniLMv2, and BERT's 80/10/10 corruption."""

    mask_prob: float = 0.15
    """Stop sampling blocks once this fraction of the maskable tokens is masked."""
    block_prob: float = 0.4
    """Probability that a sampled step is an n-gram block rather than a single token."""
    min_block_len: int = 2
    max_block_len: int = 6
    replace_with_mask_prob: float = 0.8
    replace_with_random_prob: float = 0.1
    """The rest (0.1 by default) keeps the original token."""

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"masking config: mask_prob must be in (0, 1), got {self.mask_prob}")
        if not 0.0 <= self.block_prob <= 1.0:
            raise ConfigError(f"masking config: block_prob must be in [0, 1], got {self.block_prob}")
        if not 1 <= self.min_block_len <= self.max_block_len:
            raise ConfigError(
                f"masking config: need 1 <= min_block_len <= max_block_len, got "
                f"{self.min_block_len}..{self.max_block_len}")
        if self.replace_with_mask_prob < 0 or self.replace_with_random_prob < 0 or \
                self.replace_with_mask_prob + self.replace_with_random_prob > 1.0:
            raise ConfigError(
                "masking config: replace_with_mask_prob and replace_with_random_prob must be "
                "non-negative and sum to at most 1")


@dataclass
class UniLMMaskingConfig:
    """UniLM v1's masking (SPEC §8): 15% of the tokens, 80% of masking events one token, 20% a
    bigram or trigram (the released loader's skipgram_prb 0.2, skipgram_size 3), BERT's 80/10/10,
    and next-sentence prediction with random second segments half of the time."""

    mask_prob: float = 0.15
    ngram_prob: float = 0.2
    min_ngram: int = 2
    max_ngram: int = 3
    replace_with_mask_prob: float = 0.8
    replace_with_random_prob: float = 0.1
    nsp_random_prob: float = 0.5

    def __post_init__(self) -> None:
        for name in ("mask_prob", "ngram_prob", "nsp_random_prob", "replace_with_mask_prob",
                     "replace_with_random_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"UniLM masking config: {name} must be in [0, 1], got {getattr(self, name)}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"UniLM masking config: need 1 <= min_ngram <= max_ngram, got "
                              f"{self.min_ngram}..{self.max_ngram}")
        if self.replace_with_mask_prob + self.replace_with_random_prob > 1.0:
            raise ConfigError("UniLM masking config: replace_with_mask_prob + replace_with_random_prob exceeds 1")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in --help, help text or not (argparse shows it only for options with
    help); an option whose default is resolved later says so in its help ("default: ...")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default:" in text or "(default" in text or action.default is argparse.SUPPRESS \
                or not action.option_strings or action.required:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            shown = "on" if action.default else "off"
        elif action.default is None:
            shown = "not set"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".strip()

    def _format_action(self, action: argparse.Action) -> str:
        # argparse formats no help line at all for an option without help text: give it one, the default.
        if not action.help and action.option_strings and not action.required and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)


def _number(text: str, kind: type, minimum: float, meaning: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {meaning}, got {text!r}") from None
    if not value >= minimum:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be {meaning}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type for a count or size where 0 would do nothing and still "succeed": argparse's
    one-line error names the flag (`argument --examples: must be a positive integer, got 0`)."""
    return _number(text, int, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse type for an index, a seed, or a count whose 0 has a documented meaning."""
    return _number(text, int, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """An argparse type for an amount that must be above 0 (epochs, megabytes)."""
    value = _number(text, float, 0, "a positive number")
    if value == 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str = "",
                            skip: tuple[str, ...] = ()) -> None:
    """Add `--field-name` options for every field of `cls` (argparse default None = keep the
    dataclass's, which --help shows)."""
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        shown = f"(default: {f.default})" if f.default is not dataclasses.MISSING else None
        if f.type in ("bool", bool):
            group.add_argument(flag, type=_parse_bool, default=None, metavar="{true,false}", help=shown)
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            group.add_argument(flag, type=kind, default=None, help=shown)


def dataclass_overrides(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of `cls` the user set on the command line."""
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, (prefix + f.name).replace("-", "_"), None)
        if value is not None:
            out[f.name] = value
    return out


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


__all__ = ["ConfigError", "HelpFormatter", "positive_int", "non_negative_int", "positive_float", "ModelConfig", "MaskingConfig", "UniLMMaskingConfig", "PRESETS", "model_config_from_preset",
           "add_dataclass_arguments", "dataclass_overrides"]
