"""The step proxies of training/kernel_count.py count what they say, eager and compiled."""

import torch

from megatron_pmlm.training.kernel_count import count_kernels, prepare_compiled_counting


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
