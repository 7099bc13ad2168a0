"""The config's own resolvers, registered before any config is composed.

``${run_name:...}`` (overrides as a folder name), ``${sweep_job_name:...}`` and
``${sweep_job_folder:...}`` (a sweep job's folder: ``amp_utils.sweep_keys``,
``recipes.sweep_jobs``), ``${on_cuda:...}`` (``fast_path=auto``) and ``${config_help:}``
(``train.py --help``). A module of its own: the resolvers come from the config checks and
from the sweep jobs, which themselves import the config checks.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from amp_utils.sweep_keys import fit_folder_name, sweep_job_name
from recipes.config import on_cuda
from recipes.config_help import config_help
from recipes.sweep_jobs import sweep_job_folder


def run_name(overrides: str | None) -> str:
    """A run folder's name from its overrides (Hydra's ``override_dirname``): ``default``
    without any, ``/`` made ``_``, at most 255 bytes (``fit_folder_name``)."""
    return fit_folder_name((overrides or "default").replace("/", "_"))


def register_resolvers() -> None:
    """Register ``${run_name:...}`` (overrides as a folder name), ``${sweep_job_name:...}``,
    ``${sweep_job_folder:...}``, ``${on_cuda:...}`` and ``${config_help:}``."""
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", run_name)
    if not OmegaConf.has_resolver("sweep_job_name"):
        # ${sweep_job_name:${hydra.sweep.dir},${hydra.job.override_dirname}}: a sweep job's
        # folder (TensorBoard run) named by the keys the sweep varies.
        OmegaConf.register_new_resolver("sweep_job_name", sweep_job_name)
    if not OmegaConf.has_resolver("sweep_job_folder"):
        # ${sweep_job_folder:${hydra.job.num},NAME}: a sweep job's folder, the one of an
        # earlier job of its overrides in the same sweep folder if there is one.
        OmegaConf.register_new_resolver("sweep_job_folder", sweep_job_folder)
    if not OmegaConf.has_resolver("on_cuda"):
        # ${on_cuda:${device.name}}: whether the run trains on a CUDA GPU (fast_path=auto).
        OmegaConf.register_new_resolver("on_cuda", on_cuda)
    if not OmegaConf.has_resolver("config_help"):
        # Hydra's help template goes through string.Template: "$" must be doubled.
        OmegaConf.register_new_resolver(
            "config_help", lambda script="train": config_help(script).replace("$", "$$")
        )
