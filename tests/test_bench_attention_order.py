"""tools/bench_attention_order.py (docs/benchmarks.md, "The attention kernels' programs numbered a
head's blocks first"): the L2 model of the attention kernels' HBM reads under either program order,
on a real layout's tile lists."""

from __future__ import annotations

import json

from pmlm_testing import run_tool


def _figures(*args: str) -> dict:
    result = run_tool("bench_attention_order.py", "--shapes", "128x16", "--json", "-", *args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (shape,) = json.loads(result.stdout)["shapes"]
    assert "from HBM: heads first" in result.stderr
    return shape["kernels"]


def test_a_head_s_blocks_numbered_together_read_its_tiles_from_hbm_once():
    """An L2 that holds a few heads' tiles: heads first, a head's keys and values (its queries and
    output gradients) come from HBM again for each of its blocks; blocks first, once. Both orders
    read the same tiles; with an L2 that holds everything both read each tile from HBM once."""
    small = _figures("--l2-mb", "0.5", "--sms", "2")
    for kernel, figures in small.items():
        heads_first, blocks_first = figures["heads first"], figures["blocks first"]
        assert heads_first["read_gb"] == blocks_first["read_gb"] > 0, (kernel, figures)
        assert blocks_first["hbm_gb"] < 0.7 * heads_first["hbm_gb"] <= heads_first["read_gb"], (kernel, figures)
    large = _figures("--l2-mb", "1000")
    for kernel, figures in large.items():
        assert figures["heads first"]["hbm_gb"] == figures["blocks first"]["hbm_gb"], (kernel, figures)
        assert figures["blocks first"]["hbm_gb"] <= small[kernel]["blocks first"]["hbm_gb"], (kernel, figures)


def test_a_bad_shape_or_size_is_refused():
    for args, message in ((["--shapes", "512"], "shape '512': give SEQxBATCH"),
                          (["--l2-mb", "0"], "--l2-mb 0.0: give a positive size")):
        result = run_tool("bench_attention_order.py", *args, timeout=120)
        assert result.returncode == 2 and message in result.stderr, result.stderr
