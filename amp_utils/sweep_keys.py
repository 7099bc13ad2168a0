"""What a Hydra multirun varies, and short job names built from it.

A sweep ``-m precision=fp32,bf16 device=cpu model=xvector`` varies one key: ``precision``.
Naming its jobs (and so TensorBoard's runs) by the swept keys only (``0_precision=fp32``)
keeps the part that differs visible in TensorBoard's truncated run list, where the full
override string (``0_device=cpu,model=xvector,precision=fp32``) is cut before it.

The swept keys come from ``multirun.yaml``, the sweep's master config that Hydra's basic
sweeper saves into the sweep folder before any job starts: the command-line overrides that
are sweeps (``a=1,2``, ``range(...)``, ``choice(...)``, ``glob(...)``) and the keys of
``hydra.sweeper.params``. Sweepers that do not save it (Optuna) keep full names.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

MULTIRUN_FILE = "multirun.yaml"
#: A "," that starts a new ``key=value`` item of Hydra's ``override_dirname`` (not one
#: inside a list value such as ``data.test_speakers=[george,jackson]``).
_ITEM_START = re.compile(r",(?=[+~]*[\w@./-]+=)")


#: The longest file or folder name most filesystems take (ext4, XFS, btrfs, APFS: 255 bytes).
FOLDER_NAME_MAX_BYTES = 255
#: The hex digits of the full name's hash a shortened name ends with.
_DIGEST_CHARS = 12


def fit_folder_name(name: str, max_bytes: int = FOLDER_NAME_MAX_BYTES) -> str:
    """``name`` if it fits in ``max_bytes`` bytes (UTF-8), else its start and a hash of it all.

    A run or sweep job folder is named by its overrides, and a few list-valued overrides or
    an Optuna search (whose job names hold every override) made a name over 255 bytes: the
    run ended in ``[Errno 36] File name too long``, a search at its first trial. A shortened
    name keeps as many whole ``key=value`` items as fit, then ``..`` and 12 hex digits of
    the full name's SHA-256: the same overrides always give the same folder (a rerun resumes
    it) and different ones a different folder. Names that fit are unchanged.
    """
    encoded = name.encode("utf-8")
    if len(encoded) <= max_bytes:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:_DIGEST_CHARS]
    tail = f"..{digest}"
    room = max_bytes - len(tail)
    if room <= 0:
        raise ValueError(f"max_bytes={max_bytes} leaves no room for a name")
    head = encoded[:room].decode("utf-8", errors="ignore")  # never half a character
    starts = [match.start() for match in _ITEM_START.finditer(head)]
    if starts:  # the last item may be cut in two: whole items only
        head = head[: starts[-1]]
    return f"{head}{tail}"


def override_items(override_dirname: str) -> list[str]:
    """``"a=1,b=[x,y]"`` -> ``["a=1", "b=[x,y]"]`` (Hydra's ``override_dirname`` items)."""
    return _ITEM_START.split(override_dirname) if override_dirname else []


def item_key(item: str) -> str:
    """The key of an override item, without ``+``/``++``/``~`` prefixes."""
    return item.partition("=")[0].lstrip("+~")


def swept_keys(sweep_dir: str | Path) -> list[str]:
    """Keys the multirun in ``sweep_dir`` varies (empty if its ``multirun.yaml`` is missing).

    Args:
        sweep_dir: ``hydra.sweep.dir``.

    Returns:
        Keys in command-line order, then those of ``hydra.sweeper.params``, without
        ``+`` prefixes.
    """
    path = Path(sweep_dir) / MULTIRUN_FILE
    if not path.is_file():
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        master = OmegaConf.load(path)
        task = [str(o) for o in OmegaConf.select(master, "hydra.overrides.task", default=[])]
        params = OmegaConf.select(master, "hydra.sweeper.params", default=None) or {}
        overrides = OverridesParser.create().parse_overrides(task)
    except Exception as err:  # a name is not worth failing a sweep for
        log.warning("Cannot read the swept keys from %s (%s); full job names kept", path, err)
        return []
    keys = [o.key_or_group for o in overrides if o.is_sweep_override()]
    keys += [str(k) for k in params if str(k) not in keys]
    return keys


def precision_first(items: list[str]) -> list[str]:
    """Override items with ``precision=...`` first, the others in their order."""
    first = [item for item in items if item_key(item) == "precision"]
    return first + [item for item in items if item not in first]


def sweep_job_name(sweep_dir: str, override_dirname: str) -> str:
    """A sweep job's folder name: its values of the swept keys, ``precision`` first.

    ``precision=bf16`` for ``-m precision=fp32,bf16 device=cpu``; every override
    (``precision=bf16,device=cpu``) when the swept keys are unknown or none of them is in
    this job's overrides. The folder prefixes a number (``recipes.sweep_jobs.sweep_job_folder``),
    so names stay unique.
    """
    items = override_items(override_dirname)
    swept = set(swept_keys(sweep_dir))
    chosen = [item for item in items if item_key(item) in swept] or items
    return ",".join(precision_first(chosen))
