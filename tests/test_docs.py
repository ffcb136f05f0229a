"""The operations guide names what the code names: every snake_case name in backticks in
docs/operations.md (metrics, fields, files) is a word of the code, so a renamed metric
cannot linger there (it named `skipped_steps` after update.py had renamed it `skipped_updates`)."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_operations_md_names_only_what_the_code_names():
    code = "\n".join(open(f).read() for pattern in ("*.py", "infra/*.py", "envs/*.py", "lora/*.py", "agent_programs/*.py",
                                                    "distill/*.py", "scripts/*", "benchmarks/*.py")
                     for f in glob.glob(os.path.join(ROOT, pattern)) if os.path.isfile(f))
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        names = set(re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`", f.read()))
    assert len(names) > 50
    assert sorted(n for n in names if not re.search(rf"\b{n}\b", code)) == []


def test_the_readme_layout_table_is_the_tree():
    """Every file of code at the root and in infra/, and every folder at the root, is a row of the README's
    layout tables, and every row names what is there (a renamed or removed file cannot linger in it)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    table = text[text.index("## Layout"):text.index("## Running")]
    named = {n for row in table.splitlines() if row.startswith("| `") for n in re.findall(r"`([\w./]+)`", row.split("|")[1])}
    tree = {f for f in os.listdir(ROOT) if f.endswith(".py")} | {
        f + "/" for f in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, f)) and not f.startswith((".", "_"))
        and f not in ("models", "output", "docs") and not f.endswith(".egg-info")} | {
        "infra/" + f for f in os.listdir(os.path.join(ROOT, "infra")) if f.endswith(".py") and f != "__init__.py"}
    assert named == tree
