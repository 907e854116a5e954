"""The step proxies of training/kernel_count.py count what they say, eager and compiled."""

import threading
import time

import torch

from megatron_pmlm.training.kernel_count import count_kernels, host_ms_outside_ops, prepare_compiled_counting


def test_eager_count_skips_views_aliases_and_bare_allocations():
    x = torch.randn(4, 6)

    def step():
        y = x * 2                    # mul: a kernel
        y = y.t().contiguous()       # t: a view; contiguous: a clone kernel
        torch.empty(3)               # an allocation, no kernel
        y.view(-1).detach()          # views and aliases
        return y.sum()               # sum: a kernel

    assert count_kernels(step, compiled=False) == 3


def test_compiled_count_sees_generated_kernels_and_extern_calls():
    prepare_compiled_counting()
    weight = torch.randn(16, 16)
    compiled = torch.compile(lambda x: torch.relu(x @ weight) * 2)
    x = torch.randn(8, 16)
    compiled(x)  # compiles
    # The matmul (an extern call), relu and mul fused into one generated kernel, and the eager sum.
    assert count_kernels(lambda: compiled(x).sum(), compiled=True) == 3
    # The same step counted eagerly (a dispatch mode runs the graph op by op): mm, relu, mul, sum.
    assert count_kernels(lambda: compiled(x).sum(), compiled=False) == 4


def test_host_time_outside_ops_is_the_python_between_them_not_a_background_thread_s_ops():
    """A step that sleeps 30 ms besides its matrix products (forward and backward): ~30 ms outside
    ops, whether or not another thread runs ATen ops meanwhile (a loader's thread is not the step)."""
    weight = torch.randn(1000, 1000, requires_grad=True)

    def step():
        time.sleep(0.03)
        (weight @ weight @ weight).sum().backward()  # six products of 2 GFLOP: tens of ms on a CPU

    started = time.perf_counter()
    step()
    ops_ms = (time.perf_counter() - started) * 1e3 - 30
    assert 30 <= host_ms_outside_ops(step) < 30 + ops_ms / 2  # the products' time is left out
    stop = threading.Event()

    def background():
        other = torch.randn(300, 300)
        while not stop.is_set():
            other @ other

    thread = threading.Thread(target=background)
    thread.start()
    try:
        assert host_ms_outside_ops(step) >= 30
    finally:
        stop.set()
        thread.join()
