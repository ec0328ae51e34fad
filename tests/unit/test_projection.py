"""`benchmarks/projection.py`'s rows are the dry run's figures: one case each of a
GPU host and a CPU cluster, through the same flags `dlrm-plan` takes."""

from __future__ import annotations

import pytest

from benchmarks import projection


@pytest.mark.parametrize(
    ("case", "ranks"),
    [
        (projection.Case(projection.DCNV2, projection.H100, 1, 8, ("--amp",)), 8),
        (projection.Case(projection.DLRM, projection.CPU, 4, 1), 4),
    ],
)
def test_a_row_holds_its_dry_run_figures(case: projection.Case, ranks: int) -> None:
    result = projection.plan(case.argv())
    found = projection.row(case, result)

    assert result.world.size == ranks
    assert found["fits"] is True and found["fewest_ranks_that_fit"] is None
    assert found["samples_per_second"] == pytest.approx(65_536 / (found["step_ms"] / 1e3))
    assert sum(found["shares"].values()) == pytest.approx(1.0)
    step = found["dry_run"]["slowest_rank_step"]
    assert step["total_s"] * 1e3 == pytest.approx(found["step_ms"])
    assert found["shares"]["vec+grad"] > 0  # tables are sharded: vectors cross ranks


def test_a_world_that_does_not_fit_names_the_fewest_gpus_that_do() -> None:
    case = projection.Case(projection.DCNV2, projection.H100, 1, 1, ("--amp",))
    found = projection.row(case, projection.plan(case.argv()))

    assert found["fits"] is False
    assert found["fewest_ranks_that_fit"] is not None and found["fewest_ranks_that_fit"] > 1
    assert found["peak_gib"] > 80
