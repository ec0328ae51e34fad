"""The commands the docs tell a user to run, run as written; and the docs' links.

README.md and docs/byo_dataset.md mark what is meant to be run with an HTML comment
on the line right before a fenced block (GitHub does not render the comment):

    <!-- runnable -->      a ```bash block: run as it is; a ```python block: run by
                           `python -` (the venv's interpreter) in the same directory
    <!-- file: PATH -->    a block whose text is the file PATH, written there (relative
                           to the directory the commands before it left the shell in)

Each document's marked blocks become one bash script, in document order, under `set
-euo pipefail`, run in a fresh temporary directory with the directory of this test's
interpreter (the venv where `make install` put the project and its commands) first on
PATH and no PYTHONPATH, so the commands must work from any directory, outside the
checkout. Installing (`make install`, `pip install`) is never marked, so this test does
not install again: it uses the installed project. Blocks that need what a test machine
lacks (the Criteo 1TB data, a Slurm cluster, a GPU, a container engine) stay unmarked.

The tests assert on what the commands leave behind: the dataset-of-your-own
walkthrough must write datasets that load with the ids the page says; the README's
quick start (a click log, Spark preprocessing, 2-rank training, evaluation, export,
scoring with the SavedModel) must leave a checkpoint, a SavedModel and an AUC above
chance and print scores that are probabilities. The quick start runs with the
project's wheel installed into a new venv (`test_wheel_install.py`), the way a user
who ran `pip install` meets it, rather than twice.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from feature_spec import FeatureSpec
from tests.harness.processes import REPO

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
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        ["bash", str(script)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, (
        f"{document.name}'s commands failed (exit {result.returncode}); script {script}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )
    return result


def records(log: Path, event: str) -> list[dict]:
    lines = log.read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r["event"] == event]


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
    train_summary = records(quick / "run" / "metrics.jsonl", "summary")[-1]
    assert train_summary["world_size"] == 2
    assert train_summary["auc"] > 0.6, train_summary
    checkpoint = quick / train_summary["checkpoint"]  # relative to where it ran
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["plan"]["world_size"] == 2
    assert (quick / "run" / "sharding_plan.json").is_file()
    eval_summary = records(quick / "eval.jsonl", "summary")[-1]
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


def test_the_byo_walkthrough_runs_and_writes_what_it_says(tmp_path: Path) -> None:
    stdout = run_document(REPO / "docs" / "byo_dataset.md", tmp_path, timeout=1200).stdout

    ads = FeatureSpec.load(tmp_path / "data", required_mappings=("train", "test"))
    assert ads.cardinalities == (3, 4, 3, 24)
    report = json.loads((tmp_path / "data" / "report.json").read_text())
    assert {split: values["rows"] for split, values in report["splits"].items()} == {
        "train": 7,
        "test": 3,
    }
    # The ids the page explains, of the test rows in input order: country, then ad_id.
    test = tmp_path / "data" / "test"
    assert np.fromfile(test / "cat_0.bin", np.int8).tolist() == [2, 0, 1]  # DE, JP, US
    assert np.fromfile(test / "cat_2.bin", np.int8).tolist() == [1, 2, 0]  # ad-17, ad-4, ad-250
    assert "train rows 7" in stdout, stdout  # the page's loader check printed its batch
    summary = records(tmp_path / "runs" / "ads" / "metrics.jsonl", "summary")[-1]
    assert summary["mode"] == "train" and summary["steps"] > 0
    assert list((tmp_path / "runs" / "ads").glob("step_*/manifest.json"))

    lists = FeatureSpec.load(tmp_path / "lists_data", required_mappings=("train", "test"))
    assert lists.cardinalities == (4, 8)
    keywords = np.fromfile(tmp_path / "lists_data" / "train" / "cat_0.bin", np.int8)
    offsets = np.fromfile(tmp_path / "lists_data" / "train" / "cat_0.offsets.bin", np.int64)
    assert keywords.tolist() == [1, 2, 3, 1, 2, 1, 0, 3, 0, 1]
    assert offsets.tolist() == [0, 3, 4, 4, 7, 10]


DOCUMENTS = [REPO / "README.md", REPO / "slurm" / "README.md", *sorted(REPO.glob("docs/*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    """`text` without fenced blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(document: Path) -> set[str]:
    """GitHub's anchors for the headings of `document`."""
    found: set[str] = set()
    for line in _outside_code(document.read_text().replace("`", "")).splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            number, candidate = 0, slug
            while candidate in found:
                number += 1
                candidate = f"{slug}-{number}"
            found.add(candidate)
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_and_headings_that_exist(document: Path) -> None:
    broken = []
    for target in LINK.findall(_outside_code(document.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(f"{target}: no {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{document.relative_to(REPO)}: " + "; ".join(broken)


def test_marked_blocks_become_one_script_in_document_order(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- file: in/a.txt -->\n```\nhello\n```\n\n```bash\necho not marked\n```\n"
        "<!-- runnable -->\n```bash\ncat in/a.txt\n```\n"
        "<!-- runnable -->\n```python\nprint(open('in/a.txt').read().upper())\n```\n"
    )
    blocks = marked_blocks(page)
    assert [(b.kind, b.language, b.path) for b in blocks] == [
        ("file", "", "in/a.txt"),
        ("run", "bash", ""),
        ("run", "python", ""),
    ]
    work = tmp_path / "work"
    work.mkdir()
    assert run_document(page, work, timeout=60).stdout.split() == ["hello", "HELLO"]

    page.write_text("<!-- runnable -->\n\n```bash\ntrue\n```\n")
    with pytest.raises(ValueError, match="right before a fenced block"):
        marked_blocks(page)
    page.write_text("<!-- runnable -->\n```yaml\na: 1\n```\n")
    with pytest.raises(ValueError, match="bash or python"):
        marked_blocks(page)
