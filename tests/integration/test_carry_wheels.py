"""packaging/carry_wheels.py as the GPU host uses it, on a small wheel made here: split
at 4 KB, then `install` (join + `pip install --no-index --no-deps --target`) from
the chunks alone, and the package imported by a fresh process with the PYTHONPATH the
script printed. A missing chunk: exit 1, the chunk named, nothing installed. (The real
tensorflow-cpu wheel was carried by hand: docs/install.md.)"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from harness.processes import REPO, USER_ENV, run
from harness.wheels import corrupt, make_wheel

SCRIPT = REPO / "packaging" / "carry_wheels.py"


def test_split_then_install_from_the_chunks_alone(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "tinycarry", 10_000, value=23)
    out = tmp_path / "carry"
    split = [sys.executable, str(SCRIPT), "split", str(wheel), "--out", str(out)]
    run([*split, "--chunk-size", "4K"], timeout=60, check=True)
    # On the target: the chunks and the manifest, no wheel, no index.
    target_side = tmp_path / "target" / "carry"
    shutil.copytree(out, target_side)
    wheel.unlink()
    site = tmp_path / "target" / "site"
    install = [sys.executable, str(SCRIPT), "install", str(target_side), "--target", str(site)]
    result = run(install, timeout=120, env={"PIP_INDEX_URL": "http://127.0.0.1:9/"}, check=True)
    export = result.stdout.strip().splitlines()[-1]
    assert export == f'export PYTHONPATH={site.resolve()}"${{PYTHONPATH:+:$PYTHONPATH}}"'
    imported = run(
        [sys.executable, "-c", "import tinycarry; print(tinycarry.VALUE, tinycarry.__file__)"],
        timeout=60,
        env={**USER_ENV, "PYTHONPATH": str(site)},
        cwd=tmp_path,
        check=True,
    )
    assert imported.stdout.split() == ["23", str(site / "tinycarry" / "__init__.py")]


def test_a_missing_chunk_installs_nothing(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "tinycarry", 10_000)
    out = tmp_path / "carry"
    split = [sys.executable, str(SCRIPT), "split", str(wheel), "--out", str(out)]
    run([*split, "--chunk-size", "4K"], timeout=60, check=True)
    name = corrupt(out, "missing")
    site = tmp_path / "site"
    install = [sys.executable, str(SCRIPT), "install", str(out), "--target", str(site)]
    result = run(install, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith(f"[carry] error: {out}: 1 chunk(s) missing or corrupt")
    load = name.split("/")[0]
    assert f"{out / name}: missing (chunk 2 of 3 of {wheel.name}, in {load})" in result.stderr
    assert not site.exists()
