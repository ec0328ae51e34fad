"""`make test`'s driver (tests/run.py): when the container test runs beside the
workers, and what its run is given."""

from __future__ import annotations

from tests.run import BESIDE, beside_args, names_tests


def test_options_alone_split_the_suite_and_named_tests_do_not() -> None:
    assert not names_tests([])
    assert not names_tests(["-p", "no:cacheprovider", "--durations=40", "-k", "planner"])
    assert not names_tests(["-k", "tests", "-m", "slow", "-x"])  # option values, not paths
    assert not names_tests(["--ignore", "tests/unit", "--deselect", f"{BESIDE}::test_x"])
    assert names_tests(["tests/unit"])
    assert names_tests(["-x", "tests/unit/test_config.py::test_bad_flags"])
    assert names_tests([BESIDE])


def test_the_beside_run_writes_a_junit_file_of_its_own() -> None:
    assert beside_args(["--junitxml=/tmp/out/junit.xml", "-x"]) == [
        "--junitxml=/tmp/out/junit.beside.xml",
        "-x",
    ]
    assert beside_args(["--junitxml", "report.xml"]) == ["--junitxml", "report.beside.xml"]
    assert beside_args(["-k", "images"]) == ["-k", "images"]
