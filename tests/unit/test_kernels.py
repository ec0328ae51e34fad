"""The project's CPU kernels (dlrm.kernels) against TensorFlow's ops doing the same."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dlrm import kernels
from dlrm.embedding.base import fused_lookup
from dlrm.model.interaction import dot_interaction
from harness.processes import run

# bfloat16 keeps 8 significant bits: results rounded once (the kernel) or after
# each product (TensorFlow) differ by a few units of the last one.
BFLOAT16_TOLERANCE = 2.0**-6


def _as_float(x: tf.Tensor) -> np.ndarray:
    return tf.cast(x, tf.float32).numpy()


@pytest.mark.parametrize(
    ("batch", "tables", "width", "dtype"),
    [
        (37, 5, 19, tf.float32),  # width below one SIMD block
        (64, 26, 128, tf.float32),  # the default model's shape
        (9, 8, 83, tf.float32),  # 64 + 16 + a remainder
        (33, 4, 1, tf.float32),
        (41, 26, 128, tf.bfloat16),
        (17, 3, 21, tf.bfloat16),
    ],
)
def test_dot_interaction_matches_tensorflow_ops(
    library: Any, batch: int, tables: int, width: int, dtype: tf.DType
) -> None:
    rng = np.random.default_rng(batch)
    dense = tf.constant(rng.normal(size=(batch, width)), dtype)
    embeddings = tf.constant(rng.normal(size=(batch, tables, width)), dtype)
    upstream = tf.constant(rng.normal(size=(batch, width + (tables + 1) * tables // 2)), dtype)

    def run(use_kernel: bool) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch([dense, embeddings])
            out = dot_interaction(dense, embeddings, use_kernel=use_kernel)
        return [out, *tape.gradient(out, [dense, embeddings], output_gradients=upstream)]

    ours = tf.function(lambda: run(True))()
    reference = run(False)
    if dtype == tf.float32:
        tolerance = {"rtol": 1e-5, "atol": 1e-4 * np.sqrt(width * tables)}
    else:
        # Errors scale with the sums' magnitude: sqrt(terms) for unit normals.
        tolerance = {"rtol": BFLOAT16_TOLERANCE, "atol": 0.1 * np.sqrt(width * (tables + 1))}
    names = ("output", "dense gradient", "embeddings gradient")
    for name, a, b in zip(names, ours, reference, strict=True):
        assert a.dtype == dtype, name
        assert a.shape == b.shape, name
        np.testing.assert_allclose(_as_float(a), _as_float(b), err_msg=name, **tolerance)
    # The output starts with `dense` itself, exactly.
    np.testing.assert_array_equal(_as_float(ours[0])[:, :width], _as_float(dense))


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_dot_interaction_carries_nan_and_infinity_through(library: Any, dtype: tf.DType) -> None:
    """The trainer's finite check relies on them reaching the gradients."""
    dense = np.ones((3, 16), np.float32)
    embeddings = np.ones((3, 2, 16), np.float32)
    dense[0, 5] = np.nan
    embeddings[1, 1, 0] = np.inf
    out = library.dlrm_dot_interaction(tf.constant(dense, dtype), tf.constant(embeddings, dtype))
    pairs = _as_float(out)[:, 16:]  # (e1, d), (e2, d), (e2, e1)
    assert np.isnan(pairs[0, :2]).all() and pairs[0, 2] == 16
    assert pairs[1, 0] == 16 and np.isposinf(pairs[1, 1:]).all()
    np.testing.assert_array_equal(pairs[2], 16)


def test_dot_interaction_rejects_mismatched_shapes(library: Any) -> None:
    dense = tf.zeros([4, 8])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"do not match dense \[4,8\]"):
        library.dlrm_dot_interaction(dense, tf.zeros([4, 3, 7]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"expected dense \[B, D\] and"):
        library.dlrm_dot_interaction(dense, tf.zeros([4, 24]))


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16, tf.float16, tf.float64])
def test_all_finite_finds_every_nan_and_infinity(library: Any, dtype: tf.DType) -> None:
    rng = np.random.default_rng(3)
    # Sizes around the kernel's 1,024-value blocks and the threads' shards.
    values = [rng.normal(size=n) for n in (1, 1023, 1025, 200_003)]
    check = library.dlrm_all_finite
    largest = float(tf.as_dtype(dtype).max)
    finite = [tf.constant(v, dtype) for v in values] + [tf.constant([largest, -largest], dtype)]
    assert bool(check(finite))
    for bad in (np.nan, np.inf, -np.inf):
        for position in (0, 1024, 200_002):
            poisoned = values[3].copy()
            poisoned[position] = bad
            tensors = [*finite[:3], tf.constant(poisoned, dtype)]
            assert not bool(check(tensors)), (bad, position)
            assert not bool(tf.function(check)(tensors)), (bad, position)


def test_all_finite_rejects_integer_tensors(library: Any) -> None:
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError)):
        library.dlrm_all_finite([tf.constant([1, 2])])


def _tables(widths: list[int], rows: list[int], seed: int) -> list[tf.Variable]:
    rng = np.random.default_rng(seed)
    return [
        tf.Variable(rng.normal(size=(r, w)).astype(np.float32))
        for r, w in zip(rows, widths, strict=True)
    ]


def _lookup(library: Any, tables: list[tf.Variable], ids: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return library.dlrm_embedding_lookup(
        tables=[t.handle for t in tables], ids=ids, widths=[t.shape[1] for t in tables], T=dtype
    )


@pytest.mark.parametrize(
    ("widths", "index_dtype", "dtype"),
    [
        ([128] * 26, tf.int32, tf.float32),  # the default model's tables
        ([5, 19, 1, 40], tf.int64, tf.float32),  # widths that differ, below a cache line
        ([128] * 26, tf.int64, tf.bfloat16),
        ([3, 33, 16], tf.int32, tf.bfloat16),
    ],
)
def test_embedding_lookup_matches_gathers_side_by_side(
    library: Any, widths: list[int], index_dtype: tf.DType, dtype: tf.DType
) -> None:
    rows = [50 + 7 * t for t in range(len(widths))]
    tables = _tables(widths, rows, 8)
    rng = np.random.default_rng(9)
    ids = tf.constant(
        np.stack([rng.integers(0, r, 300) for r in rows], axis=1), index_dtype
    )  # 300 samples: the threads' ranges end mid-sample's prefetch window
    ours = _lookup(library, tables, ids, dtype)
    reference = tf.concat(
        [tf.cast(tf.gather(t, ids[:, i]), dtype) for i, t in enumerate(tables)], axis=1
    )
    assert ours.dtype == dtype and ours.shape == (300, sum(widths))
    # A copy in float32; in bfloat16 the same rounding as TensorFlow's cast.
    np.testing.assert_array_equal(_as_float(ours), _as_float(reference))


def test_embedding_lookup_gradient_is_each_tables_rows(library: Any) -> None:
    """Through tf.GradientTape (`fused_lookup` tells the tape of the tables, as
    tf.gather does): what tf.gather's gradient gives each table."""
    tables = _tables([4, 6], [9, 11], 10)
    ids = tf.constant([[0, 3], [8, 3], [0, 10]])
    upstream = tf.constant(np.arange(30, dtype=np.float32).reshape(3, 10))
    with tf.GradientTape() as tape:
        out = fused_lookup(tables, ids, tf.float32)
    ours = tape.gradient(out, tables, output_gradients=upstream)
    with tf.GradientTape() as tape:
        reference_out = tf.concat([tf.gather(t, ids[:, i]) for i, t in enumerate(tables)], 1)
    reference = tape.gradient(reference_out, tables, output_gradients=upstream)
    for a, b in zip(ours, reference, strict=True):
        assert isinstance(a, tf.IndexedSlices)
        np.testing.assert_array_equal(tf.convert_to_tensor(a), tf.convert_to_tensor(b))


def test_embedding_lookup_rejects_bad_ids_and_widths(library: Any) -> None:
    tables = _tables([4, 4], [10, 20], 11)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"ids\[1, 0\] = 10 is not a row of table 0 \(expected \[0, 10\)\)",
    ):
        _lookup(library, tables, tf.constant([[9, 19], [10, 0], [-1, 0]]), tf.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"expected ids \[B, 2\]"):
        _lookup(library, tables, tf.constant([[1, 2, 3]]), tf.float32)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"tables\[1\] is float .*expected float32, bfloat16 or float16 \[rows, 5\]",
    ):
        library.dlrm_embedding_lookup(
            tables=[t.handle for t in tables],
            ids=tf.constant([[1, 2]]),
            widths=[4, 5],
            T=tf.float32,
        )


def test_library_name_follows_sources_and_tensorflow(monkeypatch: pytest.MonkeyPatch) -> None:
    path = kernels.library_path()
    assert kernels.fingerprint() in path.name
    monkeypatch.setattr(kernels, "tensorflow_version", lambda: "0.0.0")
    assert kernels.library_path() != path
    assert kernels.load(kernels.library_path()) is None  # never built for that TensorFlow


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    output = tmp_path / "built.so"
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "CXX": "false"}
    result = run([sys.executable, "-m", "dlrm.kernels", "--output", str(output)], 300, env)
    assert result.returncode == 1
    assert "[kernels] not built: false exited with 1" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_library_that_does_not_load_falls_back_with_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "dlrm_kernels-broken.so"
    broken.write_bytes(b"not a shared library")
    assert kernels.load(broken) is None
    reason = kernels.unavailable_reason()
    assert reason is not None and f"{broken} did not load" in reason
    assert "\n" not in reason


def test_the_library_goes_to_a_user_cache_when_the_environment_is_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    environment, cache = tmp_path / "venv" / "lib" / "dlrm-kernels", tmp_path / "cache"
    monkeypatch.setattr(kernels, "library_dirs", lambda: (environment, cache))
    monkeypatch.setattr(kernels, "_writable", lambda directory: directory != environment)
    assert kernels.library_path().parent == cache
    # A library already in the environment is found there, writable or not.
    environment.mkdir(parents=True)
    (environment / f"dlrm_kernels-{kernels.fingerprint()}.so").touch()
    assert kernels.library_path().parent == environment


# Two processes that start together and find no library, as two ranks of a
# fresh installation: `dlrm_kernels` points the library's directories at argv[1].
FIRST_USE = """
import sys
from pathlib import Path
from dlrm import kernels
kernels.library_dirs = lambda: (Path(sys.argv[1]),)
module = kernels.load()
assert module is not None, kernels.unavailable_reason()
import tensorflow as tf
print(bool(module.dlrm_all_finite([tf.constant([1.0, 2.0])])))
"""


# A compiler whose output is the installed library, copied: the build's lock,
# staging and rename run as for g++, without its half a minute of compiling (the
# real first-use compile runs in tests/integration/test_wheel_install.py). It notes
# each call in argv[0]'s directory.
COPYING_COMPILER = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
while [ $# -gt 1 ]; do
    if [ "$1" = -o ]; then output="$2"; fi
    shift
done
exec cp "{library}" "$output"
"""


def test_first_use_builds_the_library_once_for_ranks_that_start_together(
    tmp_path: Path, library: Any
) -> None:
    compiler = tmp_path / "compiler" / "c++"
    compiler.parent.mkdir()
    compiler.write_text(COPYING_COMPILER.format(library=kernels.library_path()))
    compiler.chmod(0o755)
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "CXX": str(compiler)}
    command = [sys.executable, "-c", FIRST_USE, str(tmp_path / "kernels")]
    with ThreadPoolExecutor(2) as pool:  # both ranks at once
        ranks = list(pool.map(lambda _: run(command, 300, env, cwd=tmp_path), range(2)))
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr
        assert rank.stdout.strip() == "True"
    compiled = [line for rank in ranks for line in rank.stderr.splitlines() if "compiling" in line]
    assert len(compiled) == 1, ranks
    (call,) = (tmp_path / "compiler" / "calls").read_text().splitlines()  # the compiler ran once
    assert "-shared" in call.split(), call
    assert f"into {tmp_path / 'kernels'}" in compiled[0]
    # The library alone (and the ranks' lock), no half-written file or objects left.
    library = f"dlrm_kernels-{kernels.fingerprint()}.so"
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [".build.lock", library]
    # `python -m dlrm.kernels --if_missing`, as `make install` runs it, builds nothing more.
    again = run(
        [sys.executable, "-m", "dlrm.kernels", "--output", str(tmp_path / "kernels" / library),
         "--if_missing"],
        timeout=300,
        env=env,
    )  # fmt: skip
    assert again.returncode == 0 and "up to date" in again.stdout, again.stderr


def test_a_failed_first_build_is_noted_once_and_not_repeated(tmp_path: Path) -> None:
    script = FIRST_USE.replace(
        "assert module is not None, kernels.unavailable_reason()",
        "print(kernels.unavailable_reason()); sys.exit(0)",
    )
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "CXX": "no-such-compiler"}
    command = [sys.executable, "-c", script, str(tmp_path / "kernels")]
    runs = [run(command, 300, env, cwd=tmp_path) for _ in range(2)]
    for result in runs:
        assert result.returncode == 0, result.stderr
        assert "their build failed: no C++ compiler: 'no-such-compiler'" in result.stdout
    assert "compiling" in runs[0].stderr
    assert "compiling" not in runs[1].stderr  # the note of the first failure is read instead
