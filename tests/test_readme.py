"""The README's two commands exist, come first, and CI runs the test command verbatim."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT


def readme_commands() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_opens_with_train_and_test_commands():
    train, test = readme_commands()[:2]
    assert "recipes/train.py" in train and "pip install" in train
    assert "pytest" in test and "pip install" in test


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = readme_commands()[1]
    ci_lines = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines
