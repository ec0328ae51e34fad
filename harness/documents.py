"""The commands the docs tell a user to run, run as written.

README.md and docs/byo_dataset.md mark what is meant to be run with an HTML comment
on the line right before a fenced block (GitHub does not render the comment):

    <!-- runnable -->      a ```bash block: run as it is; a ```python block: run by
                           `python -` (the venv's interpreter) in the same directory
    <!-- file: PATH -->    a block whose text is the file PATH, written there (relative
                           to the directory the commands before it left the shell in)

Each document's marked blocks become one bash script, in document order, under `set
-euo pipefail`, run in a fresh temporary directory with the directory of a venv's
interpreter (by default this one's, where `make install` put the project and its
commands) first on PATH and no PYTHONPATH, so the commands must work from any
directory, outside the checkout. Installing (`make install`, `pip install`) is never
marked: the commands use the installed project. Blocks that need what a test machine
lacks (the Criteo 1TB data, a Slurm cluster, a GPU, a container engine) stay unmarked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlrm.app.records import last_record
from harness.processes import REPO, USER_ENV, run

RUNNABLE = "<!-- runnable -->"
FILE_MARKER = re.compile(r"<!-- file: (\S+) -->")
FENCE = "```"
SHELL_LANGUAGES = ("bash", "sh", "shell")


@dataclass(frozen=True)
class Block:
    """A marked fenced block: `kind` "run" (with its language) or "file" (with its path)."""

    kind: str
    language: str
    path: str
    text: str
    line: int


def marked_blocks(document: Path) -> list[Block]:
    """The marked blocks of `document`, in order; ValueError for a marker that is not
    right before a fence, an unclosed fence or a runnable block in another language."""
    lines = document.read_text().splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        marker = lines[index].strip()
        file_match = FILE_MARKER.fullmatch(marker)
        if marker != RUNNABLE and not file_match:
            index += 1
            continue
        where = f"{document.name}:{index + 1}"
        if index + 1 >= len(lines) or not lines[index + 1].startswith(FENCE):
            raise ValueError(f"{where}: a marker must be right before a fenced block")
        language = lines[index + 1][len(FENCE) :].strip()
        end = index + 2
        while end < len(lines) and not lines[end].startswith(FENCE):
            end += 1
        if end == len(lines):
            raise ValueError(f"{where}: the fenced block is not closed")
        text = "\n".join(lines[index + 2 : end])
        if file_match:
            blocks.append(Block("file", language, file_match.group(1), text, index + 1))
        elif language in (*SHELL_LANGUAGES, "python"):
            blocks.append(Block("run", language, "", text, index + 1))
        else:
            raise ValueError(f"{where}: runnable blocks are bash or python, got {language!r}")
        index = end + 1
    return blocks


def script_of(blocks: list[Block], document: str, python_stderr: Path | None = None) -> str:
    """One bash script that runs `blocks` in order; with `python_stderr`, the python
    blocks' stderr is appended to that file instead of the script's."""
    redirect = f" 2>>{python_stderr}" if python_stderr is not None else ""
    parts = ["set -euo pipefail"]
    for block in blocks:
        parts.append(f"# --- {document}:{block.line}")
        if block.kind == "file":
            parts.append(
                f'mkdir -p "$(dirname {block.path})"\n'
                f"cat > {block.path} <<'DOCS_FILE_END'\n{block.text}\nDOCS_FILE_END"
            )
        elif block.language == "python":
            parts.append(f"python -{redirect} <<'DOCS_PYTHON_END'\n{block.text}\nDOCS_PYTHON_END")
        else:
            parts.append(block.text)
    return "\n".join(parts) + "\n"


def run_document(
    document: Path,
    workdir: Path,
    timeout: float,
    bin_dir: Path = Path(sys.executable).parent,
    python_stderr: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs the marked blocks of `document` in `workdir` with `bin_dir` (a venv's
    commands) first on PATH, no PYTHONPATH and TensorFlow's logging left at the
    product's default, as a user's shell has them; fails the test if they fail."""
    blocks = marked_blocks(document)
    assert blocks, f"{document}: no marked blocks"
    script = workdir / f"{document.stem}.sh"
    script.write_text(script_of(blocks, document.name, python_stderr))
    env = {**USER_ENV, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = run(["bash", str(script)], timeout, env, cwd=workdir)
    assert result.returncode == 0, (
        f"{document.name}'s commands failed (exit {result.returncode}); script {script}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )
    return result


def run_readme_quick_start(
    workdir: Path, bin_dir: Path, python_stderr: Path
) -> subprocess.CompletedProcess[str]:
    """The README's marked blocks run in `workdir` with the commands of `bin_dir`,
    checked for what they must leave behind (a checkpoint, a SavedModel and an AUC
    above chance) and print (scores that are probabilities). `test_wheel_install.py`
    runs them with the project's wheel installed into a new venv, as a user who ran
    `pip install` would."""
    blocks = marked_blocks(REPO / "README.md")
    commands = "\n".join(block.text for block in blocks)
    for command in ("dlrm-synthetic clicklog", "dlrm-preprocess", "horovodrun", "--mode eval"):
        assert command in commands, f"the README's marked blocks no longer run {command!r}"

    result = run_document(REPO / "README.md", workdir, 1200, bin_dir, python_stderr)

    quick = workdir / "quickstart"
    assert (quick / "data" / "feature_spec.yaml").is_file()
    train_summary = last_record(quick / "run" / "metrics.jsonl", "summary")
    assert train_summary["world_size"] == 2
    assert train_summary["auc"] > 0.6, train_summary
    checkpoint = quick / train_summary["checkpoint"]  # relative to where it ran
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["plan"]["world_size"] == 2
    assert (quick / "run" / "sharding_plan.json").is_file()
    eval_summary = last_record(quick / "eval.jsonl", "summary")
    assert eval_summary["mode"] == "eval"
    # One process scores the checkpoint the 2 ranks wrote as they did (exact AUC: a
    # pair of near-tied scores ordered the other way moves it by about 1e-9).
    assert eval_summary["auc"] == pytest.approx(train_summary["auc"], abs=1e-6)
    assert (quick / "saved_model" / "saved_model.pb").is_file()
    scores = [float(s) for s in re.findall(r"score (\S+)", result.stdout)]
    assert len(scores) == 5, result.stdout
    assert all(0.0 <= score <= 1.0 for score in scores), scores
    assert len(set(scores)) > 1, f"every row got the same score: {scores}"
    return result
