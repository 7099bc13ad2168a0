"""``--help`` of ``recipes/train.py`` and ``recipes/diagnose.py``: what the command does,
each config group's options with their descriptions, the most used keys (each with the
comment of its config file line, else the schema's) and examples.

The text is made from ``conf/`` itself, so a new option or a changed comment shows in the
help without editing it here; ``conf/config.yaml`` and ``conf/diagnose.yaml`` hand it to
Hydra through the ``${config_help:...}`` resolver (``recipes/resolvers.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from omegaconf import OmegaConf

from recipes.config import CONF_DIR, GROUPS, PRESET_GROUPS
from recipes.schema import schema_help

#: Keys shown by ``--help`` (with the comment of their config file line).
HELP_KEYS = (
    ("trainer", "epochs"),
    ("trainer", "debug"),
    ("trainer", "ckpt_interval_minutes"),
    ("trainer", "grad_accumulation_factor"),
    ("trainer", "compile"),
    ("data", "root"),
    ("data", "max_batch_seconds"),
    ("model", "lr"),
    ("precision", "eval_precision"),
    ("device", "num_workers"),
)
HELP_EXAMPLES = (
    "python recipes/train.py                              # ASR on FSDD digits, fp32",
    "python recipes/train.py precision=bf16 device=cuda   # bf16 autocast on the GPU",
    "python recipes/train.py model=xvector trainer.epochs=5",
    "python recipes/train.py -m precision=fp32,fp16,bf16  # sweep + comparison table",
    "python recipes/train.py model=xvector --cfg job --resolve  # show the config, run nothing",
    "python recipes/train.py debug=fast                   # quick check: 2 batches x 2 epochs",
)


#: ``recipes/diagnose.py --help``: what it does, its own keys and examples (the groups and
#: the other keys are training's: it takes ``train.py``'s overrides).
DIAGNOSE_HELP_INTRO = (
    "Which layers of a recipe are unsafe in fp16/bf16, and the config line that fixes them:",
    "trains a few batches of the real recipe from scratch (nothing is saved) and writes",
    "numerics.md, activation_memory.md and step_operations.md (and .json) into its folder.",
    "It takes the config groups and overrides of train.py.",
)
DIAGNOSE_HELP_KEYS = (("diagnose", "batches"), ("precision", "fp32_modules"))
#: ``HELP_KEYS`` that a diagnosis, a few batches that save nothing, does not use.
TRAINING_ONLY_KEYS = (
    ("trainer", "epochs"),
    ("trainer", "debug"),
    ("trainer", "ckpt_interval_minutes"),
)
DIAGNOSE_HELP_EXAMPLES = (
    "python recipes/diagnose.py precision=fp16                    # the ASR recipe, 4 batches",
    "python recipes/diagnose.py precision=bf16 model=xvector diagnose.batches=8",
    "python recipes/diagnose.py precision=fp16 'precision.fp32_modules=[model.blocks.*.conv]'",
)


def _comments(path: Path) -> tuple[str, dict[str, str]]:
    """A config file's first comment line (after Hydra's ``# @package`` line; `` ...`` when
    its sentence goes on) and the comment of each top-level key."""
    lines = path.read_text().splitlines()
    head = [line for line in lines if not line.startswith("# @package")]
    title = head[0].lstrip("# ").strip() if head and head[0].startswith("#") else ""
    sentence = re.search(r"(?<!e\.g)\. ", title)  # a first sentence that ends in the line
    goes_on = len(head) > 1 and head[1].startswith("# ") and not head[1].startswith("#  ")
    if sentence:
        title = title[: sentence.start() + 1]
    elif title and goes_on and not title.endswith((".", ")", ":")):
        title += " ..."
    keys = {}
    for line in lines:
        if line[:1].isalpha() and "#" in line and ":" in line.split("#")[0]:
            keys[line.split(":", 1)[0].strip()] = line.split("#", 1)[1].strip()
    return title, keys


def config_help(script: str = "train") -> str:
    """``--help`` of ``recipes/train.py`` (``script="train"``) or ``recipes/diagnose.py``
    (``"diagnose"``, which takes training's groups and overrides): what it does, each
    group's options with their descriptions, the most used keys, examples."""
    if script not in ("train", "diagnose"):
        raise ValueError(f"config_help: no help for recipes/{script}.py (train or diagnose)")
    defaults = {}
    for entry in OmegaConf.load(CONF_DIR / "config.yaml").get("defaults", []):
        if isinstance(entry, Mapping):
            defaults.update({str(k): str(v) for k, v in entry.items()})
    if script == "diagnose":
        intro, examples = DIAGNOSE_HELP_INTRO, DIAGNOSE_HELP_EXAMPLES
        keys = DIAGNOSE_HELP_KEYS + tuple(k for k in HELP_KEYS if k not in TRAINING_ONLY_KEYS)
        run_dir = "outputs/<data>/<model>/diagnose/..."
    else:
        intro = (
            "Train a speech model (Conformer-CTC ASR or x-vector speaker ID) on FSDD under the",
            "precision you pick (fp32, or fp16/bf16 torch.autocast). Re-running the same command",
            "resumes the run; a finished run is left as it is.",
        )
        keys, examples, run_dir = HELP_KEYS, HELP_EXAMPLES, "outputs/<data>/<model>/..."
    sweep = "  (-m: sweep)" if script == "train" else ""
    out = [
        *intro,
        "",
        f"Usage: python recipes/{script}.py [group=option ...] [key=value ...]{sweep}",
        "",
        "Config groups (group=option; * = default):",
    ]
    for group in (*GROUPS, *PRESET_GROUPS):
        if script == "diagnose" and group == "hparams_search":
            continue  # a search runs training jobs
        out.append(f"  {group}:")
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            mark = "*" if defaults.get(group) == path.stem else " "
            out.append(f"   {mark}{path.stem:<15} {_comments(path)[0]}")
    out += ["", "Most used keys (key=value; every key: --cfg job):"]
    for group, key in keys:
        if group == "diagnose":  # diagnose.yaml's own node
            comment = _nested_comment(CONF_DIR / "diagnose.yaml", key)
        else:
            option = defaults.get(group, "default")
            comment = _comments(CONF_DIR / group / f"{option}.yaml")[1].get(key)
        out.append(f"  {f'{group}.{key}':<33} {comment or schema_help(group, key)}")
    out.append(f"  {'hydra.run.dir':<33} the run folder (default: {run_dir})")
    out += ["", "Examples:", *(f"  {example}" for example in examples)]
    out += ["", "Hydra's own options: --hydra-help"]
    return "\n".join(out)


def _nested_comment(path: Path, key: str) -> str | None:
    """The comment of ``key`` one level down in a config file (``diagnose:`` / ``  batches:``)."""
    for line in path.read_text().splitlines():
        if line.startswith("  ") and line.strip().startswith(f"{key}:") and "#" in line:
            return line.split("#", 1)[1].strip()
    return None
