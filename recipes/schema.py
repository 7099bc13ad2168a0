"""The typed schema of the recipes' config: one dataclass per config group option family.

Registered in Hydra's ``ConfigStore`` (``register_schemas``): each YAML option under
``conf/<group>/`` extends its schema through its defaults list (``defaults:
[/schema/trainer@_here_, _self_]``; the schemas live in a group of their own, ``schema``, so
they are not offered as options), and ``conf/config.yaml`` / ``conf/benchmark.yaml`` extend
``base_config`` / ``base_benchmark_config``. Hydra then refuses, while composing, every value of
the wrong type (``trainer.epochs=abc``, ``precision.name=fp8``, naming the valid choices).
An override of a key no schema has (``trainer.epohcs=3``) is refused before composing by
``recipes.config.check_override_keys``, with the close match and the valid keys; keys added
with ``+`` and value ranges a type cannot express are checked once, over the composed config,
by ``recipes.config.validate_config``.

The YAML files hold the values and their one-line comments (``--help`` reads them); the
defaults here are only for what the options share (``eval_precision``, ``allow_tf32``,
SpecAugment), so no option file repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class DepthwiseConv(StrEnum):
    """How a depthwise convolution computes on CUDA (``device.cuda_depthwise``)."""

    torch = "torch"  # PyTorch's choice: its own conv_depthwise2d kernels for fp32/bf16
    cudnn = "cudnn"  # channels-last, so that PyTorch picks cuDNN's depthwise kernels
    unfold = "unfold"  # products over sliding windows, summed: fused by torch.compile


class Precision(StrEnum):
    """Autocast precision names (a ``str``: ``Precision.fp16 == "fp16"``)."""

    fp32 = "fp32"  # full precision, autocast off
    fp16 = "fp16"  # float16 autocast + GradScaler
    bf16 = "bf16"  # bfloat16 autocast
    auto = "auto"  # the device's fastest native precision, resolved when the run starts


@dataclass
class PrecisionConfig:
    """``precision/*``: the training and evaluation autocast precisions."""

    name: Precision = MISSING  # training autocast precision
    eval_precision: Precision = field(
        default="${.name}",  # type: ignore[assignment]
        metadata={"help": "precision of validation/test forward passes (default: as name)"},
    )
    allow_tf32: bool = field(
        default=False,
        metadata={"help": "let fp32 matmuls use TF32 on Ampere+ GPUs (false: true fp32)"},
    )
    fp32_modules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "module-name patterns run in fp32 under autocast, e.g. "
            "[model.blocks.*.attention] (recipes/diagnose.py says which)"
        },
    )
    low_precision_norms: bool = field(
        default=False,
        metadata={
            "help": "LayerNorms normalize a bf16/fp16 copy of their input under autocast "
            "(statistics still fp32): half their saved activations on CUDA, which runs "
            "them in fp32"
        },
    )
    norm_saves_16bit: bool = field(
        default=False,
        metadata={
            "help": "LayerNorms that autocast runs in fp32 (CUDA) keep a bf16/fp16 copy of "
            "their normalized input for backward instead of the fp32 input: the forward pass "
            "unchanged, half their saved activations"
        },
    )
    fused_weight_casts: bool = field(
        default=True,
        metadata={
            "help": "cast the weights autocast casts once per step in one kernel each way "
            "instead of one per weight (same values; fewer kernels for small models on GPUs)"
        },
    )


def schema_help(group: str, key: str) -> str:
    """The ``help`` of ``key`` in the schemas of ``group``: the one-line comment of a field
    whose default lives here rather than in the YAML options (``--help`` shows it)."""
    for _, schema in OPTION_SCHEMAS.get(group, ()):
        for schema_field in fields(schema):
            if schema_field.name == key and "help" in schema_field.metadata:
                return schema_field.metadata["help"]
    return ""


@dataclass
class DeviceConfig:
    """``device/*``: where the run trains and how its data loader feeds it."""

    name: str = MISSING  # auto | cpu | cuda | cuda:N (checked by amp_utils.precision)
    num_workers: int = MISSING  # DataLoader worker processes
    pin_memory: bool = MISSING  # page-locked host memory for host->GPU copies
    batch_scale: float = MISSING  # multiplies data.max_batch_seconds
    onednn_cache_capacity: int | None = MISSING  # CPU kernels oneDNN keeps (null: its 1024)
    cuda_depthwise: DepthwiseConv = MISSING  # how depthwise convs compute on CUDA


@dataclass
class ModelConfig:
    """What every model option has: its name, task and optimizer schedule."""

    name: str = MISSING  # model name (also the run folder)
    task: str = MISSING  # asr | speaker
    dropout: float = MISSING  # dropout rate
    lr: float = MISSING  # peak AdamW learning rate
    weight_decay: float = MISSING  # AdamW weight decay
    warmup_steps: int = MISSING  # linear warm-up steps before cosine decay
    epochs: int = MISSING  # default trainer.epochs for this model


@dataclass
class ConformerConfig(ModelConfig):
    """``model/conformer_ctc*``: a Conformer-CTC recognizer."""

    d_model: int = MISSING  # encoder width
    num_layers: int = MISSING  # Conformer blocks
    num_heads: int = MISSING  # attention heads
    ffn_dim: int = MISSING  # feed-forward width
    conv_kernel: int = MISSING  # depthwise convolution kernel
    subsampling: int = MISSING  # time reduction of the conv front end
    decoder: str = MISSING  # greedy (best path) | lexicon (beam search over training words)
    beam_size: int = MISSING  # hypotheses kept per frame by the lexicon decoder
    valid_decoder: str = MISSING  # decoder of the per-epoch validations: greedy | lexicon
    average_checkpoints: int = 1  # default trainer.average_checkpoints for this model
    cut_end_prob: float = 0.0  # default data.wave_augment.cut_end_prob on single digits
    feature_normalize: str = "per_bin"  # default data.features.normalize on single digits
    channel_prob: float = 0.0  # default data.wave_augment.channel_prob on single digits


@dataclass
class XvectorConfig(ModelConfig):
    """``model/xvector``: an x-vector speaker classifier."""

    channels: int = MISSING  # TDNN channels
    embedding_dim: int = MISSING  # speaker embedding size
    max_batch_seconds: float = MISSING  # default data.max_batch_seconds for this model
    label_smoothing: float = MISSING  # cross-entropy label smoothing in training (0: off)


@dataclass
class FeaturesConfig:
    """Log-mel features."""

    n_mels: int = MISSING  # log-mel bands
    n_fft: int = MISSING  # FFT size
    win_length: int = MISSING  # window length (samples)
    hop_length: int = MISSING  # hop length (samples)
    normalize: str = "per_bin"  # per_bin (mean/variance per mel bin) | utterance (one for all bins)
    pad_mode: str = "constant"  # STFT end padding: constant (batch-independent) | reflect


@dataclass
class SpecAugmentConfig:
    """SpecAugment masking during training (torchaudio transforms); shared by every data set."""

    enabled: bool = True  # off: train on clean features
    freq_mask: int = 8  # widest frequency mask (mel bins)
    time_mask: int = 8  # widest time mask (frames); digits last only 30-80 frames
    n_freq_masks: int = 2  # frequency masks per utterance
    n_time_masks: int = 2  # time masks per utterance
    freq_warp: float = 0.0  # VTLP: widest mel-axis warp per utterance (0.1: 0.9-1.1; 0: off)


@dataclass
class WaveAugmentConfig:
    """Speed perturbation and noise on the training waveforms (``recipes/augment.py``)."""

    speeds: list[float] = field(
        default_factory=lambda: [1.0]
    )  # speed factors, one per batch ([1.0]: off)
    noise_prob: float = 0.0  # share of utterances that get white/pink noise (0: off)
    snr_db: list[float] = field(default_factory=lambda: [10.0, 30.0])  # [low, high] SNR range in dB
    pink_share: float = 0.5  # share of the noisy utterances with pink (1/f) instead of white noise
    cut_end_prob: float = (
        0.0  # share of utterances whose end is cut off, as an eager endpointer does (0: off)
    )
    cut_end_max: float = 0.3  # largest share of an utterance's length one cut removes
    channel_prob: float = 0.0  # share of utterances through a random equaliser (0: off)
    channel_db: float = 10.0  # widest gain of the random equaliser, dB up or down


@dataclass
class DataConfig:
    """What every data option has: audio, features and batching."""

    name: str = MISSING  # data set name (also the run folder)
    sample_rate: int = MISSING  # audio is resampled to this rate
    max_batch_seconds: float = MISSING  # padded seconds of audio per batch
    num_buckets: int = MISSING  # length buckets for batching similar durations together
    pad_to_buckets: bool = MISSING  # pad every batch to its bucket's longest utterance
    ascending_epochs: int = 0  # first epochs in shortest-bucket-first order (SortaGrad; 0: off)
    skip_bad_files: bool = MISSING  # skip (and count) unreadable audio instead of failing
    cache_audio_mb: float = MISSING  # decode audio files into memory once if they fit (0: never)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)
    wave_augment: WaveAugmentConfig = field(default_factory=WaveAugmentConfig)


@dataclass
class FsddDigitsConfig(DataConfig):
    """``data/fsdd_digits``: FSDD, one digit per utterance."""

    root: str = MISSING  # local FSDD copy
    download: bool = MISSING  # download FSDD when root has no recordings
    prepared_dir: str = MISSING  # where manifests (and generated audio) go
    test_speakers: list[str] = field(
        default_factory=list,
        metadata={
            "help": "speakers held out: tested on, never trained on (e.g. [jackson]; "
            "[]: the official split)"
        },
    )
    synthetic_voices: int = MISSING  # TTS voices whose ten digits join the training split


@dataclass
class FsddConnectedConfig(FsddDigitsConfig):
    """``data/fsdd_connected``: connected digits generated from FSDD."""

    num_train: int = MISSING  # training utterances
    num_valid: int = MISSING  # validation utterances
    num_test: int = MISSING  # test utterances
    min_digits: int = MISSING  # fewest digits per utterance
    max_digits: int = MISSING  # most digits per utterance
    silence_min: float = MISSING  # shortest pause between digits (s)
    silence_max: float = MISSING  # longest pause between digits (s)
    generation_seed: int = MISSING  # seed of the utterance generator
    epochs: int = MISSING  # default trainer.epochs for this data set


@dataclass
class ManifestConfig(DataConfig):
    """``data/manifest``: your own CSV/JSONL manifests."""

    train: str = MISSING  # training manifest path
    valid: str = MISSING  # validation manifest path
    test: str = MISSING  # test manifest path


@dataclass
class TrainerConfig:
    """``trainer/*``: loop options; they map onto ``amp_utils.RunOptions``."""

    epochs: int = MISSING
    max_grad_norm: float = MISSING
    grad_accumulation_factor: int = MISSING
    skip_nonfinite_grads: bool = MISSING
    nonfinite_patience: int = MISSING
    noprogressbar: bool = MISSING
    ckpt_interval_minutes: float = MISSING
    ckpt_interval_steps: int = MISSING
    stall_warning_minutes: float = MISSING
    prefetch_next_epoch: bool = MISSING
    checkpoint_writes: str = field(
        default="auto",
        metadata={"help": "auto (background on CUDA) | background | foreground"},
    )
    keep_checkpoints: int = MISSING
    average_checkpoints: int = field(
        default=1,
        metadata={"help": "test the average of N checkpoints (1: the best one)"},
    )
    average_from: str = field(
        default="last",
        metadata={"help": "which N checkpoints are averaged: last (final epochs) | best"},
    )
    debug: bool = MISSING
    debug_batches: int = MISSING
    debug_epochs: int = MISSING
    compile: bool = MISSING
    compile_module_keys: Optional[list[str]] = None  # noqa: UP045 (OmegaConf needs Optional)
    compile_mode: str = MISSING
    compile_backend: str = MISSING
    compile_regions: bool = MISSING
    compile_eval: bool = MISSING
    graph_step: bool = field(
        default=False,
        metadata={"help": "capture each batch shape's whole training step as a CUDA graph"},
    )
    graph_step_warmup: int = field(
        default=2, metadata={"help": "eager steps of the first batch shape before its capture"}
    )
    graph_step_later_warmup: Optional[int] = field(  # noqa: UP045 (OmegaConf needs Optional)
        default=None,
        metadata={"help": "eager steps of each later batch shape (null: 1; compiled: 2)"},
    )
    graph_step_max_shapes: int = field(
        default=64, metadata={"help": "batch shapes captured at most (later ones run eagerly)"}
    )
    graph_eval: bool = field(
        default=True,
        metadata={"help": "with graph_step: validation's forward passes as CUDA graphs too"},
    )
    log_interval_steps: int = MISSING
    fused_optimizer: bool = MISSING
    num_text_examples: int = MISSING
    distributed_backend: str = MISSING
    sync_batchnorm: bool = MISSING
    find_unused_parameters: bool = MISSING


@dataclass
class Config:
    """``conf/config.yaml``: the whole training config (the ``model`` and ``data`` nodes are
    typed by their option's schema: ``ConformerConfig``, ``FsddDigitsConfig``, ...)."""

    precision: PrecisionConfig = MISSING
    device: DeviceConfig = MISSING
    model: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = MISSING
    seed: int = MISSING  # seeds python/torch RNGs and the data order
    output_dir: Optional[str] = MISSING  # noqa: UP045 the run folder (null under --cfg: no run)


@dataclass
class BenchmarkConfig:
    """``benchmark`` node of ``conf/benchmark.yaml``: what the benchmark times."""

    precisions: list[str] = MISSING
    modes: list[str] = MISSING
    peer_precisions: list[str] = MISSING
    batch_size: int = MISSING
    utterance_seconds: float = MISSING
    warmup_steps: int = MISSING
    steps: int = MISSING
    tf32_baseline: bool = MISSING
    profile_steps: int = MISSING


@dataclass
class BenchmarkRunConfig(Config):
    """``conf/benchmark.yaml``: the training config plus what to time."""

    benchmark: BenchmarkConfig = MISSING


@dataclass
class DiagnoseConfig:
    """``diagnose`` node of ``conf/diagnose.yaml``: how much the numerics report measures."""

    batches: int = MISSING  # training batches measured


@dataclass
class DiagnoseRunConfig(Config):
    """``conf/diagnose.yaml``: the training config plus what the numerics report measures."""

    diagnose: DiagnoseConfig = MISSING


#: The schemas of each config group's options: a YAML option extends one of them with
#: ``- /schema/<name>@_here_`` in its defaults list. They are stored in a group of their own
#: (``schema``), so that they are not offered as options of the group (``precision=bf17``
#: lists auto, bf16, fp16, fp32 only).
OPTION_SCHEMAS: dict[str, tuple[tuple[str, type], ...]] = {
    "precision": (("precision", PrecisionConfig),),
    "device": (("device", DeviceConfig),),
    "model": (("conformer", ConformerConfig), ("xvector", XvectorConfig)),
    "data": (
        ("fsdd_digits", FsddDigitsConfig),
        ("fsdd_connected", FsddConnectedConfig),
        ("manifest", ManifestConfig),
    ),
    "trainer": (("trainer", TrainerConfig),),
}
SCHEMA_GROUP = "schema"

#: (group, name, schema) of every stored schema; ``group`` None: a primary config's.
SCHEMAS: tuple[tuple[str | None, str, type], ...] = (
    (None, "base_config", Config),
    (None, "base_benchmark_config", BenchmarkRunConfig),
    (None, "base_diagnose_config", DiagnoseRunConfig),
    *(
        (SCHEMA_GROUP, name, schema)
        for options in OPTION_SCHEMAS.values()
        for name, schema in options
    ),
)


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore; call before composing (idempotent)."""
    store = ConfigStore.instance()
    for group, name, schema in SCHEMAS:
        store.store(group=group, name=name, node=schema)
