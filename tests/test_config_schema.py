"""The typed config schema (recipes/schema.py): every option composes against it, and unknown
keys, bad choices and wrongly typed values are refused while composing, naming the valid ones."""

from __future__ import annotations

import re
import shutil

import pytest
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from data.synthetic_voices import SynthesizerUnavailableError
from recipes.config import (
    CONF_DIR,
    ConfigError,
    check_option_keys,
    check_override_keys,
    validate_config,
)
from recipes.preflight import USER_ERRORS, preflight, run_options
from recipes.schema import (
    OPTION_SCHEMAS,
    BenchmarkRunConfig,
    Config,
    DiagnoseRunConfig,
    Precision,
    register_schemas,
)
from tests.recipe_helpers import FAST, compose_config, run_cli

#: group -> every YAML option of it (conf/<group>/*.yaml).
GROUP_OPTIONS = {
    group.name: sorted(p.stem for p in group.glob("*.yaml"))
    for group in sorted(CONF_DIR.iterdir())
    if group.is_dir() and group.name != "hydra"
}


@pytest.mark.parametrize(
    ("group", "option"),
    [(group, option) for group, options in GROUP_OPTIONS.items() for option in options],
)
def test_every_option_composes_against_its_schema(group, option):
    # data=manifest has no default manifests: they are required (validate_config says so)
    paths = ["data.train=a.csv", "data.valid=b.csv", "data.test=c.csv"] * (option == "manifest")
    cfg = compose_config([f"{group}={option}", "output_dir=unused", *paths])
    validate_config(cfg)
    resolvable = {k: v for k, v in cfg.items() if k != "data" or v.name != "manifest"}
    OmegaConf.to_container(OmegaConf.create(resolvable), resolve=True)  # every value has a type


def test_added_unknown_key_is_refused_naming_the_valid_keys():
    cfg = compose_config(["+trainer.epohcs=3", "output_dir=unused"])
    with pytest.raises(ConfigError, match=r"trainer.epohcs .*Valid trainer keys: .*epochs"):
        validate_config(cfg)


def test_overriding_an_unknown_key_is_refused_while_composing():
    with pytest.raises(ConfigCompositionException, match="trainer.epohcs"):
        compose_config(["trainer.epohcs=3"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trainer.epoch=3"], "trainer.epoch is not a config key. Did you mean trainer.epochs?"),
        (["sed=3"], "sed is not a config key. Did you mean seed? Valid top-level keys: data,"),
        (["data.features.n_mel=40"], "Did you mean data.features.n_mels? Valid data.features"),
        (["model.chanels=8"], "Did you mean model.channels?"),  # x-vector's, not the default's
        (["-m", "seed=1,2", "model.lrr=1,2"], "model.lrr is not a config key"),  # a sweep
        (["data.num_trian=5"], "Did you mean data.num_train?"),  # fsdd_connected's
        # the option picked on the command line: its keys, not a Conformer key ("Did you mean
        # model.num_layers?", which an x-vector run refuses too)
        (
            ["model=xvector", "model.num_speakers=3"],
            "model.num_speakers is not a config key. Valid model=xvector keys: channels, dropout,",
        ),
        (["model=xvector", "model.chanels=8"], "model.channels? Valid model=xvector keys: ch"),
    ],
)
def test_an_override_of_an_unknown_key_is_refused_with_the_close_match(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_override_keys(args, Config)


@pytest.mark.parametrize(
    "args",
    [
        ["trainer.epochs=3", "seed=3", "model.channels=8", "data.features.n_mels=40"],
        ["data.test_speakers=[george]", "precision.fp32_modules=[model.x]", "data.train=a.csv"],
        ["-m", "precision=fp32,bf16", "data.wave_augment.speeds=[0.9,1.0]", "experiment=gpu_asr"],
        ["+trainer.epohcs=3", "~trainer.debug", "hydra.run.dir=x", "hydra/launcher=slurm"],
        ["precision=fp8", "fast_path=cuda_graphs", "debug=fast", "--cfg", "job", "--help"],
        ["trainer.epochs=(", "data@foo.bar=1"],  # Hydra's own parser and packages: Hydra's
    ],
)
def test_known_keys_group_choices_and_what_hydra_checks_pass_the_key_check(args):
    check_override_keys(args, Config)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["data.num_train=5"],
            "data.num_train is a key of data=fsdd_connected, not of this run's "
            "data=fsdd_digits: choose that option (data=fsdd_connected data.num_train=...).",
        ),
        (
            ["model.channels=8"],
            "model.channels is a key of model=xvector, not of this run's model=conformer_ctc",
        ),
        (["-m", "precision=fp32,bf16", "data.num_train=5,6"], "not of this run's data=fsdd_digits"),
        (["model=xvector", "data.num_train=5"], "data.num_train is a key of data=fsdd_connected"),
    ],
)
def test_a_key_of_another_option_than_the_runs_is_refused_naming_the_options(args, message):
    """Hydra refused ``data.num_train=5`` on the default data with "Key 'num_train' not in
    'FsddDigitsConfig'" and the advice to add it with ``+``, which is refused in turn."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_option_keys(args, "config")


@pytest.mark.parametrize(
    "args",
    [
        ["experiment=gpu_asr", "data.num_train=5"],  # the preset chooses fsdd_connected
        ["data=fsdd_connected", "data.num_train=5", "model=xvector", "model.channels=8"],
        ["-m", "data=fsdd_digits,fsdd_connected", "data.num_train=5"],  # Hydra's, per job
        ["trainer.epochs=3", "data.max_batch_seconds=8"],  # keys of every option: no compose
        ["data.num_train=(", "data.num_train=5"],  # Hydra cannot parse it: Hydra's
        ["+experiment=gpu_asr", "data.num_train=5"],  # composed with the + override too
        ["data=fsdd_connected", "~data.test_speakers", "data.num_train=5", "--cfg", "job"],
    ],
)
def test_keys_of_the_runs_options_pass_the_option_check(args):
    check_option_keys(args, "config")


def test_the_option_check_composes_only_for_a_key_some_options_lack(monkeypatch):
    """Composing costs a fraction of a second: a command line without such a key skips it."""
    import hydra

    composed = []
    real = hydra.initialize_config_dir
    monkeypatch.setattr(
        hydra, "initialize_config_dir", lambda *a, **k: composed.append(a) or real(*a, **k)
    )
    check_option_keys(["trainer.epochs=3", "seed=3", "precision=bf16"], "config")
    assert not composed
    with pytest.raises(ConfigError):
        check_option_keys(["data.num_train=5"], "config")
    assert len(composed) == 1


@pytest.mark.parametrize("script", ["train.py", "diagnose.py", "benchmark.py"])
def test_printing_the_resolved_config_runs_nothing_and_works(script, fsdd_root, tmp_path):
    """The README's ``--cfg job --resolve``: the run folder is null then (no run), which
    the schema must accept (it failed with an InterpolationValidationError)."""
    result = run_cli(script, ["model=xvector", "--cfg", "job", "--resolve"], fsdd_root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "output_dir: null" in result.stdout and "name: xvector" in result.stdout


def test_the_benchmark_and_diagnose_keys_are_known_to_their_entry_points():
    check_override_keys(["benchmark.steps=3"], BenchmarkRunConfig)
    check_override_keys(["diagnose.batches=3"], DiagnoseRunConfig)
    with pytest.raises(ConfigError, match="benchmark is not a config key"):
        check_override_keys(["benchmark.steps=3"], Config)
    with pytest.raises(ConfigError, match="Did you mean benchmark.steps?"):
        check_override_keys(["benchmark.step=3"], BenchmarkRunConfig)


def test_the_schemas_are_not_options_of_the_groups_they_type():
    """``precision=bf17`` lists the options; a schema listed there (``base_precision``) is no
    choice: they live in the ``schema`` group, and every option of a group extends one."""
    for group, options in OPTION_SCHEMAS.items():
        names = {name for name, _ in options}
        for path in (CONF_DIR / group).glob("*.yaml"):
            defaults = OmegaConf.load(path).get("defaults", [])
            used = [d for d in defaults if isinstance(d, str) and d.startswith("/schema/")]
            assert len(used) == 1 and used[0].removeprefix("/schema/").split("@")[0] in names
    register_schemas()
    stored_groups = {
        name for name, node in ConfigStore.instance().repo.items() if isinstance(node, dict)
    }
    assert stored_groups.isdisjoint(OPTION_SCHEMAS), stored_groups


def test_unknown_precision_is_refused_naming_the_choices():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["precision.name=fp8"])
    message = f"{err.value} {err.value.__cause__}"
    assert "fp8" in message and "fp32, fp16, bf16, auto" in message


def test_wrongly_typed_value_is_refused_while_composing():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["trainer.epochs=abc"])
    message = f"{err.value} {err.value.__cause__}"
    assert "abc" in message and "trainer.epochs" in message


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "auto"])
def test_eval_precision_defaults_to_the_training_precision(precision):
    cfg = compose_config([f"precision={precision}"])
    assert cfg.precision.name == cfg.precision.eval_precision == Precision(precision)
    assert cfg.precision.allow_tf32 is False
    assert compose_config(["precision=fp16", "precision.eval_precision=fp32"]).precision == {
        "name": "fp16",
        "eval_precision": "fp32",
        "allow_tf32": False,
        "fp32_modules": [],
        "low_precision_norms": False,
        "norm_saves_16bit": False,
        "fused_weight_casts": True,
    }


def test_both_ways_of_halving_the_layer_norms_saves_are_refused_together():
    cfg = compose_config(
        ["precision=bf16", "precision.low_precision_norms=true", "precision.norm_saves_16bit=true"]
    )
    with pytest.raises(ConfigError, match="cannot both be on.*Pick one"):
        validate_config(cfg)
    validate_config(compose_config(["precision=bf16", "precision.norm_saves_16bit=true"]))


def test_every_data_set_gets_the_shared_spec_augment():
    for data in GROUP_OPTIONS["data"]:
        cfg = compose_config([f"data={data}"])
        assert cfg.data.spec_augment == {
            "enabled": True,
            "freq_mask": 8,
            "time_mask": 8,
            "n_freq_masks": 2,
            "n_time_masks": 2,
            "freq_warp": 0.0,
        }


def test_debug_fast_is_the_tests_fast_settings_and_yields_to_the_command_line():
    cfg = compose_config(FAST)
    assert cfg.device.name == "cpu" and cfg.device.num_workers == 0
    assert cfg.trainer.debug and cfg.trainer.debug_batches == 2 and cfg.trainer.noprogressbar
    assert compose_config([*FAST, "device=cuda"]).device.name == "cuda"


def test_gpu_experiment_composes():
    cfg = compose_config(["experiment=gpu_asr", "output_dir=unused"])
    validate_config(cfg)
    assert cfg.model.name == "conformer_ctc_m" and cfg.data.num_train == 50000


def test_new_voices_experiment_is_the_measured_augmentation():
    """The held-out-speaker sweep's settings (docs/new_voices.md), on the ASR recipe."""
    cfg = compose_config(["experiment=new_voices", "data.test_speakers=[lucas]"])
    validate_config(cfg)
    assert cfg.model.name == "conformer_ctc" and cfg.data.name == "fsdd_digits"
    assert list(cfg.data.wave_augment.speeds) == [0.9, 1.0, 1.1]
    assert cfg.data.wave_augment.noise_prob == 0.5 and cfg.data.spec_augment.freq_warp == 0.1
    assert cfg.data.synthetic_voices == 0  # needs engines a fresh machine may lack
    # Kept on the front end its figures (docs/new_voices.md) were measured with (superseded
    # since a63cb99).
    assert cfg.data.features.normalize == "per_bin" and cfg.data.wave_augment.channel_prob == 0


@pytest.mark.parametrize(
    ("overrides", "cut_prob"),
    [
        ([], 0.3),  # the ASR recipe on single digits: measured CER 3.03 -> 2.50 % (docs/results.md)
        (["model=xvector"], 0.0),  # speaker ID: not measured with end cuts
        (["data=fsdd_connected"], 0.0),  # a cut would drop the last digit of a sequence
        (["experiment=new_voices"], 0.0),  # the held-out figures were measured without
    ],
)
def test_end_cuts_are_on_only_where_they_were_measured(overrides, cut_prob):
    cfg = compose_config([*overrides, "output_dir=unused"])
    validate_config(cfg)
    assert cfg.data.wave_augment.cut_end_prob == cut_prob


@pytest.mark.parametrize(
    ("overrides", "normalize", "channel_prob"),
    [
        ([], "utterance", 0.5),  # ASR, single digits: held-out speakers (docs/new_voices.md)
        (["experiment=new_voices"], "per_bin", 0.0),  # the front end it was measured with
        (["model=xvector"], "per_bin", 0.0),  # speaker ID: not measured
        (["data=fsdd_connected"], "per_bin", 0.0),  # connected digits: not measured
        (["experiment=gpu_asr"], "per_bin", 0.0),  # Conformer-M on connected digits
        (["data=fsdd_digits", "model.feature_normalize=per_bin"], "per_bin", 0.5),
    ],
)
def test_utterance_normalisation_and_random_channels_are_on_only_where_measured(
    overrides, normalize, channel_prob
):
    cfg = compose_config([*overrides, "output_dir=unused"])
    validate_config(cfg)
    assert cfg.data.features.normalize == normalize
    assert cfg.data.wave_augment.channel_prob == channel_prob


@pytest.mark.parametrize(
    ("overrides", "averaged"),
    [
        ([], 3),  # the ASR recipe tests the average of its 3 best checkpoints (docs/new_voices.md)
        (["model=xvector"], 1),  # speaker ID: averaging measured within one utterance, off
        (["model=conformer_ctc_m"], 1),  # not measured
        (["trainer.average_checkpoints=5"], 5),  # the command line wins
        (["model.average_checkpoints=2"], 2),
    ],
)
def test_checkpoint_averaging_defaults_to_the_models_measured_choice(overrides, averaged):
    cfg = compose_config([*overrides, "output_dir=unused"])
    validate_config(cfg)
    assert cfg.trainer.average_checkpoints == averaged


@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_label_smoothing_outside_zero_to_one_is_refused(value):
    cfg = compose_config([*FAST, "model=xvector", f"model.label_smoothing={value}"])
    with pytest.raises(ConfigError, match=r"model.label_smoothing=.* must be in \[0, 1\)"):
        validate_config(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.spec_augment.freq_warp=-0.1",
            r"data.spec_augment: freq_warp must lie in \[0, 0.5\)",
        ),
        ("data.spec_augment.freq_warp=0.5", r"data.spec_augment: freq_warp must lie in \[0, 0.5\)"),
        (
            "data.wave_augment.noise_prob=1.5",
            r"data.wave_augment: noise_prob .* must lie in \[0, 1\]",
        ),
        (
            "data.wave_augment.pink_share=-1",
            r"data.wave_augment: noise_prob .* pink_share .*got 0.0 and -1",
        ),
        ("data.wave_augment.snr_db=[30,10]", r"data.wave_augment: snr_db must be \[low, high\]"),
        ("data.wave_augment.cut_end_max=1", r"data.wave_augment: cut_end_prob .* cut_end_max"),
        ("data.wave_augment.speeds=[0.9,0]", r"data.wave_augment: speeds must be positive"),
        ("data.wave_augment.channel_prob=2", r"data.wave_augment: channel_prob .* channel_db"),
        ("data.wave_augment.channel_db=-3", r"data.wave_augment: channel_prob .* channel_db"),
        ("data.wave_augment.speeds=[]", r"data.wave_augment: speeds must be positive"),
        # accepted, then masked nothing: a negative width or count draws no mask
        ("data.spec_augment.freq_mask=-1", r"data.spec_augment: freq_mask, time_mask, .* >= 0"),
        ("data.spec_augment.time_mask=-8", r"data.spec_augment: freq_mask, time_mask, .* >= 0"),
        ("data.spec_augment.n_freq_masks=-1", r"data.spec_augment: .*n_freq_masks.* >= 0"),
        ("data.spec_augment.n_time_masks=-2", r"data.spec_augment: .*n_time_masks.* >= 0"),
        # accepted, then an infinite resampling factor or gain in the first training batch
        ("data.wave_augment.speeds=[1.0,inf]", r"data.wave_augment: speeds must be positive"),
        ("data.wave_augment.channel_db=inf", r"data.wave_augment: channel_prob .* channel_db"),
        ("data.wave_augment.snr_db=[-inf,30]", r"data.wave_augment: snr_db must be \[low, high\]"),
    ],
)
def test_augmentation_values_outside_their_range_are_refused_before_any_work(override, message):
    """The augmentation modules' own checks run in ``validate_config``, named by group."""
    cfg = compose_config([*FAST, override])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.synthetic_voices=-1"], "data.synthetic_voices"),
        (["model=xvector", "data.synthetic_voices=5"], "works with data=fsdd_digits and an ASR"),
        (["data=fsdd_connected", "data.synthetic_voices=5"], "got data=fsdd_connected"),
    ],
)
def test_synthetic_voices_where_they_cannot_work_are_refused(overrides, message):
    cfg = compose_config([*FAST, *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_synthetic_voices_without_the_engines_are_refused_before_any_work(monkeypatch):
    """The missing engines and the install command, in one line, before data is prepared."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cfg = compose_config([*FAST, "device=cpu", "data.synthetic_voices=10"])
    with pytest.raises(SynthesizerUnavailableError, match="apt-get install") as err:
        preflight(cfg)
    assert isinstance(err.value, USER_ERRORS)


@pytest.mark.parametrize(
    ("data", "default"),
    [("fsdd_digits", "utterance"), ("fsdd_connected", "per_bin"), ("manifest", "per_bin")],
)
def test_feature_normalisation_defaults_and_a_typo_names_the_choices(data, default) -> None:
    overrides = [*FAST, f"data={data}"]
    if data == "manifest":
        overrides += ["data.train=t.csv", "data.valid=v.csv", "data.test=t.csv"]
    cfg = compose_config(overrides)
    assert cfg.data.features.normalize == default  # the ASR model's on single digits
    cfg = compose_config([*overrides, "data.features.normalize=global"])
    with pytest.raises(ConfigError, match="data.features.normalize='global'.*per_bin, utterance"):
        validate_config(cfg)


@pytest.mark.parametrize("device", ["cpu", "auto", "cuda"])
def test_device_sizes_the_onednn_cache_for_the_brain(device):
    assert run_options(compose_config([f"device={device}"])).onednn_cache_capacity == 4096
    cfg = compose_config([f"device={device}", "device.onednn_cache_capacity=null"])
    assert run_options(cfg).onednn_cache_capacity is None
    validate_config(cfg)  # null is valid: oneDNN's own default
    cfg = compose_config([f"device={device}", "device.onednn_cache_capacity=-1"])
    with pytest.raises(ConfigError, match="device.onednn_cache_capacity=-1 is not valid.*>= 0"):
        validate_config(cfg)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_weight_casts_reaches_the_brains_run_options(fused):
    cfg = compose_config(["precision=bf16", f"precision.fused_weight_casts={fused}"])
    assert run_options(cfg).fused_weight_casts is fused


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # model sizes: a RuntimeError or ZeroDivisionError traceback while checking the model
        (["model.d_model=-1"], "model.d_model=-1 is not valid; it must be a positive integer"),
        (["model.num_heads=0"], "model.num_heads=0 is not valid; it must be a positive integer"),
        (["model.ffn_dim=-1"], "model.ffn_dim=-1 is not valid; it must be a positive integer"),
        (["model.conv_kernel=-1"], "model.conv_kernel=-1 is not valid; it must be a positive"),
        (["model=xvector", "model.channels=-1"], "model.channels=-1 is not valid; it must be"),
        (["model=xvector", "model.embedding_dim=-1"], "model.embedding_dim=-1 is not valid"),
        # model sizes accepted: no Conformer blocks, -1 heads, zero-width layers
        (["model.num_layers=0"], "model.num_layers=0 is not valid; it must be a positive"),
        (["model.num_heads=-1"], "model.num_heads=-1 is not valid; it must be a positive"),
        (["model.ffn_dim=0"], "model.ffn_dim=0 is not valid; it must be a positive integer"),
        (["model=xvector", "model.channels=0"], "model.channels=0 is not valid"),
        (["model=xvector", "model.embedding_dim=0"], "model.embedding_dim=0 is not valid"),
        # AdamW refused these only once the data were prepared; a negative warm-up is no warm-up
        (["model.weight_decay=-0.01"], r"model.weight_decay=-0.01 is not valid; it must be >= 0"),
        (["model.weight_decay=inf"], r"model.weight_decay=inf is not valid; it must be >= 0"),
        (["model.warmup_steps=-1"], r"model.warmup_steps=-1 is not valid; it must be >= 0"),
        # infinite sizes and rates: accepted, then an infinite learning rate or batch
        (["model.lr=inf"], "model.lr=inf is not valid; it must be a positive number"),
        (["data.max_batch_seconds=inf"], "data.max_batch_seconds=inf is not valid; it must be"),
        (["device.batch_scale=inf"], "device.batch_scale=inf is not valid; it must be a positive"),
        # NaN passes every range comparison: accepted, then NaN weights or an odd crash
        (["model.lr=nan"], "model.lr=nan is not valid; it must be a number"),
        (["model.dropout=nan"], "model.dropout=nan is not valid; it must be a number"),
        (["trainer.max_grad_norm=nan"], "trainer.max_grad_norm=nan is not valid"),
        (["data.cache_audio_mb=nan"], "data.cache_audio_mb=nan is not valid"),
        (["data.wave_augment.snr_db=[nan,30]"], r"data.wave_augment.snr_db\[0\]=nan is not valid"),
        (["data=fsdd_connected", "data.silence_max=inf"], "data.silence_max=inf are not valid"),
        # data.name picks the preparation: a crash (KeyError) or other data than the option's
        (["data.name=manifest"], "data.name='manifest' is not this run's data=fsdd_digits"),
        (["data.name=fsdd_connected"], "data.name='fsdd_connected' is not this run's data="),
        (
            ["data=fsdd_connected", "data.name=fsdd_digits"],
            r"choose the option instead \(data=fsdd_digits\)",
        ),
        (["data.name=mine"], "choose one of: fsdd_digits, fsdd_connected, manifest"),
        # torch.manual_seed overflowed (a traceback once the run folder was locked)
        (["seed=18446744073709551616"], r"seed=18446744073709551616 is not valid; it must lie in"),
        # negative counts and intervals acted as 0 ("off"), which their comments do not say
        (["trainer.ckpt_interval_minutes=-5"], r"trainer.ckpt_interval_minutes=-5.0 is not valid"),
        (["trainer.ckpt_interval_steps=-1"], r"trainer.ckpt_interval_steps=-1 is not valid"),
        (["trainer.stall_warning_minutes=-1"], r"trainer.stall_warning_minutes=-1.0 is not valid"),
        (["trainer.num_text_examples=-1"], r"trainer.num_text_examples=-1 is not valid"),
        # a frequency mask wider than the mel bands: torchaudio masks every band, every time
        (["data.spec_augment.freq_mask=41"], r"data.spec_augment.freq_mask=41 is wider than"),
        # an empty data root is the folder the command runs in: FSDD downloaded there
        (["data.root="], r"data.root='' is empty"),
    ],
)
def test_out_of_range_values_are_refused_before_any_work(overrides, message):
    """Found by walking every leaf key of every option with bad values (audit-config):
    these passed ``validate_config`` and crashed with a traceback, ran with a nonsense value,
    or were refused only after the data were prepared."""
    cfg = compose_config([*FAST, *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.warmup_steps=0", "model.weight_decay=0"],  # no warm-up, no decay
        ["trainer.max_grad_norm=inf", "trainer.ckpt_interval_minutes=inf"],  # never clip, save
        ["data.cache_audio_mb=inf"],  # cache whatever the size
        ["seed=-1", "data.spec_augment.freq_mask=0", "data.spec_augment.n_time_masks=0"],
        ["data=fsdd_connected", "data.name=fsdd_connected"],
    ],
)
def test_edge_values_that_mean_something_pass(overrides):
    validate_config(compose_config([*FAST, *overrides]))
