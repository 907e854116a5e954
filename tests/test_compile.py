"""Compiled step (`--compile`, models/compiled.py): no graph break in a layer nor in any other
compiled region (embed, losses), compiled equals eager in the loss and every gradient for PMLM,
UniLM and seq2seq (inductor's C++ backend, fp32, dropout 0), real pretrain and
finetune_s2s runs with the eager run's losses at ZeRO 0-2, the refusals, and a resume that
toggles the flag. Tiny preset; the widths repeat across tests so inductor's on-disk cache serves
all but the first compilation."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pmlm_testing import REPO_ROOT, RUN_ENVIRONMENT, one_thread, run_module, run_python, run_tool
from test_attention_bias import pmlm_case, seq2seq_case, unilm_case
from megatron_pmlm.config import MaskingConfig, model_config_from_preset
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.models import compiled
from megatron_pmlm.models.flex_attention import LAYOUT_QUANTUM_ENV
from megatron_pmlm.models.model import BertLayer, PMLMForPreTraining
from megatron_pmlm.parallel.layers import LabelSmoothing, chunked_biased_cross_entropy

VOCAB = 200
RUN_QUANTUM = 64
"""The layout quantum of the test runs (eager and compiled alike, through $PMLM_LAYOUT_QUANTUM):
every tiny layout (seq 64) is one width, so each run compiles one shape (the default 16: two or three)."""


def _tiny_config():
    return model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)


def _batch(seed: int = 0, lengths=(40, 25, 33)):
    rng = np.random.default_rng(seed)
    ids_list, segments_list, masks = [], [], []
    for length in lengths:
        ids = rng.integers(5, VOCAB, length)
        ids[0], ids[length // 2], ids[-1] = 1, 2, 2
        ids_list.append(ids)
        segments_list.append((np.arange(length) > length // 2).astype(np.int64))
        masks.append(mask_example(ids, ids >= 5, rng, MaskingConfig(), VOCAB, np.arange(5), 3))
    return build_batch(ids_list, segments_list, masks, pseudo_token_id=4, pad_token_id=0)


def test_a_layer_compiles_as_one_graph_without_breaks():
    config = _tiny_config()
    layer = BertLayer(config, PMLMForPreTraining(config).layers)
    hidden = torch.randn(2, 24, config.hidden_size)
    bias = torch.randn(2, config.num_attention_heads, 24, 24).masked_fill(torch.rand(2, 1, 24, 24) < 0.2,
                                                                           float("-inf"))
    explanation = torch._dynamo.explain(layer)(hidden, bias)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_layers_save_the_residual_sums_and_keep_the_dropout_masks(monkeypatch):
    """Under --compile each BertSelfOutput's residual sum is saved for the backward (selective
    checkpointing's MUST_SAVE; models.model.RESIDUAL_SUMS_SAVED) rather than recomputed: the layer is
    still one graph, and with dropout its output and every gradient are those of the same compiled
    layer without the mark (the same seed, so the same masks): the backward used the forward's masks,
    none redrawn. Eager runs are not wrapped."""
    from megatron_pmlm.models import model as model_module

    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    layer = BertLayer(config, PMLMForPreTraining(config).layers).train()
    hidden = torch.randn(2, 24, config.hidden_size)
    bias = torch.randn(2, config.num_attention_heads, 24, 24).masked_fill(torch.rand(2, 1, 24, 24) < 0.2,
                                                                           float("-inf"))
    explanation = torch._dynamo.explain(layer)(hidden.requires_grad_(), bias)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons

    def step(saved: bool):
        monkeypatch.setattr(model_module, "RESIDUAL_SUMS_SAVED", saved)
        torch._dynamo.reset()
        compiled = torch.compile(BertLayer.forward, dynamic=False)
        layer.zero_grad(set_to_none=True)
        inputs = hidden.detach().requires_grad_()
        torch.manual_seed(7)
        with one_thread():
            out = compiled(layer, inputs, bias)
            (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), {**{name: p.grad for name, p in layer.named_parameters()}, "input": inputs.grad}

    saved_out, saved_grads = step(True)
    recomputed_out, recomputed_grads = step(False)
    torch.testing.assert_close(saved_out, recomputed_out, rtol=0, atol=0)
    for name, grad in recomputed_grads.items():
        _fp32_close(saved_grads[name], grad, name)
    calls = []
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(a) or a[0](*a[1:]))
    layer(hidden, bias).sum().backward()  # eager: no checkpoint wrapper
    assert calls == []


STEP_CASES = {"pmlm": lambda: pmlm_case("ae+par"), "unilm": unilm_case, "s2s": lambda: seq2seq_case("masked")}
"""The models --compile serves (tests/test_attention_bias.py's tiny cases): PMLM, UniLM v1 (its NSP
head and loss), seq2seq fine-tuning (label smoothing)."""


def _fp32_close(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal up to fp32 summation order: inductor sums an embedding table's gradient rows in its own
    order (a scatter), so the tolerance scales with the tensor's largest entry (rows hit by many
    slots: the padding id, the position ids)."""
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_losses_read_the_padded_output_as_the_cut_one(case):
    """Eager, padded to the compile quantum (the encoder's output is not cut: the losses widen their
    gather index) against unpadded: the same loss and every gradient."""
    unpadded, loss = STEP_CASES[case]()
    padded, _ = STEP_CASES[case]()
    padded.bert.layout_quantum = 64  # every tiny layout gets padding slots
    expected, got = loss(unpadded), loss(padded)
    expected.backward()
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for (name, p), (_, q) in zip(padded.named_parameters(), unpadded.named_parameters()):
        _fp32_close(p.grad, q.grad, name)


@pytest.fixture(scope="module", params=sorted(STEP_CASES))
def compiled_step(request):
    """(eager model, the same model with every region compiled, loss function): one compiled model
    per case for the module."""
    eager, loss = STEP_CASES[request.param]()
    model, _ = STEP_CASES[request.param]()
    counts = compiled.compile_step_regions(model)
    assert counts == {"layers": model.config.num_layers, "embed": 1, "losses": 1}
    assert model.bert.layout_quantum == compiled.COMPILE_LAYOUT_QUANTUM
    eager.bert.layout_quantum = compiled.COMPILE_LAYOUT_QUANTUM  # the same padded width
    return eager, model, loss


def test_every_compiled_region_is_one_graph_without_breaks(compiled_step):
    _, model, loss = compiled_step
    captured = {}
    regions = {"embed": model.bert.embed, "losses": model.losses}
    originals = {name: region.compiled for name, region in regions.items()}

    def capture(name):
        def run(*args, **kwargs):
            captured[name] = (args, kwargs)
            return regions[name].eager(*args, **kwargs)
        return run
    for name, region in regions.items():
        region.compiled = capture(name)
    try:
        loss(model)
    finally:
        for name, region in regions.items():
            region.compiled = originals[name]
    for name, (args, kwargs) in captured.items():
        explanation = torch._dynamo.explain(regions[name].eager)(*args, **kwargs)
        assert explanation.graph_break_count == 0, (name, explanation.break_reasons)
        assert explanation.graph_count == 1, name
    assert sorted(captured) == ["embed", "losses"]


OUTSIDE_GRAPHS = {"forward: aten::ones_like", "backward CompiledFunctionBackward: aten::add_", "forward: aten::pad"}
"""What a compiled step (forward + backward) may still run outside compiled graphs: the backward's
seed (d loss / d loss = 1), autograd's sums of a tensor's gradients from several graphs (the
shared attention bias's over the layers, the tied word embedding's from the embeddings and the
MLM head), and the layout's padding to the quantum (five small [B, T] pads)."""


def test_only_the_seed_autograd_sums_and_the_padding_run_outside_the_compiled_graphs(compiled_step):
    """No cut of the output nor its backward, no zero gradient of a logged loss."""
    from megatron_pmlm.training.kernel_count import kernel_sources

    _, model, loss = compiled_step
    pad, widths = model.bert.pad_layout, []
    model.bert.pad_layout = lambda *args: (widths.append(args[0].shape[1]), pad(*args))[1]

    def step():
        model.zero_grad(set_to_none=True)  # gradients assigned, not added to earlier ones
        loss(model).backward()
    try:
        step()  # compiled (and warm) before profiling
        sources = kernel_sources(step)
    finally:
        del model.bert.pad_layout  # the method again
    assert widths[-1] % compiled.COMPILE_LAYOUT_QUANTUM, widths  # the layout is padded
    outside = {source for source in sources if not source.split(": ", 1)[1].startswith(("generated", "extern"))}
    assert outside <= OUTSIDE_GRAPHS, sorted(sources.items())
    assert any(": extern " in source for source in sources)  # the compiled graphs ran (their GEMMs)


def test_compiled_step_equals_eager_in_losses_and_every_gradient(compiled_step):
    """With and without activation checkpointing: one compilation per region serves both passes
    (the layer recomputed under non-reentrant checkpointing; identical layers share one graph)."""
    eager, model, loss = compiled_step
    from torch._dynamo.utils import counters

    for checkpointing in (False, True):
        graphs_before = counters["stats"]["unique_graphs"]
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
            m.bert.encoder.checkpoint_activations = checkpointing
        expected, got = loss(eager), loss(model)
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            assert p.grad is not None, name
            _fp32_close(p.grad, q.grad, name)
        if checkpointing:
            assert counters["stats"]["unique_graphs"] == graphs_before  # nothing compiled anew


def test_a_width_whose_compilation_fails_runs_eagerly_and_the_run_goes_on(monkeypatch, capfd):
    """A width met days into a run whose compilation fails (inductor or Triton failing, a full cache
    disk) used to end the step, and a requeued run met the same width again. Now the region runs
    eagerly at that width (announced once), whether the forward's compilation fails or the
    backward's (compiled in the same call, not at the first backward); with activation
    checkpointing the recomputation runs eagerly too; the failed width is not compiled again, and
    the widths that compiled stay compiled. Losses and gradients are the eager model's throughout.
    A hidden size of its own: no other test's compiled graphs (dynamo's and inductor's caches) can
    stand in for the compilations that must fail here."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # compiled, not read from inductor's caches (torch's own config patching restores them)
    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
        _a_width_whose_compilation_fails(monkeypatch, capfd)


def _a_width_whose_compilation_fails(monkeypatch, capfd) -> None:
    import torch._inductor.compile_fx as compile_fx

    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_size=40, num_attention_heads=4,
                                      ffn_hidden_size=80, hidden_dropout=0.0, attention_dropout=0.0)
    eager, model = PMLMForPreTraining(config, init_seed=3), PMLMForPreTraining(config, init_seed=3)
    compiled.compile_step_regions(model)
    eager.bert.layout_quantum = model.bert.layout_quantum
    for m in (eager, model):
        m.bert.encoder.checkpoint_activations = True
    original = compile_fx._compile_fx_inner
    failing = {"graphs": None, "calls": 0}

    def compile_or_fail(graph, example_inputs, **kwargs):
        if failing["graphs"] is not None:
            failing["calls"] += 1
            if failing["graphs"] == "all" or kwargs.get("is_backward"):
                raise OSError(28, "No space left on device (injected)")
        return original(graph, example_inputs, **kwargs)
    monkeypatch.setattr(compile_fx, "_compile_fx_inner", compile_or_fail)

    def step(batch):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        expected, got = eager.forward_batch(batch).loss, model.forward_batch(batch).loss
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            _fp32_close(p.grad, q.grad, name)

    first, forward_fails, backward_fails = _batch(0, (20, 14)), _batch(1, (60, 41)), _batch(2, (90, 70))
    step(first)  # compiles
    failing["graphs"] = "all"
    capfd.readouterr()
    step(forward_fails)
    announced = capfd.readouterr().err
    assert re.search(r"compiling transformer layer for width \d+ failed \(.*No space left on device", announced), announced
    assert re.search(r"compiling embed for width \d+ failed", announced), announced
    assert "runs eagerly at this shape from now on" in announced
    calls = failing["calls"]
    step(forward_fails)  # the failed width again: no compilation tried
    assert failing["calls"] == calls and "failed" not in capfd.readouterr().err
    failing["graphs"] = "backward"
    step(backward_fails)
    announced = capfd.readouterr().err
    assert re.search(r"compiling transformer layer for width \d+ failed", announced), announced
    failing["graphs"], failing["calls"] = None, 0
    step(first)  # the first width stays compiled: nothing compiled, nothing failed
    assert "compiling" not in capfd.readouterr().err


def test_compiled_regions_stay_compiled_after_the_host_sync_counter(compiled_step):
    """HostSyncCounter patches Tensor methods; without its "force_eager" stance dynamo gave up on the
    compiled regions for the rest of the process (a `--profile-trace` after bench_train's proxies
    then traced the eager model). Under it the step runs eagerly; after it the same graphs run."""
    from megatron_pmlm.training.host_syncs import HostSyncCounter
    from megatron_pmlm.training.kernel_count import kernel_sources

    _, model, loss = compiled_step
    step = lambda: loss(model).backward()  # noqa: E731
    step()
    before = kernel_sources(step)
    assert any(": extern " in source for source in before)  # the compiled graphs' GEMMs
    with HostSyncCounter() as syncs:
        step()
    assert syncs.count("ours") == 0
    assert kernel_sources(step) == before


def test_count_kernels_counts_the_ops_that_compute():
    from megatron_pmlm.training.kernel_count import count_kernels

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    # mm, relu, the copy inside contiguous() of a transposed tensor, sum; not t() nor view()
    assert count_kernels(lambda: (a @ b).relu().t().contiguous().view(-1).sum(), compiled=False) == 4
    assert count_kernels(lambda: (a @ b).t().unsqueeze(0).detach(), compiled=False) == 1  # views and aliases launch nothing


SLOT_COUNTS = (9, 13, 20)
"""Slot counts above the chunk of the cross-entropy tests below (4 rows): a micro batch of 256 at
seq 128 predicts ~9,800 slots, over CROSS_ENTROPY_CHUNK_ROWS (4,096)."""


@pytest.mark.parametrize("smoothing", [None, LabelSmoothing(0.1, 33, pad_id=2)], ids=["mlm", "smoothed"])
def test_compiled_cross_entropy_compiles_once_for_every_slot_count_above_the_chunk(smoothing):
    """The losses region has symbolic sizes (one compilation for every slot count); the chunk loop
    over the count made each count above the chunk a compilation of its own, which on one H100 at
    micro batch 256 recompiled the losses at every step. Compiled (one chunk) equals eager (chunks)."""
    from torch._dynamo.utils import counters

    def losses(logits, labels, bias):
        return chunked_biased_cross_entropy(logits, labels, bias, chunk_rows=4, label_smoothing=smoothing)
    compiled_losses = torch.compile(losses, dynamic=True)
    generator = torch.Generator().manual_seed(0)
    graphs_before = counters["stats"]["unique_graphs"]
    for rows in SLOT_COUNTS:
        logits = (torch.randn(rows, 37, generator=generator) * 3).requires_grad_()
        bias = torch.randn(37, generator=generator).masked_fill(torch.arange(37) >= 33, float("-inf"))
        bias.requires_grad_()
        labels = torch.randint(0, 33, (rows,), generator=generator)
        upstream = torch.rand(rows, generator=generator)
        results = {}
        for name, function in (("eager", losses), ("compiled", compiled_losses)):
            logits.grad = bias.grad = None
            row_losses, predicted = function(logits, labels, bias)
            (row_losses * upstream).sum().backward()
            results[name] = (row_losses.detach(), predicted, logits.grad, bias.grad)
        for got, expected, what in zip(results["compiled"], results["eager"], ("losses", "argmax", "logits", "bias")):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_dynamic_regions_compile_once_whatever_sizes_happen_to_be_equal_at_the_first_call():
    """The losses region reads the predicted slots from the encoder's padded output through a widened
    index (`layout.gather_slots`); a branch on "padded or not", and dynamo's duck sizing of the two
    widths when they are equal, made the region's first compilation specialise on it, so the first
    micro batch of the other kind compiled the region again (a UniLM run on the CPU did, its first
    width also equal to the tiny hidden size). Compiled, the index is always widened and
    `CompiledRegion` traces without duck sizing: one graph each, the eager values."""
    from torch._dynamo.utils import counters

    from megatron_pmlm.models.layout import gather_slots

    compiled_gather = compiled.CompiledRegion("slots", gather_slots, dynamic=True)
    generator = torch.Generator().manual_seed(0)
    graphs_before = counters["stats"]["unique_graphs"]
    for width, padded in ((48, 48), (45, 64), (80, 80), (70, 96)):
        hidden = torch.randn(3, padded, 8, generator=generator)
        index = torch.randint(0, 3 * width, (11,), generator=generator)
        torch.testing.assert_close(compiled_gather(hidden, index, width), gather_slots(hidden, index, width))
        rows, columns = index // width, index % width
        torch.testing.assert_close(gather_slots(hidden, index, width), hidden[rows, columns])
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    # A width equal to the hidden size when the region is traced (UniLM's tiny runs: 64 and 64)
    projection = torch.nn.Linear(8, 8)
    compiled_projection = compiled.CompiledRegion("projection", lambda hidden: projection(hidden).sum(1), dynamic=True)
    graphs_before = counters["stats"]["unique_graphs"]
    for width in (8, 12, 20):
        hidden = torch.randn(3, width, 8, generator=generator)
        torch.testing.assert_close(compiled_projection(hidden), projection(hidden).sum(1))
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_compiled_cross_entropy_backward_writes_no_fp32_slots_by_vocabulary_tensor():
    """pretrain's path (DeepSpeed's bf16 logits and bias): compiled, the softmax's gradient goes
    from the bf16 logits to their bf16 gradient in fused kernels; a scatter at the labels had
    inductor write the fp32 [slots, vocabulary] probabilities out first (1.2 GB at ~9,800 slots)."""
    from torch._inductor.utils import run_and_get_code

    def step(logits, labels, bias):
        chunked_biased_cross_entropy(logits, labels, bias, chunk_rows=4)[0].sum().backward()
    logits = torch.randn(13, 300).to(torch.bfloat16).requires_grad_()
    bias = torch.zeros(300, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 300, (13,))
    _, sources = run_and_get_code(torch.compile(step, dynamic=True), logits, labels, bias)
    buffers = [line.strip() for source in sources for line in source.splitlines() if "empty_strided" in line]
    assert any("torch.bfloat16" in line for line in buffers), sources  # the backward's code was captured
    two_dimensional_fp32 = [line for line in buffers if "torch.float32" in line
                            and re.search(r"empty_strided\w*\(\(\w+, \w+\)", line)
                            and not re.search(r"empty_strided\w*\(\(\w+, 1\)", line)]
    assert not two_dimensional_fp32, buffers
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


TRACED_REGIONS = ("embed", "forward", "losses")
"""The compiled regions' functions (BertModel.embed, BertLayer.forward, the model's losses) as
dynamo's log names them when it has traced them
(`TORCH_LOGS=dynamo`: "torchdynamo done tracing <name>"): the proof that a run compiled, which the
regions' own announcements (made before dynamo runs) are not."""


def traced_regions(log: str) -> set[str]:
    return {name for name in TRACED_REGIONS if f"torchdynamo done tracing {name} " in log}


def _pretrain(samples, tmp_path, name, *args, timeout=600, nproc=1):
    history = tmp_path / f"{name}.json"
    result = run_module(
        "megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(samples), "--micro-batch-size", "8",
        "--global-batch-size", "16", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--history-json", str(history), *args, timeout=timeout, nproc=nproc,
        env={LAYOUT_QUANTUM_ENV: str(RUN_QUANTUM), "TORCH_LOGS": "dynamo"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [r for r in json.loads(history.read_text()) if "loss" in r], result


@pytest.fixture(scope="module")
def eager_run(pretraining_samples, tmp_path_factory):
    """Two eager ZeRO-0 iterations, saved: the reference losses and the checkpoint to resume."""
    folder = tmp_path_factory.mktemp("eager")
    records, _ = _pretrain(pretraining_samples, folder, "eager", "--train-iters", "2", "--save", str(folder / "ckpt"))
    return [r["loss"] for r in records], folder / "ckpt"


@pytest.fixture(scope="module")
def compiled_run(pretraining_samples, tmp_path_factory):
    """The eager run's settings compiled, saved: its records and output, and the checkpoint a resume
    that turns --compile off starts from (one compiled process serves both tests)."""
    folder = tmp_path_factory.mktemp("compiled")
    records, result = _pretrain(pretraining_samples, folder, "compiled", "--train-iters", "2", "--zero-stage", "0",
                                "--compile", "--save", str(folder / "ckpt"))
    return records, result, folder / "ckpt"


@pytest.mark.parametrize("zero_stage", ["0", "2"])
def test_pretrain_compile_gives_the_eager_losses(zero_stage, eager_run, pretraining_samples, tmp_path, request):
    reference = eager_run[0]
    if zero_stage == "0":
        records, result, _ = request.getfixturevalue("compiled_run")
    else:
        records, _ = _pretrain(pretraining_samples, tmp_path, "eager", "--train-iters", "2", "--zero-stage", zero_stage)
        reference = [r["loss"] for r in records]
        records, result = _pretrain(pretraining_samples, tmp_path, "compiled", "--train-iters", "2", "--zero-stage",
                                    zero_stage, "--compile")
    assert [r["loss"] for r in records] == pytest.approx(reference, rel=1e-5)
    assert traced_regions(result.stderr) == set(TRACED_REGIONS), result.stderr[-2000:]  # compiled, not eager
    announced = [line for line in result.stderr.splitlines() if line.startswith("compiled layers: compiling")]
    assert announced, result.stderr[-2000:]
    regions = [line for line in result.stderr.splitlines() if line.startswith("compiled regions: compiling")]
    assert any(line.startswith("compiled regions: compiling embed for width") for line in regions), regions
    assert any(line.startswith("compiled regions: compiling losses for every width") for line in regions), regions
    widths = [int(line.split("for width ")[1].split()[0]) for line in announced + regions if "for width " in line]
    assert all(width % RUN_QUANTUM == 0 for width in widths), announced + regions


def test_resume_that_toggles_compile_lists_it_as_a_changed_setting(compiled_run, pretraining_samples, tmp_path):
    """The compiled run's checkpoint resumed eagerly (the same toggle as eager -> compiled, without a
    second compiled process): listed as a changed setting, and the checkpoint trains on uncompiled."""
    *_, checkpoint = compiled_run
    records, result = _pretrain(pretraining_samples, tmp_path, "resumed", "--train-iters", "3", "--load",
                                str(checkpoint))
    assert "resuming with changed settings:" in result.stdout
    changed = result.stdout.split("resuming with changed settings:")[1].splitlines()[0]
    assert "compile True -> False" in changed, changed
    assert [r["iteration"] for r in records] == [3]
    assert "compiled regions: compiling" not in result.stderr


def test_pipeline_stages_compile_their_layers_head_and_loss_and_give_the_eager_run(eager_run, pretraining_samples,
                                                                                  tmp_path):
    """--compile with --pipeline-model-parallel-size 2 and --checkpoint-activations: each stage
    compiles its layers as one region (`BertLayer.forward`, the stage cache's bookkeeping outside),
    the last stage its head and loss; losses, and the relative-bias table trained through the
    stages, equal the single-process eager run's (as every layout does: tests/test_distributed.py).
    Recomputed by DeepSpeed's non-reentrant checkpoint, the layers run with grad only: one
    compilation per width, none without grad (the reentrant checkpoint's forward would add them)."""
    from megatron_pmlm.pretrained import load_model

    reference, checkpoint = eager_run
    records, result = _pretrain(pretraining_samples, tmp_path, "pipeline", "--train-iters", "2", "--compile",
                                "--pipeline-model-parallel-size", "2", "--checkpoint-activations", "--save",
                                str(tmp_path / "ckpt"), nproc=2)
    assert [r["loss"] for r in records] == pytest.approx(reference, rel=2e-4, abs=2e-4)
    tables = [load_model(path).state_dict["bert.rel_pos_bias.weight"] for path in (tmp_path / "ckpt", checkpoint)]
    assert float((tables[0] - tables[1]).abs().max()) <= 1e-5
    traced = set(re.findall(r"\[rank(\d)\]:.*torchdynamo start tracing forward (\S+):\d+", result.stderr))
    layer_file, pipeline_file = (str(Path(compiled.__file__).with_name(name)) for name in ("model.py", "pipeline.py"))
    assert traced == {("0", layer_file), ("1", layer_file), ("1", pipeline_file)}, traced
    announced = [line for line in result.stderr.splitlines() if line.startswith("compiled regions: compiling")]
    layers = [line for line in announced if line.startswith("compiled regions: compiling transformer layer for width")]
    widths = [int(line.split("for width ")[1].split()[0]) for line in layers]
    assert widths and all(width % RUN_QUANTUM == 0 for width in widths), announced
    assert not any("no grad" in line for line in layers), layers
    for region in ("head", "losses"):  # announced by the last rank, which holds the last stage
        assert any(line.startswith(f"compiled regions: compiling {region} for every width") for line in announced), \
            announced


def test_pipeline_stages_recompute_compiled_layers_with_their_dropout(pretraining_samples, tmp_path):
    """With dropout, DeepSpeed's non-reentrant checkpoint recomputes the compiled layers drawing the
    forward's masks: the same losses and gradient norms as the compiled run without checkpointing.
    The stage's backward runs twice (hidden states, then the table, the graph retained), which a
    compiled backward with donated buffers refuses: this run failed so."""
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    runs = [_pretrain(pretraining_samples, tmp_path, name, "--train-iters", "2", "--compile",
                      "--pipeline-model-parallel-size", "2", *dropout, *extra, nproc=2)[0]
            for name, extra in (("stored", []), ("recomputed", ["--checkpoint-activations"]))]
    stored, recomputed = ([value for r in records for value in (r["loss"], r["grad_norm"])] for records in runs)
    assert recomputed == pytest.approx(stored, rel=1e-6) and len(stored) == 4


def test_the_pipeline_stage_tool_compares_a_compiled_stage_with_eager(tmp_path):
    """tools/bench_pipeline_stage.py (the CPU proxy in docs/benchmarks.md): a stage of LayerPipes
    compiled launches fewer kernels per micro batch than eager and computes the same output and
    relative-bias table gradient; an output it cannot write is refused before any work."""
    tool = ["bench_pipeline_stage.py", "--preset", "tiny", "--layers", "2", "--seq-length", "64",
            "--micro-batch-size", "2", "--warmup", "0", "--iterations", "1"]
    result = run_tool(*tool, "--json", str(tmp_path / "stage.json"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((tmp_path / "stage.json").read_text())
    assert figures["width"] % compiled.compile_layout_quantum() == 0 and figures["layers"] == 2
    assert 0 < figures["compiled_kernels"] < figures["eager_kernels"], figures
    assert figures["output_difference"] <= 1e-5 and figures["table_gradient_difference"] <= 1e-5, figures
    assert "| compiled |" in result.stdout
    refused = run_tool(*tool, "--json", str(tmp_path / "missing" / "stage.json"), timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --json"), refused.stderr
    assert "compiled regions" not in refused.stderr


@pytest.mark.parametrize("args,reason", [
    (["--zero-stage", "3"], "--compile with --zero-stage 3: ZeRO-3 gathers"),
    (["--tensor-model-parallel-size", "2"], "--compile with --tensor-model-parallel-size 2: megatron-core"),
    (["--attention-backend", "flex", "--attention-dropout", "0"], "--compile with --attention-backend flex"),
])
def test_compile_is_refused_in_one_line_where_it_cannot_work(args, reason, pretraining_samples, tmp_path):
    result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(pretraining_samples),
                        "--compile", "--save", str(tmp_path / "out"), "--tensorboard-dir", str(tmp_path / "tb"),
                        *args, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {reason}") and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_finetune_s2s_compile_gives_the_eager_losses(tiny_hf_model, qg_pairs, tmp_path):
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        history = tmp_path / f"{name}.json"
        result = run_module("megatron_pmlm.finetune_s2s", "--model", str(tiny_hf_model), "--train-src",
                            str(qg_pairs[0]), "--train-tgt", str(qg_pairs[1]), "--max-source-length", "48",
                            "--max-target-length", "16", "--micro-batch-size", "8", "--global-batch-size", "16",
                            "--train-iters", "2", "--log-interval", "1", "--hidden-dropout", "0",
                            "--attention-dropout", "0", "--history-json", str(history), *extra, timeout=600,
                            env={LAYOUT_QUANTUM_ENV: str(RUN_QUANTUM)})
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        losses[name] = [r["loss"] for r in json.loads(history.read_text()) if "loss" in r]
    assert len(losses["eager"]) == 2
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)


def test_finetune_s2s_refuses_compile_with_zero3_in_one_line(tiny_hf_model, qg_pairs, tmp_path):
    result = run_module("megatron_pmlm.finetune_s2s", "--model", str(tiny_hf_model), "--train-src", str(qg_pairs[0]),
                        "--train-tgt", str(qg_pairs[1]), "--compile", "--zero-stage", "3", "--save",
                        str(tmp_path / "out"), timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith("error: --compile with --zero-stage 3") and \
        len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_palm_compiles_one_graph_per_region_for_every_length_and_equals_eager():
    """PALM under --compile's regions: the encoder's layers and embed at the padded context width,
    the decoder's embed, its layers (one region for all), the pointer-generator and the losses with
    symbolic sizes, so
    other continuation lengths and context lengths (one equal to the continuation's) within the
    padded width compile nothing new; stage 2's loss and every gradient equal eager's.
    Compiled as tools/bench_palm_step.py compiles in its test below (one thread, as `run_module`
    gives it; its kernels visible to the profiler that counts them, `prepare_compiled_counting`) at
    that test's padded context width, so that inductor's cache serves its ~40 kernels with these
    (~40 s of g++ on this 2-core machine)."""
    import torch._inductor.config as inductor_config

    with one_thread(), inductor_config.patch({"cpp.enable_kernel_profile": True}):
        _palm_compiles_one_graph_per_region_for_every_length_and_equals_eager()


def _palm_compiles_one_graph_per_region_for_every_length_and_equals_eager() -> None:
    import copy

    import torch._dynamo.utils

    from megatron_pmlm.models.layout import CONTEXT, PAD
    from megatron_pmlm.models.palm import PalmForPreTraining, palm_config_from_preset

    vocab = 30522  # bert-base-uncased's, padded as pretrain pads it: the graphs of the tool's test below
    config = palm_config_from_preset("palm-tiny", vocab_size=vocab, padded_vocab_size=30592, hidden_dropout=0.0,
                                     attention_dropout=0.0)
    eager = PalmForPreTraining(config, init_seed=0).train()
    model = copy.deepcopy(eager)
    counts = compiled.compile_step_regions(model)
    assert counts["layers"] == config.num_layers + config.num_decoder_layers and counts["embed"] == 1
    assert counts["decoder embed"] == counts["pointer generator"] == counts["losses"] == 1
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch, context, continuation in ((2, 12, 7), (2, 9, 9), (2, 14, 5)):  # one padded context width
        generator = torch.Generator().manual_seed(context)
        ids = torch.randint(5, vocab, (batch, context), generator=generator)
        roles = torch.full_like(ids, CONTEXT)
        roles[-1, context - 3:], ids[-1, context - 3:] = PAD, 0
        decoder_ids = torch.randint(5, vocab, (batch, continuation), generator=generator)
        labels = torch.randint(5, vocab, (batch, continuation), generator=generator)
        labels[0, -2:] = -100
        inputs = (ids, roles, ids.clone(), torch.full_like(ids, -100), decoder_ids, labels)
        losses = []
        for network in (eager, model):
            network.zero_grad()
            loss = network(*inputs).loss
            loss.backward()
            losses.append(float(loss))
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        for (name, reference), (_, parameter) in zip(eager.named_parameters(), model.named_parameters()):
            if reference.grad is not None:
                scale = float(reference.grad.abs().max()) + 1e-6
                assert float((parameter.grad - reference.grad).abs().max()) <= 1e-5 * scale, name
    # the encoder's embed and layer, the decoder's embed and layer, the pointer-generator, the losses
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 6


def test_pretrain_palm_compile_gives_the_eager_losses(palm_samples, tmp_path):
    """`pretrain --model palm --compile` (stage 2, with --checkpoint-activations) runs the regions
    above, each traced once (no recompilation across the run's batches), with the eager run's losses."""
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile", "--checkpoint-activations"])):
        history = tmp_path / f"{name}.json"
        result = run_module("megatron_pmlm.pretrain", "--model", "palm", "--preset", "palm-tiny", "--data-path",
                            str(palm_samples), "--micro-batch-size", "4", "--global-batch-size", "8",
                            "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
                            "--attention-dropout", "0", "--history-json", str(history), *extra, timeout=600,
                            env={LAYOUT_QUANTUM_ENV: str(RUN_QUANTUM), "TORCH_LOGS": "dynamo,recompiles"})
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        losses[name] = [r["loss"] for r in json.loads(history.read_text()) if "loss" in r]
    assert len(losses["eager"]) == 2 and losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
    # "[frame/compile] Step 1": a new trace; "[frame/compile_restart]" is the same compilation restarted
    traced = re.findall(r"\[\d+/\d+\] Step 1: torchdynamo start tracing (\w+) \S+/models/(\w+\.py):\d+",
                        result.stderr)
    assert sorted(traced) == [("embed", "model.py"), ("embed", "palm.py"), ("forward", "model.py"),
                              ("forward", "palm.py"), ("forward", "palm.py"), ("losses", "compiled.py")], traced
    assert "Recompiling" not in result.stderr
    announced = [line for line in result.stderr.splitlines() if line.startswith("compiled regions: compiling")]
    for region in ("decoder embed", "decoder layer", "pointer generator", "losses"):
        assert any(line.startswith(f"compiled regions: compiling {region} for every width") for line in announced), \
            announced


def test_the_palm_step_tool_compares_a_compiled_step_with_eager(tmp_path):
    """tools/bench_palm_step.py (docs/benchmarks.md's PALM proxy): the compiled stage-2 step launches
    fewer kernels than eager and computes the same loss and gradients; an output it cannot write is
    refused before any work."""
    tool = ["bench_palm_step.py", "--preset", "palm-tiny", "--context-length", "14", "--continuation-length", "7",
            "--micro-batch-size", "2", "--warmup", "0", "--iterations", "1"]
    result = run_tool(*tool, "--json", "-")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout)  # --json -: the figures alone on standard output
    assert figures["decoder_layers"] == 2 and figures["context_length"] == 14
    assert 0 < figures["compiled_kernels"] < figures["eager_kernels"], figures
    assert figures["loss_difference"] <= 1e-5 and figures["gradient_difference"] <= 1e-5, figures
    assert "| compiled |" in result.stderr
    refused = run_tool(*tool, "--json", str(tmp_path / "missing" / "palm.json"), timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --json"), refused.stderr
    assert "compiled regions" not in refused.stderr


def test_palm_compile_is_refused_in_one_line_where_pmlm_s_is(palm_samples, tmp_path):
    result = run_module("megatron_pmlm.pretrain", "--model", "palm", "--preset", "palm-tiny", "--data-path",
                        str(palm_samples), "--compile", "--zero-stage", "3", "--save", str(tmp_path / "out"),
                        timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith("error: --compile with --zero-stage 3: ZeRO-3 gathers") and \
        len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed (pyproject's test extra installs it on x86_64 Linux): Inductor "
                    "generates a GPU's kernels with it")
def test_the_layer_graph_tool_schedules_the_compiled_layer_for_a_gpu(tmp_path):
    """tools/bench_layer_graph.py (docs/benchmarks.md, "The compiled layer's kernels on a GPU"): Inductor's
    CUDA schedule of one compiled layer, without a GPU. The GELU kernel moves the pre-activation in and
    its output out (2 x ffn / hidden activations); the attention stays our custom op; hidden dropout is
    drawn as bits by our kernel, which moves fewer bytes than Inductor's own draws and byte masks
    (PMLM_HIDDEN_DROPOUT=torch) and more than a run without dropout;
    GELU's backward is our kernel, which sums the FFN bias gradient (no Inductor kernel reads it again);
    the attention kernels sum the Q, K, V bias gradient (no Inductor reduction of the packed gradient);
    the residual sums saved rather than recomputed move fewer bytes than the partitioner's choice;
    with --gemm-templates the GEMMs are Inductor's Triton templates, the forward's GELU fused into one, and
    the layer's bytes, GEMMs included, fewer than with cuBLAS's;
    the process's torch.cuda answers as before once the schedule is made."""
    tool = ["bench_layer_graph.py", "--preset", "tiny", "--width", "32", "--micro-batch-size", "4"]
    reports = {}
    for name, flags, env in (("0.1", ["--dropout", "0.1", "--instructions"], None), ("0", ["--dropout", "0"], None),
                             ("recomputed", ["--dropout", "0.1", "--recompute-residual-sums"], None),
                             ("templates", ["--dropout", "0.1", "--gemm-templates"], None),
                             # both former ways in one run: Inductor's dropout draws, autograd's Q, K, V bias sums
                             ("inductor drawn", ["--dropout", "0.1"], {"PMLM_HIDDEN_DROPOUT": "torch",
                                                                       "PMLM_TRITON_QKV_BIAS_GRADIENT": "autograd"})):
        result = run_tool(*tool, *flags, "--json", "-", env=env)
        if result.returncode and "cuobjdump is missing" in result.stderr:
            pytest.skip(result.stderr.strip().splitlines()[-1][:200])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        reports[name] = json.loads(result.stdout)  # --json -: the figures alone on standard output
    report, plain, recomputed, inductor_drawn = (reports[name] for name in ("0.1", "0", "recomputed", "inductor drawn"))
    # --gemm-templates (as TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 where templates win): the layer's 12 GEMMs are
    # cuBLAS calls by default and Inductor's Triton templates there, the forward's bias + GELU fused into the
    # FFN GEMMs (no GELU kernel of its own), fewer bytes in all
    templates = reports["templates"]
    assert sum(graph["gemms"] for graph in report["graphs"].values()) == 12, report["graphs"]
    assert not any(node["kind"] == "gemm" for graph in report["graphs"].values() for node in graph["nodes"])
    assert sum(graph["gemms"] for graph in templates["graphs"].values()) == 12, templates["graphs"]
    assert templates["graphs"]["forward"]["gemm_templates"] == 4, templates["graphs"]["forward"]["nodes"]
    forward_nodes = templates["graphs"]["forward"]["nodes"]
    # (the second FFN GEMM may take GELU into its prologue too, recomputing it from the pre-activation)
    assert {node["kind"] for node in forward_nodes if "erf" in node["ops"]} == {"gemm"}, forward_nodes
    assert templates["memory_bound_activations_per_layer"] < report["memory_bound_activations_per_layer"] - 5, \
        (templates["memory_bound_activations_per_layer"], report["memory_bound_activations_per_layer"])
    with_gemms = [run["memory_bound_activations_per_layer"] + run["gemm_activations_per_layer"] for run in (report, templates)]
    assert with_gemms[1] < with_gemms[0], with_gemms
    # the residual sums saved (models.model.RESIDUAL_SUMS_SAVED): one more activation written forward,
    # the backward's recomputation of the attention block's sum (and its fp32 round trip) gone
    assert report["residual_sums_saved"] and not recomputed["residual_sums_saved"]
    saved_graphs, recomputed_graphs = report["graphs"], recomputed["graphs"]
    assert saved_graphs["forward"]["memory_bound_activations"] <= \
        recomputed_graphs["forward"]["memory_bound_activations"] + 1.1, (saved_graphs, recomputed_graphs)
    assert saved_graphs["backward"]["memory_bound_activations"] <= \
        recomputed_graphs["backward"]["memory_bound_activations"] - 2.5, (saved_graphs, recomputed_graphs)
    config = model_config_from_preset("tiny")
    forward, backward = report["graphs"]["forward"], report["graphs"]["backward"]
    gelu = [node for node in forward["nodes"] if "erf" in node["ops"]]
    assert len(gelu) == 1 and gelu[0]["kind"] == "triton", forward["nodes"]
    assert gelu[0]["bytes"] == 2 * config.ffn_hidden_size // config.hidden_size * report["activation_bytes"], gelu
    for graph, op in ((forward, "megatron_pmlm.bucket_attention_packed.default"),
                      (backward, "megatron_pmlm.bucket_attention_packed_backward.default")):
        assert [node["kind"] for node in graph["nodes"] if op in node["ops"]] == ["extern"], graph["nodes"]
        assert graph["triton_launches"] > 0 and graph["triton_bytes"] > 0, graph
    # hidden dropout drawn as bits by our kernel (models/hidden_dropout.py), twice a layer; none without it;
    # Inductor's own draws (PMLM_HIDDEN_DROPOUT=torch) inside its fused kernels, their byte masks moving more
    bits = [node for node in forward["nodes"] if node["kernel"] == "dropout_keep_bits_kernel"]
    assert [node["kind"] for node in bits] == ["ours", "ours"] and forward["our_kernels"] == 2, forward["nodes"]
    assert bits[0]["bytes"] == report["activation_bytes"] // 16 + 8, bits  # a bit a position, and the int64 seed
    assert not any("inductor_random" in node["ops"] for graph in report["graphs"].values() for node in graph["nodes"])
    assert plain["graphs"]["forward"]["our_kernels"] == 0, plain
    assert plain["memory_bound_activations_per_layer"] < report["memory_bound_activations_per_layer"] - 0.5, plain
    assert sum("inductor_random" in node["ops"] for node in inductor_drawn["graphs"]["forward"]["nodes"]) == 2
    assert inductor_drawn["memory_bound_activations_per_layer"] > report["memory_bound_activations_per_layer"] + 1, \
        (inductor_drawn["memory_bound_activations_per_layer"], report["memory_bound_activations_per_layer"])
    # the Q, K, V bias gradient summed by the attention kernels (bucket_attention.PROJECTION_BIAS_SUMS): no
    # Inductor kernel reads the packed q, k, v gradient (3 activations) again, as autograd's reduction does
    def qkv_bias_reductions(graph):
        return [node for node in graph["nodes"] if node["kind"] == "triton" and set(node["ops"]) == {"reshape", "sum"}
                and node["bytes"] >= 3 * report["activation_bytes"]]
    assert not qkv_bias_reductions(backward), backward["nodes"]
    assert len(qkv_bias_reductions(inductor_drawn["graphs"]["backward"])) == 1, inductor_drawn["graphs"]["backward"]
    # --instructions: each fused kernel compiled for SM 9.0 (no GPU); with the dropout's Philox out of
    # them the LayerNorm forward kernels issue ~27 instructions an element here (87 with Inductor's
    # draws, PMLM_HIDDEN_DROPOUT=torch; at base 25 against 115)
    layer_norms = [node for node in forward["nodes"] if node["kind"] == "triton" and "var_mean" in node["ops"]]
    assert len(layer_norms) == 2, forward["nodes"]
    for node in layer_norms:
        assert node["issue_floor_us"] > 0 and node["bytes_floor_us"] > 0 and node["registers"] > 0, node
        assert node["instructions_per_element"] < 50, node
    counted = {node["kernel"]: node for graph in report["graphs"].values() for node in graph["nodes"]
               if "instructions_per_element" in node}
    assert counted["gelu_backward_kernel"]["instructions_per_element"] > 0, counted.keys()
    # GELU's backward is our kernel (models/ffn_activation.py), which sums the FFN bias gradient too:
    # no Inductor kernel computes or re-reads GELU's input gradient
    ours = [node for node in backward["nodes"] if node["kind"] == "ours"]
    assert [node["kernel"] for node in ours] == ["gelu_backward_kernel"] and backward["our_kernels"] == 1, ours
    assert not [node for node in backward["nodes"] if node["kind"] == "triton" and "erf" in node["ops"]], backward
    # it reads the gradient and the pre-activation, writes GELU's input gradient (3 x ffn / hidden
    # activations) and the fp32 bias gradient
    gelu_bytes = 3 * config.ffn_hidden_size // config.hidden_size * report["activation_bytes"]
    assert ours[0]["bytes"] == gelu_bytes + 4 * config.ffn_hidden_size, ours
    # --trace: each fused kernel's time in a GPU step's Chrome trace, matched by name; here a trace written
    # as torch.profiler exports one, each kernel 7 us a call in both layers, plus what is not ours
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from bench_layer_graph import trace_bandwidth

    fused = [node for graph in report["graphs"].values() for node in graph["nodes"] if node["kind"] in ("triton", "ours")]
    names = {node["kernel"]: node["bytes"] for node in fused}  # a kernel two nodes share is launched for both
    events = [{"ph": "X", "cat": "kernel", "name": node["kernel"], "dur": 7.0} for node in fused for _ in range(2)]
    events += [{"ph": "X", "cat": "kernel", "name": "ampere_bf16_s16816gemm", "dur": 50.0},
               {"ph": "X", "cat": "cpu_op", "name": next(iter(names)), "dur": 900.0}]
    (tmp_path / "step.trace.json").write_text(json.dumps({"traceEvents": events}))
    timed = trace_bandwidth(report, str(tmp_path / "step.trace.json"))
    assert timed["matched"] == len(names) and timed["unmatched"] == 0, timed
    for row in timed["kernels"]:
        assert row["calls"] == 2 * row["nodes"] and row["mean_us"] == 7.0, row
        assert row["tb_per_s"] == pytest.approx(names[row["kernel"]] / 7e-6 / 1e12), row
    assert timed["total_ms"] == pytest.approx(sum(2 * row["nodes"] * 7e-3 for row in timed["kernels"]))
    refused = run_tool(*tool, "--width", "1", timeout=120)
    assert refused.returncode == 2 and "--width 1: give at least 2" in refused.stderr, refused.stderr
    refused = run_tool(*tool, "--trace", str(tmp_path / "none.trace.json"), timeout=120)
    assert refused.returncode == 2 and "none.trace.json: no such file" in refused.stderr, refused.stderr
    refused = run_tool(*tool, "--config", "inductor.no_such_setting=1", timeout=120)
    assert refused.returncode == 2 and "has no setting 'no_such_setting'" in refused.stderr, refused.stderr
    check = ("import sys, torch; sys.path.insert(0, 'tools'); from bench_layer_graph import fake_cuda_device\n"
             "getitem = torch.Tensor.__getitem__\n"
             "with fake_cuda_device():\n    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)\n"
             "assert not torch.cuda.is_available() and torch.Tensor.__getitem__ is getitem\n"
             "assert torch.arange(6).view(2, 3)[1, 1:].tolist() == [4, 5]\n")
    restored = run_python(["-c", check], env={**os.environ, **RUN_ENVIRONMENT}, cwd=REPO_ROOT, timeout=120)
    assert restored.returncode == 0, restored.stderr[-3000:]
