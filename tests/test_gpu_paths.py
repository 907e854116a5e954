"""The GPU paths' CPU-checkable parts: the flex backend is refused on CUDA devices below compute
capability 8.0 (the capability is faked here: no GPU on CI), and the layout width padding that
keeps compiled flex kernels to few shapes changes no output, loss or gradient."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from megatron_pmlm.config import ConfigError, model_config_from_preset
from megatron_pmlm.data import build_pretraining_loaders
from megatron_pmlm.models.flex_attention import (ALLOW_BELOW_MIN_CAPABILITY_ENV, LAYOUT_QUANTUM, LAYOUT_QUANTUM_ENV,
                                                 default_layout_quantum)
from megatron_pmlm.models.layout import IGNORE_INDEX, PAD
from megatron_pmlm.models.model import PMLMForPreTraining, check_attention_backend
from pmlm_testing import REPO_ROOT

FLEX = dict(attention_backend="flex", attention_dropout=0.0)


@pytest.fixture
def cuda_of_capability(monkeypatch):
    """Pretend this machine has a CUDA device of the given compute capability."""
    def fake(capability: tuple[int, int]):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.delenv(ALLOW_BELOW_MIN_CAPABILITY_ENV, raising=False)
    return fake


def test_flex_is_refused_below_compute_capability_8_with_one_line(cuda_of_capability, monkeypatch):
    config = model_config_from_preset("tiny", **FLEX)
    cuda_of_capability((7, 0))  # V100
    with pytest.raises(ConfigError) as refused:
        check_attention_backend(config, "cuda")
    message = str(refused.value)
    assert "\n" not in message
    assert "compute capability >= 8.0" in message and "Triton" in message and "SM 7.0" in message
    assert "--attention-backend sdpa, the V100 path" in message and ALLOW_BELOW_MIN_CAPABILITY_ENV in message
    cuda_of_capability((7, 5))  # T4: Triton supports it only from 8.0 on
    with pytest.raises(ConfigError, match="SM 7.5"):
        check_attention_backend(config, "cuda")
    # sdpa runs anywhere; flex on the CPU (the reference path) too; the CPU-only tools build models
    # without naming a device.
    check_attention_backend(model_config_from_preset("tiny"), "cuda")
    check_attention_backend(config, "cpu")
    PMLMForPreTraining(config)
    # The override, for experiments.
    monkeypatch.setenv(ALLOW_BELOW_MIN_CAPABILITY_ENV, "1")
    check_attention_backend(config, "cuda")
    for capability in ((8, 0), (9, 0)):  # A100, H100
        cuda_of_capability(capability)
        check_attention_backend(config, "cuda")


def test_pretrain_and_bench_train_refuse_flex_on_a_v100_before_training(cuda_of_capability, monkeypatch, capsys,
                                                                          pretraining_samples):
    from megatron_pmlm.pretrain import main as pretrain

    cuda_of_capability((7, 0))
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # what `python -m megatron_pmlm.pretrain` sets on a GPU machine
    assert pretrain(["--preset", "tiny", "--data-path", str(pretraining_samples), "--attention-backend", "flex",
                     "--attention-dropout", "0", "--train-iters", "1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: --attention-backend flex needs a GPU of compute "
                                                   "capability >= 8.0"), error
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import bench_train

    assert bench_train.main(["--preset", "tiny", "--attention-backend", "flex", "--seq-length", "64"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "sdpa, the V100 path" in error[0], error


def test_the_layout_quantum_defaults_to_flex_on_cuda_and_can_be_set(monkeypatch):
    monkeypatch.delenv(LAYOUT_QUANTUM_ENV, raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert default_layout_quantum("flex", cuda) == LAYOUT_QUANTUM == 16
    assert default_layout_quantum("sdpa", cuda) == 1
    assert default_layout_quantum("flex", cpu) == default_layout_quantum("sdpa", cpu) == 1
    monkeypatch.setenv(LAYOUT_QUANTUM_ENV, "1")
    assert default_layout_quantum("flex", cuda) == 1
    monkeypatch.setenv(LAYOUT_QUANTUM_ENV, "128")
    assert default_layout_quantum("sdpa", cpu) == 128
    monkeypatch.setenv(LAYOUT_QUANTUM_ENV, "0")
    with pytest.raises(ConfigError, match=f"{LAYOUT_QUANTUM_ENV} must be a positive integer"):
        default_layout_quantum("flex", cuda)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("objective", ["ae", "ae+par", "ar", "unilm"])
def test_padding_the_layout_to_the_quantum_changes_no_output_loss_or_gradient(pretraining_samples, backend,
                                                                              objective):
    loaders = build_pretraining_loaders(pretraining_samples, 6, objective=objective)
    batch = next(loaders.train)
    width = batch.input_ids.shape[1]
    # The default quantum, and one where the width (64 for `ae` on these seq-64 samples) is no multiple.
    quanta = [quantum for quantum in (LAYOUT_QUANTUM, 48) if width % quantum]
    assert quanta
    config = model_config_from_preset("tiny", vocab_size=loaders.metadata["vocab_size"], hidden_dropout=0.0,
                                      attention_dropout=0.0, attention_backend=backend,
                                      type_vocab_size=6 if objective == "unilm" else None)

    def run(quantum, inputs):
        model = PMLMForPreTraining(config, objective, init_seed=4)
        model.bert.layout_quantum = quantum
        widths = []
        model.bert.encoder.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
        hidden = model.bert(*inputs.as_tuple()[:5])
        losses = model(*inputs.as_tuple())
        losses.loss.backward()
        grads = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
        return widths[0], hidden[:, :width].detach(), losses.metrics(), grads

    seen, reference_hidden, reference_metrics, reference_grads = run(1, batch)
    assert seen == width
    real = batch.roles != PAD
    for quantum in quanta:
        padded = batch.padded_to(quantum)
        assert padded.input_ids.shape[1] == quantum * -(-width // quantum) > width
        assert (padded.roles[:, width:] == PAD).all() and (padded.labels[:, width:] == IGNORE_INDEX).all()
        # The model pads itself (as it does on CUDA with flex), or is given a padded batch.
        for name, model_quantum, inputs in (("model pads", quantum, batch), ("batch padded", 1, padded)):
            seen, hidden, metrics, grads = run(model_quantum, inputs)
            assert seen == padded.input_ids.shape[1], name
            assert hidden.shape == reference_hidden.shape
            torch.testing.assert_close(hidden[real], reference_hidden[real], rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(metrics, reference_metrics, rtol=1e-5, atol=1e-5, msg=name)
            assert grads.keys() == reference_grads.keys()
            for parameter, grad in reference_grads.items():
                torch.testing.assert_close(grads[parameter], grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {parameter}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: `make gpu-check` runs for real")
def test_gpu_check_stops_at_once_without_a_cuda_device(tmp_path):
    started = time.time()
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_check.py"), "--output-dir",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no CUDA device found"), result.stderr
    assert not (tmp_path / "out").exists() and time.time() - started < 60
