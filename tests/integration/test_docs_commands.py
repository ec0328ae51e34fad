"""The commands the docs mark as runnable (harness/documents.py), run as written,
checked on what they leave behind: the dataset-of-your-own walkthrough writes datasets
that load with the ids the page says. (The README's quick start runs with the project's
wheel installed into a new venv, in test_wheel_install.py.) And the docs' links."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from dlrm.app.records import last_record
from feature_spec import FeatureSpec
from harness.documents import marked_blocks, run_document
from harness.processes import REPO


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
    summary = last_record(tmp_path / "runs" / "ads" / "metrics.jsonl", "summary")
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
