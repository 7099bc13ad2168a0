"""What the docs tell users to run or look up still holds: the README's two commands exist,
come first, and CI runs the test command verbatim; every ``recipes/{train,diagnose,benchmark}.py``
command of README.md, docs/*.md and conf/'s comments passes Hydra's argument parser, composes
and validates; every test the docs name exists; the model sizes and ``run_gpu.sh``'s part order
they state are the code's."""

from __future__ import annotations

import ast
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


#: A command of an entry point that takes Hydra overrides, and the config it composes.
RECIPE_SCRIPTS = {"train": "config", "diagnose": "diagnose", "benchmark": "benchmark"}
RECIPE_COMMAND = re.compile(r"recipes/(train|diagnose|benchmark)\.py")


def documented_recipe_commands() -> list[tuple[str, str, list[str]]]:
    """``(where, script, arguments)`` of every ``recipes/{train,diagnose,benchmark}.py``
    command that a user may copy: in the ```bash blocks and the inline code spans of
    README.md and docs/*.md, and in the comments of conf/ (whose first lines ``--help``
    shows)."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    lines: list[tuple[str, str]] = []
    for page in pages:
        text = page.read_text()
        for block in bash_blocks(page):
            lines += [(page.name, line) for line in block.replace("\\\n", " ").splitlines()]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        lines += [(page.name, " ".join(span.split())) for span in re.findall(r"`([^`]+)`", prose)]
    for conf in sorted((REPO_ROOT / "conf").rglob("*.yaml")):
        for line in conf.read_text().splitlines():
            if line.lstrip().startswith("#") and "python recipes/" in line:
                lines.append((str(conf.relative_to(REPO_ROOT)), line.lstrip()[1:]))
    found = []
    for where, line in lines:
        match = RECIPE_COMMAND.search(line.split(" #")[0])
        if match:
            args = shlex.split(line.split(" #")[0][match.end() :])
            found.append((where, match.group(1), args))
    return found


def is_placeholder(arg: str) -> bool:
    """``precision=P``, ``seed=S``, ``hydra.run.dir=<a run>``: a value the reader fills in."""
    return "<" in arg or ">" in arg or "..." in arg or bool(re.search(r"=[A-Z]+$", arg))


def documented_train_overrides() -> list[list[str]]:
    """The overrides of every ``recipes/train.py`` command in README.md and docs/*.md (first
    sweep value)."""
    return [
        [first_sweep_value(arg) for arg in args if "=" in arg]
        for _, script, args in documented_recipe_commands()
        if script == "train"
    ]


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


def test_every_documented_recipe_command_passes_hydras_argument_parser():
    """Hydra reads its flags (``-m``, ``--cfg job``) with argparse before any override: an
    override after a flag (``experiment=gpu_asr -m precision=...``) ends the command with
    "unrecognized arguments" before it composes anything."""
    from hydra._internal.utils import get_args_parser

    refused = []
    for where, script, args in documented_recipe_commands():
        try:
            get_args_parser().parse_args(args)
        except SystemExit:
            refused.append(f"{where}: recipes/{script}.py {shlex.join(args)}")
    assert not refused, "Hydra refuses these documented commands' arguments:\n" + "\n".join(refused)


def test_every_documented_recipe_command_composes_and_validates():
    """Every ``recipes/{train,diagnose,benchmark}.py`` command of README.md, docs/*.md and the
    comments of conf/ composes with the real config, and a training command passes its checks
    (the SLURM sweep lives in docs/scaling.md); commands with a value for the reader to fill in
    (``precision=P``) are left out."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from recipes.config import validate_config
    from recipes.resolvers import register_resolvers
    from recipes.schema import register_schemas
    from tests.recipe_helpers import CONF_DIR

    commands = [
        (where, script, [first_sweep_value(arg) for arg in args if "=" in arg])
        for where, script, args in documented_recipe_commands()
        if not any(is_placeholder(arg) for arg in args)
    ]
    assert len(commands) >= 10 and any("hydra/launcher=slurm" in c for _, _, c in commands)
    assert {script for _, script, _ in commands} == set(RECIPE_SCRIPTS)
    register_resolvers()
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="t"):
        for where, script, overrides in commands:
            try:
                cfg = compose(RECIPE_SCRIPTS[script], overrides=overrides, return_hydra_config=True)
                if script == "train":
                    validate_config(cfg)
            except Exception as error:
                message = f"{where}: recipes/{script}.py {overrides}: {error}"
                raise AssertionError(message) from error


def defined_names(path) -> set[str]:
    """The functions and classes defined in the Python file ``path`` (at any depth)."""
    tree = ast.parse(path.read_text())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name for node in ast.walk(tree) if isinstance(node, kinds)}


def test_every_test_the_docs_name_exists():
    """The docs prove behaviour by naming tests (``tests/test_x.py::test_y``, then
    ``::test_z`` for another test of the last file named); a renamed or moved test leaves the
    reader a node id pytest cannot find. Abbreviated names (``..._at_epoch_end_...``) are
    left out."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    reference = re.compile(r"(tests/[\w/]+\.py)|(?:(?<=\.py)|(?<![\w>]))::(\w+)")
    missing = []
    for page in pages:
        current = None
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in reference.finditer(line):
                where = f"{page.name}:{number}"
                if match.group(1):
                    current = REPO_ROOT / match.group(1)
                    if not current.is_file():
                        missing.append(f"{where}: {match.group(1)} does not exist")
                    continue
                name = match.group(2)
                if line[match.end() : match.end() + 3] == "...":
                    continue
                if current is None or not current.is_file() or name not in defined_names(current):
                    test_file = current.relative_to(REPO_ROOT) if current else None
                    missing.append(f"{where}: {test_file}::{name} does not exist")
    assert not missing, "\n".join(missing)


def test_the_model_sizes_the_docs_and_configs_state_are_the_models_sizes():
    """The parameter counts that README.md's config table and the comments of
    conf/model/ and conf/experiment/ (the first lines ``--help`` shows) give a model are,
    within 2 %, those of the model the option builds (Conformer-M's comment said ~27 M of its
    25.6 M)."""
    from recipes.modules import build_model
    from tests.recipe_helpers import compose_config

    stated = []  # (where, overrides, millions)
    for group in ("model", "experiment"):
        for conf in sorted((REPO_ROOT / "conf" / group).glob("*.yaml")):
            comments = " ".join(
                line for line in conf.read_text().splitlines() if line.lstrip().startswith("#")
            )
            for millions in re.findall(r"([\d.]+) M parameters", comments):
                stated.append((conf.name, [f"{group}={conf.stem}"], float(millions)))
    readme = (REPO_ROOT / "README.md").read_text()
    for name, millions in re.findall(r"`(\w+)` \([^()`]*?([\d.]+) M parameters\)", readme):
        stated.append(("README.md", [f"model={name}"], float(millions)))
    assert len(stated) >= 3
    sizes: dict[str, float] = {}
    for where, overrides, millions in stated:
        cfg = compose_config([*overrides, "device=cpu"])
        if cfg.model.name not in sizes:
            model = build_model(cfg, ("a", "b", "c"))
            sizes[cfg.model.name] = sum(p.numel() for p in model.parameters()) / 1e6
        actual = sizes[cfg.model.name]
        assert abs(actual - millions) <= 0.02 * actual, (
            f"{where} says {overrides[0]} has {millions} M parameters; it has {actual:.2f} M"
        )


def test_benchmarks_md_gives_run_gpu_sh_parts_in_their_default_order():
    """docs/benchmarks.md says in which order ``benchmarks/run_gpu.sh`` runs its parts by
    default (what a lease's deadline cuts off first); it listed an order the script had left."""
    script = (REPO_ROOT / "benchmarks" / "run_gpu.sh").read_text()
    [default] = re.findall(r'^PARTS=\$\{PARTS:-"([^"]+)"\}', script, flags=re.M)
    parts = default.split()
    page = " ".join((REPO_ROOT / "docs" / "benchmarks.md").read_text().split())
    sentence = page.split("The default order", 1)[1].split("; a second command", 1)[0]
    named = [name for name in re.findall(r"`(\w+)`", sentence) if name in parts]
    assert named == parts
