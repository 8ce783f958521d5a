"""The deterministic mode's row plans (executor/kernels.py RowPlan, row_plan): how a matmul's rows
run so that each row gets the same bits whatever its batch, chosen by a probe whose inputs make a
change of summation order show even in a bf16 output."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from executor.kernels import (
    ROW_PLANS,
    DeterminismError,
    MatmulWeights,
    Matrix,
    RowPlan,
    first_agreeing_plan,
    order_sensitive,
    row_plan,
    rows_agree,
)

DEPTH = 64


def summed(x: torch.Tensor, weight: torch.Tensor, columns: range) -> torch.Tensor:
    """x W^T, each output's products added one column after another in float32 in the order of
    `columns`, rounded to bf16 (torch's CPU cumsum would add in float64)."""
    products = x.float()[:, None, :] * weight.float()[None, :, :]
    total = torch.zeros(products.shape[:2])
    for column in columns:
        total += products[..., column]
    return total.to(torch.bfloat16)


def forward_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return summed(x, weight, range(x.shape[1]))


def reversed_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return summed(x, weight, range(x.shape[1] - 1, -1, -1))


def probe_inputs(out_features: int = 48):
    x, weight = order_sensitive(96, out_features, DEPTH, torch.Generator().manual_seed(1))
    return x.to(torch.bfloat16), weight.to(torch.bfloat16)


def test_order_sensitive_inputs_show_a_change_of_order_that_random_ones_hide_in_bf16():
    x, weight = probe_inputs()
    assert not torch.equal(forward_sum(x, weight), reversed_sum(x, weight))
    g = torch.Generator().manual_seed(1)
    plain_x, plain_w = (torch.randn(shape, generator=g).to(torch.bfloat16) for shape in ((96, DEPTH), (48, DEPTH)))
    assert torch.equal(forward_sum(plain_x, plain_w), reversed_sum(plain_x, plain_w))


def test_a_kernel_whose_lone_rows_add_in_another_order_is_padded_to_two():
    x, weight = probe_inputs()

    def kernel(rows: torch.Tensor) -> torch.Tensor:
        return (reversed_sum if rows.shape[0] == 1 else forward_sum)(rows, weight)

    assert not rows_agree(kernel, x, range(1, 5))
    assert first_agreeing_plan(kernel, x) == RowPlan(multiple=2)


def test_a_kernel_whose_order_changes_below_a_full_tile_takes_fixed_blocks():
    x, weight = probe_inputs()

    def kernel(rows: torch.Tensor) -> torch.Tensor:  # whole 32-row tiles alike, another order for the first row of any other call
        out = forward_sum(rows, weight)
        if rows.shape[0] != 32:
            out[0] = reversed_sum(rows[:1], weight)[0]
        return out

    assert first_agreeing_plan(kernel, x) == RowPlan(block=32)


def test_a_kernel_whose_rows_depend_on_their_place_in_every_call_has_no_plan():
    x, weight = probe_inputs()

    def kernel(rows: torch.Tensor) -> torch.Tensor:  # the first row of every call adds in reverse
        out = forward_sum(rows, weight)
        out[0] = reversed_sum(rows[:1], weight)[0]
        return out

    assert first_agreeing_plan(kernel, x) is None


@pytest.mark.parametrize("plan", ROW_PLANS)
def test_a_plan_returns_each_row_once_in_order_and_calls_the_kernel_at_its_counts(plan):
    calls: list[int] = []

    def kernel(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows * 2

    for count in (0, 1, 3, 16, 17, 70):
        calls.clear()
        x = torch.arange(count * 3, dtype=torch.float32).reshape(count, 3)
        assert torch.equal(plan.run(kernel, x), x * 2)
        step = plan.block or plan.multiple
        padded = max(-(-count // step), 1) * step  # no rows: one padded call
        assert calls == ([plan.block] * (padded // plan.block) if plan.block else [padded])


def test_this_cpus_dense_and_int4_kernels_have_a_plan_and_it_holds():
    """On this machine: the plan the probe picks makes a [rows, 96] x [64, 96]^T product's rows agree
    on other values than the probe's own."""
    for kind, dtype in (("dense", torch.float32), ("dense", torch.bfloat16), ("int4", torch.bfloat16)):
        try:
            plan = row_plan(kind, (64, 96), dtype)
        except DeterminismError:
            pytest.fail(f"no row plan for the {kind} {dtype} kernel on this CPU")
        matrix = Matrix(torch.randn(64, 96).to(dtype), dtype=dtype, deterministic=True) if kind == "dense" else None
        if matrix is not None:
            x, _ = order_sensitive(96, 64, 96, torch.Generator().manual_seed(7))
            assert matrix.weights_for(1).rows == plan
            assert rows_agree(matrix, x.to(dtype), range(1, 40))


def test_only_the_deterministic_mode_plans_rows():
    weight = torch.randn(64, 96)
    assert Matrix(weight).weights_for(1).rows is None
    assert Matrix(weight, deterministic=True).weights_for(1).rows == row_plan("dense", (64, 96), torch.float32)


def test_a_gpu_matrix_plans_no_rows_and_probes_nothing():
    # The plans are the CPU's kernels'; a GPU's weights (meta stands in: a probe there would fail,
    # as one on a GPU would measure the wrong kernel) keep the plain call in the deterministic mode.
    weight = torch.empty(64, 96, device="meta")
    assert Matrix(weight, deterministic=True).weights_for(1).rows is None


def test_the_plan_stays_out_of_an_exported_tree():
    weights = MatmulWeights(weight=torch.ones(2, 2), rows=RowPlan(block=16))
    leaves, spec = tree_flatten(weights)
    assert len([leaf for leaf in leaves if leaf is not None]) == 1
    assert tree_unflatten(leaves, spec).rows is None


def test_the_probe_is_measured_once_per_kernel_and_shape():
    row_plan.cache_clear()
    row_plan("dense", (64, 96), torch.float32)
    row_plan("dense", (64, 96), torch.float32)
    assert row_plan.cache_info().misses == 1 and row_plan.cache_info().hits == 1
