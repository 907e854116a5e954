"""The host-sync counter (training/host_syncs.py) sees what would stall a GPU, on the CPU."""

import torch

from megatron_pmlm.training.host_syncs import HostSyncCounter


def test_counts_each_kind_of_sync_once_and_attributes_it():
    x = torch.randn(8)
    mask = x > 0
    with HostSyncCounter() as syncs:
        x.sum().item()            # .item() (its _local_scalar_dense is not counted again)
        x[mask]                   # boolean index
        torch.nonzero(x)          # nonzero
        x.cpu()                   # no dispatch on a CPU tensor: counted through the method
        x.tolist()
        x.numpy()
        float(x.sum())            # _local_scalar_dense without a method
    kinds = sorted(what for (_, what, _) in syncs.events)
    assert kinds == sorted([".item()", "boolean index", "nonzero", ".cpu()", ".tolist()", ".numpy()", "item"])
    assert syncs.count() == 7
    # This file is not in megatron_pmlm, deepspeed or megatron: "other", named with its line.
    assert syncs.count("other") == 7 and syncs.count("ours") == 0
    assert "test_host_syncs.py:" in syncs.report()


def test_sync_free_code_counts_zero_and_methods_are_restored():
    x, index = torch.randn(8, 4), torch.tensor([1, 3])
    original = torch.Tensor.item
    with HostSyncCounter() as syncs:
        y = x.index_select(0, index) * 2
        y[torch.tensor([0])] = 1.0  # integer index: no sync
        torch.where(x > 0, x, 0).sum()
    assert syncs.count() == 0, syncs.report()
    assert torch.Tensor.item is original


def test_our_code_is_attributed_to_us():
    from megatron_pmlm.models.metrics import MetricSums

    sums = MetricSums()
    with HostSyncCounter() as syncs:
        sums.averages()  # reads the sums on the host: a sync in our code
    assert syncs.count("ours") >= 1
    assert "megatron_pmlm/models/metrics.py:" in syncs.report("ours")


def test_only_the_thread_that_entered_is_counted():
    """A loader thread reading its CPU batch (`int(t.sum())`, `.tolist()`) stalls no launch queue:
    the dispatch mode is per thread, and the patched methods follow it."""
    import threading

    x = torch.randn(8)
    with HostSyncCounter() as syncs:
        worker = threading.Thread(target=lambda: (x.sum().item(), x.tolist(), float(x.sum()), x[x > 0]))
        worker.start()
        worker.join()
        x.tolist()  # this thread's read still counts
    assert syncs.count() == 1, syncs.report()


def test_explicit_device_synchronizations_are_counted_once_and_the_functions_restored():
    """torch.cuda.synchronize() and DeepSpeed's accelerator synchronize (DeepSpeed's throughput timer
    calls it around every micro batch) are waits for the whole device: counted, on the CPU too."""
    from megatron_pmlm.parallel.deepspeed_import import import_deepspeed

    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    cuda_synchronize, accelerator_synchronize = torch.cuda.synchronize, accelerator.synchronize
    had_own = "synchronize" in vars(accelerator)
    with HostSyncCounter() as syncs:
        accelerator.synchronize()  # on a GPU this calls torch.cuda.synchronize(): still one
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    assert syncs.count() == (2 if torch.cuda.is_available() else 1), syncs.report()
    assert {what for (_, what, _) in syncs.events} == {"device synchronize"}
    assert torch.cuda.synchronize is cuda_synchronize and accelerator.synchronize == accelerator_synchronize
    assert ("synchronize" in vars(accelerator)) == had_own
