"""Small wheels made here and damaged on purpose, for the tests of the wheel carrier
(packaging/carry_wheels.py, loaded as a module: it is a script, not a package)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import zipfile
from pathlib import Path

from harness.processes import REPO

SCRIPT = REPO / "packaging" / "carry_wheels.py"
_spec = importlib.util.spec_from_file_location("carry_wheels", SCRIPT)
assert _spec is not None and _spec.loader is not None
carry_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(carry_wheels)


def make_wheel(folder: Path, name: str, payload_bytes: int, value: int = 7) -> Path:
    """A pure-Python wheel of package `name` whose `VALUE` is `value`, with
    `payload_bytes` of incompressible data beside it, so that it spans chunks."""
    version = "1.0"
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {value}\n".encode(),
        f"{name}/payload.bin": os.urandom(payload_bytes),
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [f"{path},sha256={_urlsafe_digest(data)},{len(data)}" for path, data in files.items()]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def _urlsafe_digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def corrupt(out: Path, how: str) -> str:
    """Damages the second chunk of the first wheel; returns its path in `out`."""
    manifest = json.loads((out / "manifest.json").read_text())
    chunk = manifest["wheels"][0]["chunks"][1]
    name = f"{chunk['load']}/{chunk['name']}"
    path = out / name
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-10])
    else:
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))
    return name
