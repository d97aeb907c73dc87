"""The benchmark page and its notes: every link and image they show is a
file of the repository, and the page stays a page."""

import pathlib
import re

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
PAGES = [BENCHMARKS / "README.md", BENCHMARKS / "results" / "NOTES.md",
         BENCHMARKS / "results" / "cpu_latest" / "README.md"]


def _slug(heading):
    # GitHub's anchors: lower case, punctuation dropped, spaces to dashes.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.parent.name)
def test_every_link_resolves(page):
    text = page.read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if path and not (page.parent / path).exists():
            broken.append(target)
        elif not path and anchor not in anchors:
            broken.append(target)
    assert not broken, broken


def test_the_page_is_read_in_one_sitting():
    assert len(PAGES[0].read_text().splitlines()) <= 350
