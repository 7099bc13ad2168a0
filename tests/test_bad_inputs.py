"""Bad input gets one clear message naming the problem and the fix, and a non-zero exit."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch

from amp_utils import CheckpointError
from data.errors import AudioError, DataError, DatasetNotFoundError, ManifestError
from recipes.config import ConfigError
from recipes.experiment import train
from tests.recipe_helpers import FAST, compose_config, manifest_config, run_cli

FIELDS = ["id", "path", "duration", "transcript", "speaker"]


def cli_error(args: list[str], fsdd_root: Path) -> str:
    """Run train.py expecting failure; returns its stderr."""
    result = run_cli("train.py", args, fsdd_root, timeout=300)
    assert result.returncode != 0
    return result.stderr


def test_unknown_precision_lists_choices(fsdd_root):
    err = cli_error(["precision=fp8"], fsdd_root)
    assert "Could not find 'precision/fp8'" in err
    options = err.split("Available options in 'precision':")[1].split("Config search path")[0]
    assert options.split() == ["auto", "bf16", "fp16", "fp32"]  # not the schema (base_precision)


@pytest.mark.parametrize(
    ("override", "group", "choice"),
    [
        ("device=tpu", "device", "cuda"),
        ("model=wav2vec", "model", "xvector"),
        ("data=librispeech", "data", "fsdd_connected"),
    ],
)
def test_unknown_group_option_lists_choices(fsdd_root, override, group, choice):
    err = cli_error([override], fsdd_root)
    assert f"Available options in '{group}'" in err and choice in err


def test_misspelled_key_is_named_with_the_close_match_and_the_valid_keys(fsdd_root, tmp_path):
    """Hydra's own refusal said only "Key 'epohcs' not in 'TrainerConfig'"."""
    args = ["-m", "trainer.epohcs=3", "seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    err = cli_error(args, fsdd_root)
    assert err.count("\n") == 1 and err.startswith("error: trainer.epohcs is not a config key")
    assert "Did you mean trainer.epochs?" in err and "Valid trainer keys: " in err
    assert not (tmp_path / "sweep").exists()  # refused before any job


def test_a_key_of_another_data_option_is_refused_naming_it(fsdd_root, tmp_path):
    """``data.num_train`` is the connected digits' size; on the default digits Hydra said
    "Key 'num_train' not in 'FsddDigitsConfig'" and to add it with ``+``."""
    err = cli_error(["data.num_train=500", f"hydra.run.dir={tmp_path / 'new' / 'run'}"], fsdd_root)
    assert err.count("\n") == 1 and err.startswith("error: data.num_train is a key of ")
    assert "(data=fsdd_connected data.num_train=...)" in err and "data=fsdd_digits" in err
    assert not (tmp_path / "new").exists()


def test_added_misspelled_key_is_refused_with_the_valid_keys(fsdd_root, tmp_path):
    """``+key=value`` adds a key Hydra knows nothing against; the recipe refuses it."""
    err = cli_error(["+trainer.epohcs=3", f"hydra.run.dir={tmp_path / 'new' / 'run'}"], fsdd_root)
    assert err.count("\n") == 1 and err.startswith("error: trainer.epohcs is not a config key")
    assert "Did you mean trainer.epochs?" in err and "Valid trainer keys: " in err
    assert not (tmp_path / "new").exists()  # refused before Hydra made the folder


def test_zero_epochs_fails_with_one_line(fsdd_root, tmp_path):
    err = cli_error(["trainer.epochs=0", f"hydra.run.dir={tmp_path / 'new' / 'run'}"], fsdd_root)
    assert "error: trainer.epochs=0 is not valid; it must be a positive integer" in err
    assert "Traceback" not in err
    assert not (tmp_path / "new").exists()


def test_missing_data_without_network_says_where_and_how(fsdd_root, tmp_path):
    err = cli_error(
        [
            f"data.root={tmp_path / 'nowhere'}",
            "data.download=false",
            f"data.prepared_dir={tmp_path / 'prep'}",
            f"hydra.run.dir={tmp_path / 'new' / 'run'}",
        ],
        fsdd_root,
    )
    assert "error:" in err and "Traceback" not in err
    assert str(tmp_path / "nowhere") in err
    assert "free-spoken-digit-dataset" in err and "data.root" in err
    assert not (tmp_path / "new").exists()  # refused while preparing data: no stray folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_fails_clearly(fsdd_root, tmp_path):
    err = cli_error(["device=cuda", f"hydra.run.dir={tmp_path / 'new' / 'run'}"], fsdd_root)
    assert "error:" in err and "no CUDA GPU" in err and "device=cpu" in err
    assert not (tmp_path / "new").exists()


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")


@pytest.mark.parametrize(
    ("script", "overrides", "message"),
    [
        ("benchmark.py", ["benchmark.steps=0"], "benchmark.steps=0 is not valid"),
        pytest.param(
            "benchmark.py",
            ["device=cuda"],
            "device=cuda was requested but no CUDA GPU",
            marks=NO_GPU,
        ),
        ("diagnose.py", ["diagnose.batches=0"], "diagnose.batches=0 must be 1 or more"),
        pytest.param(
            "diagnose.py",
            ["device=cuda"],
            "device=cuda was requested but no CUDA GPU",
            marks=NO_GPU,
        ),
        # refused once the data is read and the model built (RunFolder.abandon)
        (
            "diagnose.py",
            ["debug=fast", "precision.fp32_modules=[nope]"],
            "precision.fp32_modules: pattern 'nope' matches no module",
        ),
    ],
)
def test_a_refused_benchmark_or_diagnosis_leaves_no_folder_behind(
    fsdd_root, tmp_path, script, overrides, message
):
    """A benchmark or a diagnosis refused for a bad value or a missing GPU left a new run
    folder behind holding Hydra's ``.hydra/`` and an empty log, as training's refusals did
    before ``RunFolderCallback``."""
    args = [*overrides, f"data.prepared_dir={tmp_path / 'prepared'}"]
    result = run_cli(script, [*args, f"hydra.run.dir={tmp_path / 'new' / 'run'}"], fsdd_root)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {message}")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # a float in the schema: the message shows the typed value
        ("data.max_batch_seconds=-1", "data.max_batch_seconds=-1.0 is not valid"),
        ("data.max_batch_seconds=0", "data.max_batch_seconds=0.0 is not valid"),
        ("device.name=tpu", "choose one of: auto, cpu, cuda, cuda:N"),
        ("trainer.compile_mode=fastest", "choose one of: default, reduce-overhead"),
        ("model.task=speaker", "does not fit model.name='conformer_ctc'"),
        ("trainer.distributed_backend=mpi", "choose one of: auto, nccl, gloo"),
        # sizes the model's and the features' constructors check (tracebacks before)
        ("model.num_heads=5", "model=conformer_ctc: d_model=144 is not divisible by num_heads"),
        ("model.subsampling=3", "subsampling must be a power of two"),
        ("model.dropout=1.5", "dropout probability has to be between 0 and 1"),
        ("data.features.n_mels=0", "data.features.n_mels=0 is not valid"),
        ("data.features.n_mels=1", "n_mels=1 is too small for subsampling"),
        ("data.features.hop_length=0", "data.features.hop_length=0 is not valid"),
        ("data.features.win_length=300", "win_length=300 is longer than data.features.n_fft=256"),
        ("device.num_workers=-1", "device.num_workers=-1 is not valid; it must be >= 0"),
        ("data.ascending_epochs=-1", "data.ascending_epochs=-1 is not valid; it must be >= 0"),
        (
            "trainer.graph_step_later_warmup=0",
            "trainer.graph_step_later_warmup=0 is not valid; it must be a positive integer",
        ),
        (
            "trainer.compile_module_keys=[modle]",
            "which are not modules of the run; valid: features",
        ),
        ("data=manifest", "data.train, data.valid, data.test must be set (data=manifest"),
        # connected digits: the config's keys, not the generator's arguments
        ("data=fsdd_connected data.silence_min=0.5", "data.silence_min=0.5 and data.silence_max"),
        ("data=fsdd_connected data.min_digits=0", "data.min_digits=0 and data.max_digits=7 are"),
    ],
)
def test_bad_values_fail_before_any_work(tmp_path, override, message):
    cfg = compose_config([*FAST, *override.split(), f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        train(cfg)


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_connected_digits_need_utterances_in_every_split(tmp_path, split):
    cfg = compose_config(
        [*FAST, "data=fsdd_connected", f"data.num_{split}=0", f"output_dir={tmp_path / 'run'}"]
    )
    with pytest.raises(ConfigError, match=f"data.num_{split}=0 is not valid.*positive integer"):
        train(cfg)


def test_output_folder_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = compose_config([*FAST, f"output_dir={blocker / 'run'}"])
    with pytest.raises(ConfigError, match="not writable.*hydra.run.dir"):
        train(cfg)


# ------------------------------------------------------------------ manifests


@pytest.fixture
def manifests(tmp_path, fsdd_recordings):
    """Valid train/valid/test manifests of a few FSDD files; tests then break one."""
    wavs = sorted(fsdd_recordings.glob("*_theo_1*.wav"))[:6]
    rows = [
        {
            "id": w.stem,
            "path": str(w),
            "duration": "0.5",
            "transcript": [
                "zero",
                "one",
                "two",
                "three",
                "four",
                "five",
                "six",
                "seven",
                "eight",
                "nine",
            ][int(w.name[0])],
            "speaker": "theo",
        }
        for w in wavs
    ]
    paths = {}
    for split in ("train", "valid", "test"):
        paths[split] = tmp_path / f"{split}.csv"
        write_rows(paths[split], rows)
    return paths, rows


def write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def manifest_cfg(tmp_path, paths, *extra):
    return manifest_config(paths, tmp_path / "run", *extra)


def broken_file(tmp_path: Path, kind: str, fsdd_recordings: Path) -> Path:
    path = tmp_path / f"{kind}.wav"
    real = (fsdd_recordings / "0_theo_10.wav").read_bytes()
    if kind == "zero_bytes":
        path.write_bytes(b"")
    elif kind == "text_as_wav":
        path.write_text("this is not audio\n" * 20)
    elif kind == "truncated":
        path.write_bytes(real[: len(real) // 3])
    return path


@pytest.mark.parametrize("kind", ["zero_bytes", "text_as_wav", "truncated"])
def test_bad_audio_file_is_named(tmp_path, manifests, fsdd_recordings, kind):
    paths, rows = manifests
    bad = broken_file(tmp_path, kind, fsdd_recordings)
    write_rows(paths["train"], [*rows, {**rows[0], "id": "bad", "path": str(bad)}])
    with pytest.raises(AudioError, match=f"{bad.name}.*skip_bad_files"):
        train(manifest_cfg(tmp_path, paths))


def test_bad_audio_files_can_be_skipped_and_counted(tmp_path, manifests, fsdd_recordings):
    paths, rows = manifests
    extra = [
        {**rows[0], "id": kind, "path": str(broken_file(tmp_path, kind, fsdd_recordings))}
        for kind in ("zero_bytes", "text_as_wav", "truncated")
    ]
    write_rows(paths["train"], [*rows, *extra])
    results = train(manifest_cfg(tmp_path, paths, "data.skip_bad_files=true"))
    assert results["skipped_files"] == 3


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ("empty", ManifestError, "has no utterances"),
        ("missing_file", ManifestError, "does_not_exist.wav"),
        ("duplicate_ids", ManifestError, "[Dd]uplicate"),
        ("bad_chars", DataError, "7up"),
        ("missing_manifest", ManifestError, "nope.csv"),
    ],
)
def test_bad_manifests_are_named(tmp_path, manifests, change, error, message):
    paths, rows = manifests
    if change == "empty":
        write_rows(paths["train"], [])
    elif change == "missing_file":
        write_rows(paths["train"], [*rows, {**rows[0], "id": "x", "path": "does_not_exist.wav"}])
    elif change == "duplicate_ids":
        write_rows(paths["train"], [*rows, rows[0]])
    elif change == "bad_chars":
        write_rows(paths["train"], [*rows, {**rows[0], "id": "x", "transcript": "7up!"}])
    else:
        paths = {**paths, "train": tmp_path / "nope.csv"}
    with pytest.raises(error, match=message):
        train(manifest_cfg(tmp_path, paths))


def test_empty_data_folder_without_network(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = compose_config(
        [
            *FAST,
            f"data.root={tmp_path / 'empty'}",
            "data.download=false",
            f"data.prepared_dir={tmp_path / 'prep'}",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(DatasetNotFoundError, match="data.root"):
        train(cfg)


def test_checkpoint_of_another_model_is_refused(tmp_path, manifests):
    paths, rows = manifests
    # two speakers, so that the speaker-ID run is not refused for its data first
    two_speakers = [{**row, "speaker": ("theo", "lucas")[i % 2]} for i, row in enumerate(rows)]
    for path in paths.values():
        write_rows(path, two_speakers)
    train(manifest_cfg(tmp_path, paths, "trainer.debug_epochs=1", "trainer.epochs=1"))
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("CKPT+*"))
    before = [(c / "state.pt").read_bytes() for c in ckpts]
    with pytest.raises(CheckpointError, match="different model"):
        train(manifest_cfg(tmp_path, paths, "model=xvector", "trainer.epochs=2"))
    assert [(c / "state.pt").read_bytes() for c in ckpts] == before  # nothing touched
    shutil.rmtree(tmp_path / "run")


def test_speaker_id_with_one_training_speaker_is_refused(tmp_path, manifests):
    """The training speakers are speaker ID's classes: with one (here every row is theo's)
    the loss was 0 from the first step and the run reported a test accuracy of 100 %."""
    paths, _ = manifests
    with pytest.raises(DataError, match=r"has 1 \('theo'\).*at least two speakers"):
        train(manifest_cfg(tmp_path, paths, "model=xvector"))
    assert not (tmp_path / "run" / "results.json").exists()
    assert not list((tmp_path / "run").glob("checkpoints/CKPT+*"))


def test_speaker_id_names_the_fix_for_evaluation_speakers_it_never_trained_on(
    tmp_path, manifests, fsdd_root
):
    """Speaker ID can only name its training speakers. An unseen validation speaker was
    refused with advice for manifests ("build evaluation sets with the training set's
    speakers") also for connected digits, whose splits the recipe draws: there the fix is
    more training utterances (3 of them drew 2 of the 6 speakers)."""
    paths, rows = manifests
    write_rows(
        paths["train"], [{**r, "speaker": ("theo", "lucas")[i % 2]} for i, r in enumerate(rows)]
    )
    write_rows(paths["valid"], [{**r, "speaker": "george"} for r in rows])
    with pytest.raises(DataError, match=r"valid split has speakers .* 'george'.*drop their"):
        train(manifest_cfg(tmp_path, paths, "model=xvector"))
    connected = [
        *FAST,
        "model=xvector",
        "data=fsdd_connected",
        f"data.root={fsdd_root}",
        f"data.prepared_dir={tmp_path / 'prepared'}",
        "data.num_train=3",
        "data.num_valid=4",
        "data.num_test=4",
        f"output_dir={tmp_path / 'connected'}",
    ]
    with pytest.raises(DataError, match=r"training split has not.*Fix: raise data.num_train"):
        train(compose_config(connected))


def test_help_lists_every_option_with_its_description_keys_and_examples(fsdd_root):
    from recipes.config import CONF_DIR, GROUPS

    result = run_cli("train.py", ["--help"], fsdd_root, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout
    for group in GROUPS:
        for option in (CONF_DIR / group).glob("*.yaml"):
            description = option.read_text().splitlines()[0].lstrip("# ").strip()
            assert f"{option.stem}" in text and description in text, option
    assert "*fp32" in text and "*conformer_ctc" in text  # the defaults are marked
    assert "trainer.epochs" in text and "training epochs" in text
    from recipes.config_help import HELP_KEYS

    for group, key in HELP_KEYS:  # each key with its comment (a YAML line's, else the schema's)
        [line] = [line for line in text.splitlines() if line.split()[:1] == [f"{group}.{key}"]]
        assert len(line.split()) > 1, line
    assert "precision of validation/test forward passes" in text  # the schema's help
    assert "Examples:" in text and "precision=bf16 device=cuda" in text


def test_diagnose_help_describes_the_diagnosis_not_training(fsdd_root):
    """``recipes/diagnose.py --help`` printed train.py's help (its description, "Usage: python
    recipes/train.py" and training examples), without the diagnosis's own keys."""
    result = run_cli("diagnose.py", ["--help"], fsdd_root, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout
    assert "Usage: python recipes/diagnose.py" in text and "recipes/train.py" not in text
    assert "numerics.md" in text  # what it writes
    [line] = [line for line in text.splitlines() if line.split()[:1] == ["diagnose.batches"]]
    assert "training batches measured" in line  # with its comment in conf/diagnose.yaml
    assert "precision.fp32_modules" in text and "  precision:" in text  # the fix, the groups


def test_an_fp32_modules_pattern_that_names_nothing_is_refused_before_data_preparation(tmp_path):
    """It was refused only once the manifests had been written."""
    from amp_utils.module_precision import UnknownModulePatternError

    cfg = compose_config(
        [
            *FAST,
            "precision.fp32_modules=[model.nope]",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(UnknownModulePatternError, match="'model.nope' matches no module"):
        train(cfg)
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "choice", ["hparams_search=asr_optuna", "hparams_search=speaker_optuna", "hydra/sweeper=optuna"]
)
def test_a_sweeper_of_an_extra_that_is_not_installed_names_the_install(monkeypatch, choice):
    """Without hydra-optuna-sweeper (extra ``sweep``), Hydra said only "Could not find
    'hydra/sweeper/optuna'" and listed ``basic``, not how to get it."""
    from recipes import config

    monkeypatch.setattr(config, "_installed", lambda package: "optuna" not in package)
    with pytest.raises(ConfigError) as refusal:
        config.check_optional_plugins(["-m", "debug=fast", choice])
    message = str(refusal.value)
    assert message.startswith(f"{choice} needs Hydra's optuna plugin (hydra-optuna-sweeper")
    assert 'pip install -e ".[sweep]"' in message and "\n" not in message
    config.check_optional_plugins(["-m", "hparams_search=nope", "precision=bf16"])  # Hydra's
    monkeypatch.setattr(config, "_installed", lambda package: True)
    config.check_optional_plugins(["-m", choice])  # installed: no refusal
    import tomllib

    extras = tomllib.loads((config.CONF_DIR.parent / "pyproject.toml").read_text())["project"]
    for _, requirement, extra in config.OPTIONAL_PLUGINS.values():  # the advice installs it
        assert requirement in extras["optional-dependencies"][extra]


@pytest.mark.parametrize(
    ("sweep", "refusal"),
    [
        (["model.lr=0.001,-1"], "the sweep's model.lr=-1 is refused: model.lr=-1.0 is not valid"),
        (
            ["model=conformer_ctc,xvector", "data.test_speakers=[theo]"],
            "the sweep's model=xvector is refused: data.test_speakers cannot be used",
        ),
    ],
)
def test_a_bad_value_in_a_sweep_list_fails_before_any_job_trains(
    fsdd_root, tmp_path, sweep, refusal
):
    """A value that composes but is out of range was refused only when its job came: the
    jobs listed before it trained first, then the sweep failed."""
    sweep_dir = tmp_path / "sweep"
    err = cli_error(["-m", *FAST, *sweep, f"hydra.sweep.dir={sweep_dir}"], fsdd_root)
    assert err.startswith(f"error: {refusal}") and err.count("\n") == 1, err[-2000:]
    assert err.rstrip().endswith("No job has run: correct the value and start the sweep again.")
    assert not sweep_dir.exists()


def test_a_sweep_value_check_leaves_the_device_to_each_job() -> None:
    """``device=cuda`` is each job's to check on its own machine (a SLURM node has the GPU
    the submitting host may lack); values Hydra cannot compose are Hydra's to report; a
    value refused in only some combinations of a grid leaves those jobs to fail alone."""
    from recipes.config import sweep_value_problem
    from recipes.resolvers import register_resolvers
    from recipes.schema import register_schemas

    register_resolvers()
    register_schemas()
    assert sweep_value_problem(["-m", "device=cuda", "precision=fp32,bf16"], "config") is None
    assert sweep_value_problem(["-m", "precision=fp32,bf61"], "config") is None
    assert sweep_value_problem(["-m", "model.lr=0.001,0.002", "seed=1,2"], "config") is None
    # a grid with one job that cannot run (144 is not divisible by 5): that job fails alone
    grid = ["-m", "model.d_model=144,160", "model.num_heads=5,4"]
    assert sweep_value_problem(grid, "config") is None
    assert sweep_value_problem(["-m", "model.num_heads=5,4", "trainer.epochs=2,3"], "config") == (
        "the sweep's model.num_heads=5 is refused: model=conformer_ctc: d_model=144 is not "
        "divisible by num_heads=5"
    )


def test_a_folder_given_as_an_audio_file_is_called_a_folder(tmp_path):
    """It was reported as "Audio file not found", though it is there."""
    from data.audio import load_audio
    from recipes.transcribe import as_transcribe_advice

    with pytest.raises(AudioError) as refusal:
        load_audio(tmp_path, 8000)
    assert as_transcribe_advice(refusal.value) == (
        f"Bad audio file {tmp_path}: it is a folder, not an audio file. "
        "Fix: pass a readable audio file (wav, flac, ...)."
    )


def test_a_data_root_that_is_a_file_or_misspelled_leaves_nothing_behind(tmp_path, monkeypatch):
    """``data.root`` naming a file was a FileExistsError traceback; a misspelled one whose
    download failed left the folders made for the download behind."""
    from data.fsdd import ensure_fsdd

    a_file = tmp_path / "a.wav"
    a_file.write_bytes(b"RIFF")
    with pytest.raises(DatasetNotFoundError, match=rf"data.root={a_file} is a file, not a folder"):
        ensure_fsdd(a_file)

    def no_network(url: str, archive: Path, timeout: float) -> None:
        raise OSError("no network")

    monkeypatch.setattr("data.fsdd._download", no_network)
    typo = tmp_path / "dtaa" / "fsdd"
    with pytest.raises(DatasetNotFoundError, match=r"the download failed \(no network\)"):
        ensure_fsdd(typo)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"]  # no dtaa/fsdd/ left


def test_evaluate_untyped_config_gets_a_precision_refusal_naming_the_key():
    """evaluate.py reads the run's saved config without the schema: ``precision.
    eval_precision=fp8`` failed with "Specified autocast mode ('fp8') incorrect", no key."""
    from omegaconf import OmegaConf

    from recipes.config import validate_config

    saved = OmegaConf.create(OmegaConf.to_yaml(compose_config(FAST)))  # as evaluate loads it
    validate_config(saved)
    saved.precision.eval_precision = "fp8"
    with pytest.raises(ConfigError) as refusal:
        validate_config(saved)
    assert str(refusal.value) == (
        "precision.eval_precision='fp8' is not valid; choose one of: fp32, fp16, bf16, auto."
    )


def test_help_lists_the_preset_groups_too():
    """``--help`` listed five groups: not ``debug=fast`` (the quick check), ``experiment``,
    ``hparams_search`` or ``fast_path``; a description went on mid-sentence without a mark."""
    from recipes.config import CONF_DIR, PRESET_GROUPS
    from recipes.config_help import config_help

    text = config_help()
    for group in PRESET_GROUPS:
        assert f"  {group}:" in text
        for option in (CONF_DIR / group).glob("*.yaml"):
            assert f" {option.stem} " in text, option
    assert "@package" not in text
    assert (
        "   *auto            The default: step_graphs on a CUDA device, none elsewhere.\n" in text
    )
    assert "    fast            Fast check of the whole recipe: CPU, 2 batches per stage" in text
    assert "(bf16 on Ampere+ GPUs and on ...\n" in text  # the sentence goes on in the file


def test_a_search_preset_without_m_is_refused_naming_m():
    """``hparams_search=asr_optuna`` without ``-m`` trained one run with the config's values
    and no word that the search did not run."""
    from recipes.config import exit_on_unknown_override_keys
    from recipes.schema import Config

    with pytest.raises(SystemExit) as refusal:
        exit_on_unknown_override_keys(Config, ["hparams_search=asr_optuna"], "config")
    assert str(refusal.value) == (
        "error: hparams_search=asr_optuna is a search over several runs, which Hydra runs only "
        "as a sweep: add -m (python recipes/train.py -m hparams_search=asr_optuna ...)."
    )
    exit_on_unknown_override_keys(Config, ["hparams_search=asr_optuna", "--cfg", "job"], "config")


@pytest.mark.parametrize(
    ("args", "key"),
    [
        ([*FAST, "hydra.run.dir={place}/run"], "hydra.run.dir"),
        (["-m", *FAST, "precision=fp32", "hydra.sweep.dir={place}/sweep"], "hydra.sweep.dir"),
    ],
)
def test_a_run_or_sweep_folder_that_cannot_be_made_is_one_line(tmp_path, fsdd_root, args, key):
    """Hydra makes the run's (or sweep's) folder before the task starts: one below a file
    (or where the user may not write) ended in its NotADirectoryError (PermissionError)
    traceback, found by the 2026-11-29 new-user audit."""
    place = tmp_path / "a_file"
    place.write_text("not a folder\n")
    err = cli_error([arg.format(place=place) for arg in args], fsdd_root)
    assert "Traceback" not in err, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: The folder ") and f"{place} is a file, not a folder" in line
    assert f"Fix: give a folder you can write in ({key}=PATH)." in line
    assert place.read_text() == "not a folder\n"


def test_a_folder_that_may_not_be_written_in_is_named(tmp_path, monkeypatch):
    """As root every folder is writable: the check's other branch with os.access patched."""
    from recipes import run_folder

    monkeypatch.setattr(run_folder.os, "access", lambda path, mode: False)
    problem = run_folder.folder_problem(tmp_path / "new" / "run", "hydra.run.dir")
    assert problem is not None and f"{tmp_path} is not writable" in problem
    monkeypatch.undo()
    assert run_folder.folder_problem(tmp_path / "new" / "run", "hydra.run.dir") is None
