"""The README a newcomer reads: its first two commands are the ones CI and the docs run, its
links lead somewhere, it lists every experiment, and nothing points outside the repository."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SETUP_RUN = "pip install -e . && python -m speedbench +experiment=amp"
# every test, slow tier too, with what they exercise installed (Debian's packages, as root)
SETUP_TEST = ('scripts/install-test-deps.sh && pip install -e ".[test]" && '
              'python -m pytest -q --slow')


def _first_commands(text: str) -> list[str]:
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_first_two_commands_come_first_and_are_the_ones_ci_runs():
    assert _first_commands(README)[:2] == [SETUP_RUN, SETUP_TEST]
    assert README.index(SETUP_RUN) < README.index("## ")  # before any section
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert ci == [SETUP_TEST]


def test_the_docs_give_the_same_commands_as_the_readme():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            if "python -m pytest" in line and "-m " not in line.split("pytest", 1)[1] \
                    and "pip install" in line:
                assert SETUP_TEST in line, f"{path.name}: {line}"
            if "pip install -e ." in line and "speedbench +experiment" in line:
                assert SETUP_RUN in line, f"{path.name}: {line}"


def test_readme_is_short_and_its_links_exist():
    assert len(README.splitlines()) <= 180
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if target.startswith(("http://", "https://")):
            continue
        assert (ROOT / target).exists(), target


def test_every_experiment_is_listed_in_the_readme_or_the_generated_techniques_doc():
    """A technique's experiment appears in docs/techniques.md by itself (generated); the others
    need a row in README's table."""
    listed = set(re.findall(r"^\| `(\w+)`", README, flags=re.M))
    listed |= set(re.findall(r"\(\.\./configs/experiment/(\w+)\.yaml\)",
                             (ROOT / "docs" / "techniques.md").read_text()))
    for path in (ROOT / "configs" / "experiment").glob("*.yaml"):
        assert path.stem in listed, \
            f"neither README's table nor docs/techniques.md lists {path.stem}"


def test_the_generated_docs_and_help_are_up_to_date():
    from speedbench.config import docs

    for path, text in docs.generated(ROOT).items():
        assert path.read_text() == text, \
            f"{path.relative_to(ROOT)} is out of date: run `{docs.COMMAND}`"


def test_nothing_points_outside_the_repository():
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "src" / "speedbench").rglob("*.py"),
             *(ROOT / "configs" / "hydra").rglob("*.yaml")]
    for path in files:
        text = path.read_text()
        for needle in ("../shared", "shared/seeds", "DESIGN.md", "/work/"):
            assert needle not in text, f"{path.relative_to(ROOT)} mentions {needle}"


def test_readme_words_and_verdicts_are_explained():
    for word in ("knob", "variant", "trial", "round", "window", "recipe"):
        assert re.search(rf"^\| {word} \|", README, flags=re.M), word
    for verdict in ("faster", "slower", "equivalent", "inconclusive"):
        assert f"**{verdict}**" in README, verdict
    assert "download.pytorch.org/whl/cpu" in README and "venv" in README
