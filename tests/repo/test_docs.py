"""The README and docs/ hold together: every relative link resolves inside the repository (its
anchor too), the README starts with the two commands CI runs, its job-file example loads, and the
"coming from" name map names only keys the job config has.

These read Markdown files and the config classes; they start nothing.
"""

from __future__ import annotations

import re
import shlex
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from rlfleet.controller.config import JobConfig, TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(page: Path) -> list[str]:
    """The link targets of ``page`` outside code blocks and code spans."""
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`(?!\])", "", text)  # a code span, unless it is a link's text
    return LINK.findall(text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    broken: list[str] = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(ROOT)})")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


def test_the_pages_have_links_to_check() -> None:
    """The link check reads links: the README links every page of docs/."""
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(ROOT / "README.md")}
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked)
    assert missing == [], f"docs/ pages the README does not link: {missing}"


def test_readme_starts_with_the_main_job_and_the_test_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert first is not None and readme.index(first.group(0)) < 200, "the README must open with its commands"
    commands = [line.split("#", 1)[0].strip() for line in first.group(1).splitlines()]
    assert commands == [
        "uv run --extra cpu rlfleet train examples/smollm2_concise.yaml",
        "uv run --extra cpu pytest -q",
    ]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in [line.strip() for line in ci], ".ci/run must run exactly the README's test command"
    assert (ROOT / shlex.split(commands[0])[-1]).is_file()
    first_screen = "\n".join(readme.splitlines()[:30])
    assert "GiB" in first_screen and "--no-dev" in first_screen, (
        "the install facts belong on the first screen"
    )


def test_readme_job_file_example_loads() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The job file", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, "the README lost its job-file example"
    job = JobConfig.model_validate(yaml.safe_load(block.group(1)))
    assert job.batch.group_size == 4 and job.algorithm.name == "grpo"


def _is_key(model: type[BaseModel], path: list[str]) -> bool:
    """Whether ``a.b.c`` is a key of ``model`` (a section opened, any variant of a tagged one)."""
    field = model.model_fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    annotation = field.annotation
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    members = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, type(int | str))
        else ()
    )
    sections = [m for m in (members or (annotation,)) if isinstance(m, type) and issubclass(m, BaseModel)]
    return any(_is_key(section, path[1:]) for section in sections)


def test_the_name_map_names_real_keys() -> None:
    """Each rlfleet key in docs/coming_from.md's tables (the right column) is a key of the job config."""
    text = (ROOT / "docs" / "coming_from.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    checked: list[str] = []
    wrong: list[str] = []
    for row in rows:
        rlfleet_side = row.rstrip(" |").rsplit(" | ", 1)[1]
        for span in re.findall(r"`([^`]+)`", rlfleet_side):
            key = re.split(r"[:\s]", span, maxsplit=1)[0]
            if not re.fullmatch(r"[a-z_]+(\.[a-z_]+)*", key):
                continue
            if "." in key or key in JobConfig.model_fields or key in TrainerConfig.SHORT:
                checked.append(key)
                if "." in key and not _is_key(JobConfig, key.split(".")):
                    wrong.append(key)
    assert {"batch.group_size", "update.kl_coef", "loggers", "max_response_length"} <= set(checked)
    assert wrong == [], f"docs/coming_from.md names keys the job config lacks: {sorted(set(wrong))}"
