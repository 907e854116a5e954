"""Nothing of ours waits for the device between two log lines (issue 33, item 4), counted on the CPU.

A real Trainer (tiny preset, fp32, DeepSpeed ZeRO-0 and ZeRO-1, one process) trains two log intervals
under tools/count_host_syncs.py; training/host_syncs.py's HostSyncCounter counts `.item()`, `nonzero`,
boolean indexing, `.cpu()`, `.tolist()`, `.numpy()` over the micro batches between the two log lines.
Also here: the DevicePrefetcher that feeds the loop (order, tokens, errors, its thread's end) and
the fp32 AdamW's gradient norm and clipping kept on the device with the same numbers as before.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from pmlm_testing import run_module

def ours(events: list[list]) -> list[list]:
    return [event for event in events if event[0] == "ours"]


def test_nothing_of_ours_waits_for_the_device_between_two_log_lines(pretraining_samples, tmp_path):
    output = tmp_path / "syncs.json"
    result = run_module("tools.count_host_syncs", "--data-path", str(pretraining_samples), "--zero-stage", "0", "1",
                        "--log-interval", "2", "--json", str(output), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(output.read_text())["runs"]
    assert [run["zero_stage"] for run in runs] == [0, 1]
    for run in runs:
        # 2 iterations x 2 accumulation steps (micro batch 4, global batch 8).
        assert run["micro_batches"] == 4
        assert ours(run["events"]) == [], f"ZeRO-{run['zero_stage']}:\n{run['report']}"
        # What is left is DeepSpeed's own (docs/gpu.md lists it); the backward of a boolean index of
        # ours (it runs inside DeepSpeed's loss.backward()) would be attributed to it: none.
        assert not any(event[1] == "boolean index" for event in run["events"]), run["report"]
        # Nothing waits for the whole device: DeepSpeed's throughput timer is off (build_deepspeed_config).
        assert not any(event[1] == "device synchronize" for event in run["events"]), run["report"]


def test_deepspeed_s_throughput_timer_would_wait_for_the_device_twice_a_micro_batch(pretraining_samples, tmp_path):
    """What pretrain turns off by default, turned back on by a user's file: the counter sees DeepSpeed's
    `get_accelerator().synchronize()` at each micro batch's forward and step (a no-op on the CPU, a
    full device wait on a GPU)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"timers": {"throughput": {"enabled": True}}}))
    output = tmp_path / "syncs.json"
    result = run_module("tools.count_host_syncs", "--data-path", str(pretraining_samples), "--zero-stage", "1",
                        "--deepspeed-config", str(config), "--json", str(output), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = json.loads(output.read_text())["runs"]
    waits = [event for event in run["events"] if event[1] == "device synchronize"]
    assert {event[0] for event in waits} == {"deepspeed"} and all("deepspeed/utils/timer.py:" in event[2]
                                                                  for event in waits), run["report"]
    assert sum(event[3] for event in waits) == 2 * run["micro_batches"], run["report"]


def test_cuda_sync_warnings_are_recorded_with_their_owner_and_thread_and_others_still_shown(recwarn):
    """The recorder behind tools/count_host_syncs.py's CUDA check (tests/test_gpu.py runs it on a GPU,
    where torch.cuda.set_sync_debug_mode raises the warnings): a synchronising warning is recorded
    (owner, place, thread), not shown; any other warning still reaches the caller's handler."""
    import warnings

    from megatron_pmlm.training.host_syncs import CudaSyncWarnings

    def loader_thread():
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    with CudaSyncWarnings() as cuda_syncs:
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
        warnings.warn("something else entirely", UserWarning)
        thread = threading.Thread(target=loader_thread, name="batch-prefetch")
        thread.start()
        thread.join()
    assert cuda_syncs.active == torch.cuda.is_available()
    assert cuda_syncs.count() == 2 and cuda_syncs.count(main_thread_only=True) == 1
    assert cuda_syncs.count("other", main_thread_only=True) == 1 and cuda_syncs.count("ours") == 0
    ((owner, place, thread_name), _), ((_, _, other_thread), _) = sorted(
        cuda_syncs.events.items(), key=lambda item: item[0][2] != cuda_syncs.main_thread)
    assert owner == "other" and place.endswith("test_sync_free_step.py:" + place.rsplit(":", 1)[1])
    assert thread_name == cuda_syncs.main_thread and other_thread == "batch-prefetch"
    assert [str(w.message) for w in recwarn] == ["something else entirely"]
    assert "batch-prefetch" in cuda_syncs.report()


# ---------------------------------------------------------------------------------------------- prefetcher

def _batches(count: int | None, fail_at: int | None = None):
    """PMLMBatch-shaped batches whose first input id is their number (count None: endless)."""
    from megatron_pmlm.models.layout import PAD, PMLMBatch

    number = 0
    while count is None or number < count:
        if number == fail_at:
            raise ValueError(f"batch {number} is broken")
        roles = torch.zeros(2, 5, dtype=torch.long)
        roles[:, number % 5:] = PAD  # tokens: 2 x (number % 5), 0 for the first
        ids = torch.full((2, 5), number)
        yield PMLMBatch(ids, ids.clone(), ids.clone(), roles, ids.clone(), ids.clone())
        number += 1


def _prefetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "batch-prefetch"]


def test_the_prefetcher_hands_out_the_source_s_batches_in_order_with_their_tokens():
    from megatron_pmlm.data.loader import DevicePrefetcher

    with DevicePrefetcher(_batches(7), "cpu") as prefetched:
        numbers, tokens = [], []
        for batch in prefetched:
            numbers.append(int(batch.input_ids[0, 0]))
            tokens.append(prefetched.tokens)
        with pytest.raises(StopIteration):
            next(prefetched)
    assert numbers == list(range(7))
    assert tokens == [sum(2 * (n % 5) for n in range(k + 1)) for k in range(7)]
    assert not _prefetch_threads()


def test_the_prefetcher_raises_the_source_s_error_and_its_thread_ends():
    from megatron_pmlm.data.loader import DevicePrefetcher

    with DevicePrefetcher(_batches(None, fail_at=3), "cpu") as prefetched:
        assert [int(next(prefetched).input_ids[0, 0]) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="batch 3 is broken"):
            next(prefetched)
    assert not _prefetch_threads()


def test_closing_stops_a_thread_blocked_on_a_full_queue():
    from megatron_pmlm.data.loader import DevicePrefetcher

    prefetched = DevicePrefetcher(_batches(None), "cpu")
    assert int(next(prefetched).input_ids[0, 0]) == 0
    prefetched.close()  # the thread holds batch 2 (the queue holds batch 1) and is waiting to put it
    assert not _prefetch_threads()
    with pytest.raises(StopIteration):
        next(prefetched)


# ---------------------------------------------------------------------------------------------- fp32 AdamW

@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05, 1e6])
def test_fp32_adamw_norm_and_clipping_stay_on_the_device_with_the_same_numbers(world_of_one, max_grad_norm):
    """The rule as it was (a float32 sum of squares read per parameter, min(1, max / (norm + 1e-6))
    in Python, gradients scaled by it) against training_config.AdamW, which reads nothing."""
    from megatron_pmlm.training.host_syncs import HostSyncCounter
    from megatron_pmlm.training.training_config import AdamW

    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 3, 2)]
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, reference):
        a.grad = torch.randn(a.shape) * 3
        b.grad = a.grad.clone()
    optimizer = AdamW(ours, lr=0.1, fused=True)  # fused: the optimizer CUDA runs, no host reads of its own
    optimizer.norm_group, optimizer.max_grad_norm = world_of_one, max_grad_norm
    with HostSyncCounter() as syncs:
        optimizer.step()
    assert syncs.count("ours") == 0, syncs.report()

    squares = torch.zeros((), dtype=torch.float32)
    for p in reference:
        squares = squares + p.grad.float().pow(2).sum()
    norm = float(squares.sqrt())
    if max_grad_norm > 0:
        coefficient = min(1.0, max_grad_norm / (norm + 1e-6))
        if coefficient < 1.0:
            for p in reference:
                p.grad.mul_(coefficient)
    torch.optim.AdamW(reference, lr=0.1, fused=True).step()
    assert optimizer.last_grad_norm == norm
    for a, b in zip(ours, reference):
        assert torch.equal(a.grad, b.grad) and torch.equal(a, b)


def test_the_tool_names_a_bad_data_path_in_one_line(tmp_path):
    result = run_module("tools.count_host_syncs", "--data-path", str(tmp_path / "nothing"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --data-path {tmp_path / 'nothing'}: not a build_samples output directory (no metadata.json)"]


def test_count_host_syncs_names_a_missing_deepspeed_config(pretraining_samples, tmp_path):
    missing = tmp_path / "nope.json"
    result = run_module("tools.count_host_syncs", "--data-path", str(pretraining_samples), "--deepspeed-config",
                        str(missing), timeout=300)
    assert result.returncode == 2 and f"DeepSpeed config {missing} does not exist" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
