"""The plug-in contract is closed: outside techniques/, no module names a technique.

The rule, for every module under src/speedbench/ except those in speedbench/techniques/
(tests/ are exempt):

(a) Imports. It may import the registry package `speedbench.techniques` and the interface
    `speedbench.techniques.base`, and nothing else under speedbench.techniques: no technique's
    own module (`from speedbench.techniques import loader`, `import speedbench.techniques.sync`).
(b) Names. Every technique in REGISTRY has a vocabulary: its `name`, its fields' keys
    (`data.num_workers`) and their last part (`num_workers`), and its trials.csv columns. The
    module may not
    - hold a string literal equal to one of these words (`"precision"`, `cfg["accumulate"]`,
      `{"parallel": "none"}`; a longer string that contains one, such as a message or an
      override `precision=bf16`, is not checked), nor
    - read one of them as an attribute of a recipe, config or row: an attribute chain that
      starts at, or passes through, a name in RECIPE_NAMES (`recipe.precision`,
      `recipe.data.num_workers`, `self.recipe.accumulate`, `r.num_workers`).
    A step phase that shares a technique's name (`optimizer`, results.schema.PHASES) is a
    phase, not the technique, and is not a violation; GENERIC lists the other words a module
    uses in a meaning of its own.

Code outside techniques/ reaches a technique's settings and figures through the registry
(techniques.columns, techniques.profile_counters, ...) or, in the report, through the run's
files (trials.csv columns the run's techniques declare, techniques.json).
"""
from __future__ import annotations

import ast
from pathlib import Path

import speedbench
from speedbench.results.schema import PHASES
from speedbench.techniques import REGISTRY

PACKAGE = Path(speedbench.__file__).resolve().parent  # the speedbench these tests import
ALLOWED_IMPORTS = {"speedbench.techniques", "speedbench.techniques.base"}
# Names the code gives a recipe, a config or a trials.csv row.
RECIPE_NAMES = {"recipe", "cfg", "config", "r", "row"}
# (module, word): a word used in a meaning of its own, not the technique's.
GENERIC = {
    # env.json's record of the process-wide torch flag, whatever the recipe says
    ("measure/env.py", "cudnn_benchmark"),
    # the report's label for the process's thread counts, read from env.json
    ("report/render.py", "threads"),
}
# (module, word): known leaks still to remove. Each entry is a bug, not a permission.
KNOWN_LEAKS: set[tuple[str, str]] = set()


def vocabulary() -> set[str]:
    words = set()
    for t in REGISTRY:
        words.add(t.name)
        for f in t.fields:
            words |= {f.key, f.key.split(".")[-1]}
        words |= set(t.column_names)
    return words - set(PHASES)


def technique_modules() -> set[str]:
    """Every module under speedbench/techniques/ (a name imported from the package that is
    not one of them, such as REGISTRY, is the registry's)."""
    return {f"speedbench.techniques.{p.stem}" for p in (PACKAGE / "techniques").glob("*.py")}


def all_violations() -> list[tuple[str, str, int]]:
    """Every mention of a technique in the package's modules outside techniques/."""
    words, found = vocabulary(), []
    paths = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "run.py" in paths, f"no speedbench package at {PACKAGE}"
    for path in paths:
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith("techniques/"):
            found += violations(path.read_text(), rel, words)
    return found


def imported(node: ast.AST) -> list[str]:
    """The modules an import statement brings in (`from a import b` may import module a.b)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def chain(node: ast.AST) -> list[str]:
    """The names an attribute chain passes through, outermost receiver last:
    `self.recipe.data` -> ["data", "recipe", "self"]."""
    names = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, (ast.Subscript, ast.Call)):
            node = node.value if isinstance(node, ast.Subscript) else node.func
        else:
            return names + ([node.id] if isinstance(node, ast.Name) else [])


def violations(source: str, rel: str, words: set[str]) -> list[tuple[str, str, int]]:
    """(module, word, line) for every mention of a technique in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        for module in imported(node):
            if module in technique_modules() and module not in ALLOWED_IMPORTS:
                found.append((rel, module, node.lineno))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in words:
            found.append((rel, node.value, node.lineno))
        elif isinstance(node, ast.Attribute) and node.attr in words \
                and RECIPE_NAMES & set(chain(node.value)):
            found.append((rel, node.attr, node.lineno))
    return [v for v in found if v[:2] not in GENERIC]


def test_no_module_outside_techniques_names_a_technique():
    leaks = [f"{module}:{line}: {word}" for module, word, line in all_violations()
             if (module, word) not in KNOWN_LEAKS]
    assert not leaks, "technique names outside techniques/:\n" + "\n".join(leaks)


def test_known_leaks_are_still_there():
    """An allow-list entry whose leak is gone must go too, so that it cannot hide a new one."""
    found = {v[:2] for v in all_violations()}
    assert not KNOWN_LEAKS - found, f"fixed, remove from KNOWN_LEAKS: {KNOWN_LEAKS - found}"


def test_the_rule_catches_each_kind_of_mention():
    """The checker has teeth: an import, a literal and a recipe attribute are each caught;
    a phase, another object's attribute and a longer string are not."""
    sample = ("from speedbench.techniques import loader, REGISTRY\n"
              "import speedbench.techniques.base\n"
              "row = {'precision': 1}\n"
              "workers = recipe.data.num_workers + self.recipe.accumulate\n"
              "step = trainer.optimizer, 'optimizer', 'precision=bf16'\n")
    got = {(word, line) for _, word, line in violations(sample, "sample.py", vocabulary())}
    assert got == {("speedbench.techniques.loader", 1), ("precision", 3),
                   ("num_workers", 4), ("accumulate", 4)}
