"""Decoding benchmark: `python tools/bench_decode.py [--preset tiny|base|large | --model DIR]`.

Tokens/s of the cached incremental decoder (each step runs only the new slots) against a full
forward over the whole sequence at every step, on the same sources and settings (default: max
target length 48, batch 32, greedy and beam 5, standard and position-shift modes); the two must
produce identical outputs, which is asserted. tokens = generated wordpieces, each example's output
up to and including its [SEP] (48 per example when it never stops, as with random weights).
Sources: the first --sources lines of ../shared/data/qg/src-dev.txt when present, else random
ids. Prints a markdown table for docs/benchmarks.md; nothing here is a test.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_pmlm.training.checkpoint_files import add_no_checksums_argument  # noqa: E402

SHARED = REPO.parent / "shared" / "data"

from megatron_pmlm.config import non_negative_int, positive_int  # noqa: E402


def load_sources(tokenizer, count: int, vocab_size: int, seed: int) -> tuple[list[list[int]], str]:
    qg = SHARED / "qg" / "src-dev.txt"
    if qg.is_file() and tokenizer is not None:
        lines = qg.read_text(encoding="utf-8").split("\n")[:count]
        return [ids.tolist() for ids in tokenizer.encode_batch(lines)], f"first {count} lines of {qg.name}"
    import numpy as np

    rng = np.random.default_rng(seed)
    return ([rng.integers(1000, vocab_size, size=int(n)).tolist() for n in rng.integers(10, 60, size=count)],
            f"{count} random id sequences of 10-59 tokens")


def build(args):
    import torch

    from megatron_pmlm.tokenizer import WordPieceTokenizer

    if args.model:
        from megatron_pmlm.generation.decoding import build_decoding_model
        from megatron_pmlm.hf.family import check_family
        from megatron_pmlm.pretrained import load_model

        check_family("--model", args.model, "tools/bench_decode.py")
        loaded = load_model(args.model, args.checksums)
        tokenizer = WordPieceTokenizer(loaded.vocabulary)
        model = build_decoding_model(loaded, args.max_seq_length, device=args.device)
        return model, tokenizer, tokenizer.special, (loaded.source_type_id, loaded.target_type_id), str(args.model)

    from megatron_pmlm.config import model_config_from_preset
    from megatron_pmlm.models.model import PMLMForPreTraining
    from megatron_pmlm.tokenizer import SpecialTokenIds

    vocab_file = SHARED / "vocab" / "bert-base-uncased-vocab.txt"
    tokenizer = WordPieceTokenizer(vocab_file) if vocab_file.is_file() else None
    vocab_size = tokenizer.vocab_size if tokenizer else 30522
    config = model_config_from_preset(args.preset, vocab_size=vocab_size, hidden_dropout=0.0, attention_dropout=0.0,
                                      max_position_embeddings=args.max_seq_length, layernorm_epsilon=1e-5)
    model = PMLMForPreTraining(config, init_seed=args.seed).to(args.device).eval()
    special = tokenizer.special if tokenizer else SpecialTokenIds(pad=0, unk=100, cls=101, sep=102, mask=103, pseudo=103)
    torch.manual_seed(args.seed)
    return model, tokenizer, special, (0, 1), f"--preset {args.preset}, random weights"


def timed_decode(decoder, sources, batch_size, device) -> tuple[list[list[int]], float]:
    import torch

    from megatron_pmlm.generation.decoding import decode_in_batches

    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = decode_in_batches(decoder, sources, batch_size)
    if device == "cuda":
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="model shape with random weights (tiny, base, large)")
    parser.add_argument("--model", default=None, help="a model folder instead of --preset")
    add_no_checksums_argument(parser)
    parser.add_argument("--sources", type=positive_int, default=32, help="how many sources to decode")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--max-target-length", type=positive_int, default=48)
    parser.add_argument("--max-seq-length", type=positive_int, default=512)
    parser.add_argument("--beams", type=positive_int, nargs="+", default=[1, 5])
    parser.add_argument("--modes", nargs="+", default=["standard", "pos_shift"], choices=["standard", "pos_shift"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=non_negative_int, default=1,
                        help="torch CPU threads (default 1: per-core figures, immune to a busy neighbour)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    from megatron_pmlm.generation.decoding import Seq2SeqDecoder
    from megatron_pmlm.generation.search import DecodingConfig, generated_length

    from megatron_pmlm.config import ConfigError

    try:
        model, tokenizer, special, (source_type, target_type), description = build(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sources, source_description = load_sources(tokenizer, args.sources, model.config.vocab_size, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"model: {description} ({model.config.num_layers} layers, hidden {model.config.hidden_size}, "
          f"{parameters / 1e6:.1f}M parameters), fp32 on {args.device} ({device_name}, {torch.get_num_threads()} "
          f"threads), torch {torch.__version__}")
    print(f"sources: {source_description}, mean {sum(map(len, sources)) / len(sources):.1f} wordpieces; batch "
          f"{args.batch_size}, max target length {args.max_target_length}")

    stop_ids = {special.sep, special.pad}
    rows = []
    for mode in args.modes:
        for beam in args.beams:
            config = DecodingConfig(beam_size=beam, max_target_length=args.max_target_length,
                                    max_seq_length=args.max_seq_length, pos_shift=mode == "pos_shift")
            results = {}
            for recompute in (False, True):
                decoder = Seq2SeqDecoder(model, special, config, source_type, target_type, full_recompute=recompute)
                decoder.decode(sources[:2])  # warm-up
                outputs, seconds = timed_decode(decoder, sources, args.batch_size, args.device)
                tokens = sum(min(generated_length(ids, stop_ids) + 1, len(ids)) for ids in outputs)
                results[recompute] = (outputs, tokens / seconds, seconds)
            assert results[False][0] == results[True][0], f"{mode} beam {beam}: cached and recomputed outputs differ"
            cached, recomputed = results[False][1], results[True][1]
            rows.append((mode, beam, cached, recomputed, cached / recomputed, results[False][2], results[True][2]))
            print(f"  {mode} beam {beam}: cached {results[False][2]:.1f} s, recompute {results[True][2]:.1f} s",
                  file=sys.stderr, flush=True)

    print("\n| mode | beam | cached tokens/s | recompute tokens/s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for mode, beam, cached, recomputed, speedup, _, _ in rows:
        print(f"| {mode} | {beam} | {cached:,.1f} | {recomputed:,.1f} | {speedup:.2f}x |")
    print("\noutputs identical in every row (asserted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
