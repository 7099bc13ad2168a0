"""The README's two commands exist, come first, and CI runs the test command verbatim; every
``recipes/train.py`` command documented in the README and in docs/ composes and validates."""

from __future__ import annotations

import re
import shlex

from tests.conftest import REPO_ROOT


def bash_blocks(path) -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", path.read_text(), flags=re.S)


def readme_commands() -> list[str]:
    return bash_blocks(REPO_ROOT / "README.md")


def documented_commands() -> list[str]:
    """The ```bash blocks of README.md and of every docs/*.md page."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    return [block for page in pages for block in bash_blocks(page)]


def test_readme_opens_with_train_and_test_commands():
    train, test = readme_commands()[:2]
    assert "recipes/train.py" in train and "pip install" in train
    assert "pytest" in test and "pip install" in test


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = readme_commands()[1]
    ci_lines = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def documented_train_overrides() -> list[list[str]]:
    """The overrides of every ``recipes/train.py`` command in README.md and docs/*.md (first
    sweep value)."""
    found = []
    for block in documented_commands():
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("#")[0]
            if "recipes/train.py" not in command:
                continue
            args = shlex.split(command.split("recipes/train.py", 1)[1])
            found.append([first_sweep_value(arg) for arg in args if "=" in arg])
    return found


def first_sweep_value(override: str) -> str:
    """``key=a,b`` -> ``key=a``; commas inside brackets (``key=[0.9,1.1]``) are kept."""
    depth = 0
    for i, char in enumerate(override):
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif char == "," and depth == 0:
            return override[:i]
    return override


def test_every_documented_train_command_composes_and_validates():
    """Every ``recipes/train.py`` command in a ```bash block of README.md or docs/*.md composes
    with the real config and passes its checks (the SLURM sweep lives in docs/scaling.md)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from recipes.config import validate_config
    from recipes.resolvers import register_resolvers
    from recipes.schema import register_schemas
    from tests.recipe_helpers import CONF_DIR

    commands = documented_train_overrides()
    assert len(commands) >= 10 and any("hydra/launcher=slurm" in c for c in commands)
    register_resolvers()
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="t"):
        for overrides in commands:
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            validate_config(cfg)
