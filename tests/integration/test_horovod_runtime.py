"""Horovod as built by `make install`, under real horovodrun processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from dataloading.synthetic import generate_split_binary
from dlrm.distributed.devices import cpu_slice
from feature_spec import FeatureSpec
from harness.processes import horovodrun, on_ranks, run

GLOBAL_BATCH = 48


def test_check_build_lists_tensorflow_and_gloo() -> None:
    result = run([horovodrun(), "--check-build"], timeout=120, check=True)
    assert "[X] TensorFlow" in result.stdout
    assert "[X] Gloo" in result.stdout


def test_the_launcher_checks_the_build_without_importing_tensorflow() -> None:
    """At every launch horovodrun asks whether Horovod has Gloo (or MPI). Patched
    (packaging/patch_horovod.py, patch 6), the TensorFlow extension's library answers,
    loaded without TensorFlow's Python package; Horovod's own check gives the same."""
    program = (
        "import sys\n"
        "from horovod.common import util\n"
        "library = util._library_of('tensorflow', 'built with Gloo')\n"
        "print(library.gloo_built(), 'tensorflow' in sys.modules)\n"
        "print(util.gloo_built(), util.mpi_built() == library.mpi_built())\n"
    )
    result = run([sys.executable, "-c", program], timeout=120, check=True)
    assert result.stdout.split() == ["True", "False", "True", "True"], result.stdout


def test_two_gloo_ranks_read_their_shards(tmp_path: Path) -> None:
    dataset = tmp_path / "data"
    generate_split_binary(dataset, (23, 7, 300, 11, 5), 3, rows={"train": 500}, seed=4)
    out = tmp_path / "out"
    out.mkdir()
    script = "harness/scripts/read_shards.py"
    run(
        on_ranks(2, [sys.executable, script, str(dataset), str(out), str(GLOBAL_BATCH)]),
        timeout=300,
        check=True,
    )
    spec = FeatureSpec.load(dataset)
    files = spec.files("train")
    batches = 500 // GLOBAL_BATCH
    labels = np.fromfile(files.label, dtype=np.bool_)[: batches * GLOBAL_BATCH]
    ranks = [np.load(out / f"rank{r}.npz") for r in (0, 1)]
    assert [int(r["batches_seen_by_all"]) for r in ranks] == [2 * batches] * 2
    # Local label rows of rank 0 then rank 1, batch by batch, rebuild the file.
    local = GLOBAL_BATCH // 2
    rebuilt = np.stack([r["labels"].reshape(batches, local) for r in ranks], axis=1).reshape(-1)
    np.testing.assert_array_equal(rebuilt, labels)
    # Model-parallel ids: each rank has its tables for every row.
    for rank, r in enumerate(ranks):
        assert r["tables"].tolist() == [t for t in range(5) if t % 2 == rank]
        for column, table in enumerate(r["tables"]):
            ids = np.fromfile(
                files.categorical[f"cat_{table}"], dtype=spec.categorical_features[table].dtype
            )
            np.testing.assert_array_equal(r["ids"][:, column], ids[: batches * GLOBAL_BATCH])


def test_ranks_on_one_host_share_its_cpus(tmp_path: Path) -> None:
    """Each of 2 ranks on this host runs on CPUs of its own, every thread of it
    (Horovod's, started before the binding, included), with TensorFlow's pools
    sized to them; with --nobind_cpus they share every CPU, each with its share
    as intra-op threads. Horovod gets its CPU cycle time. The user's
    TF_NUM_INTRAOP_THREADS and HOROVOD_CYCLE_TIME win."""
    script = "harness/scripts/thread_share.py"
    command = on_ranks(2, [sys.executable, script])
    bound, shared, chosen = tmp_path / "bound", tmp_path / "shared", tmp_path / "chosen"
    chosen_env = {"TF_NUM_INTRAOP_THREADS": "3", "HOROVOD_CYCLE_TIME": "7"}
    for out, env, flags in (
        (bound, {}, []),
        (shared, {}, ["--nobind_cpus"]),
        (chosen, chosen_env, []),
    ):
        out.mkdir()
        run([*command, str(out), *flags], timeout=300, env=env, check=True)
    host = sorted(os.sched_getaffinity(0))
    # A launcher or container that restricted the CPUs leaves the binding to it.
    binds = len(host) == os.cpu_count()
    slices = []
    for rank in (0, 1):
        facts = json.loads((bound / f"rank{rank}.json").read_text())
        assert facts["local_ranks"] == 2
        if binds:
            assert facts["bound"] == list(cpu_slice(host, 2, rank))
            assert facts["threads"] == [facts["bound"]]  # every thread of the rank
            assert facts["set"] == facts["configured"] == facts["cpus"] == len(facts["bound"])
            slices.append(set(facts["bound"]))
        else:
            assert facts["bound"] is None
        assert facts["cycle_time"] == "3"  # no GPU here: dlrm.distributed.collectives.CPU_DEFAULTS
        facts = json.loads((shared / f"rank{rank}.json").read_text())
        assert facts["bound"] is None and facts["cpus"] == len(host)
        assert facts["set"] == facts["configured"] == max(1, len(host) // 2)
        facts = json.loads((chosen / f"rank{rank}.json").read_text())
        # Left to TensorFlow (0: its default), which reads the variable.
        assert facts["set"] is None and facts["configured"] == 0
        assert facts["cycle_time"] == "7"
    if binds and len(host) >= 2:
        assert not slices[0] & slices[1]  # no CPU shared
