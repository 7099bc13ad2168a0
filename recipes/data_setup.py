"""From the ``data`` config to checked datasets and duration-batched DataLoaders.

Under DDP, rank 0 alone downloads, prepares and checks the data (the others wait and get
its utterance lists) and every split is sharded over the ranks: training shards have equal
batch counts (DDP steps together), evaluation shards together cover the whole split.

Connected digits have no audio files: every process loads their source recordings into
memory once (``RecordingBank``), its DataLoader workers inherit them, and the utterances
are built on the fly from rank 0's plans.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from amp_utils.distributed import DistributedInfo, run_on_main
from amp_utils.loaders import seeded_generator, shut_down_workers, tied_worker_init
from data.audio import check_audio_files
from data.connected_digits import (
    ConnectedDigitsDataset,
    RecordingBank,
    load_connected_digits,
    plan_sources,
    prepare_connected_digits,
)
from data.dataset import AudioDataset, PadToBuckets, collate_audio
from data.errors import DataError
from data.fsdd import prepare_fsdd_digits
from data.manifest import Utterance, read_manifest
from data.sampler import DurationBatchSampler
from data.text import CharTokenizer, lexicon_words
from recipes.tasks import task_for

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
DATASETS = ("fsdd_digits", "fsdd_connected", "manifest")
#: Bucket edges are multiples of this many samples (absorbs resampling's rounding).
PAD_QUANTUM_SAMPLES = 64


@dataclass
class DataBundle:
    """The three loaders of a run plus what the model needs to know about the data."""

    train: DataLoader
    valid: DataLoader
    test: DataLoader
    tokenizer: CharTokenizer | None
    speakers: tuple[str, ...]
    words: tuple[str, ...]  # the training transcripts' words (ASR's lexicon; () for speaker ID)
    max_batch_seconds: float  # the samplers' batch budget: data.max_batch_seconds x batch_scale
    skipped_files: list[tuple[str, str]] = field(default_factory=list)
    record: dict = field(default_factory=dict)  # what was trained on, for results.json

    def close(self) -> None:
        """Stop the loaders' worker processes (:func:`amp_utils.loaders.shut_down_workers`).

        Call it when the run is done with its data, e.g. at the end of a sweep's job: left
        to the garbage collector, the next job or the interpreter's exit stalls 5 s per
        worker. The loaders stay usable (a new epoch starts new workers).
        """
        for loader in (self.train, self.valid, self.test):
            shut_down_workers(loader)

    def __enter__(self) -> DataBundle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def data_record(
    data_cfg: DictConfig, manifests: dict[str, Path], utterances: dict[str, list[Utterance]]
) -> dict:
    """What a run trains and is tested on: data root, manifests, utterances, hours and the
    shortest and longest utterance's seconds per split (``transcribe.py`` warns about a
    file far longer than the training audio)."""
    root = OmegaConf.select(data_cfg, "root")
    return {
        "name": str(data_cfg.name),
        "root": str(Path(root).resolve()) if root is not None else None,
        "test_speakers": sorted(OmegaConf.select(data_cfg, "test_speakers") or []),
        "synthetic_voices": int(OmegaConf.select(data_cfg, "synthetic_voices", default=0) or 0),
        "manifests": {split: str(Path(path).resolve()) for split, path in manifests.items()},
        "splits": {
            split: {
                "utterances": len(utts),
                "hours": round(sum(u.duration for u in utts) / 3600, 4),
                **duration_range(utts),
            }
            for split, utts in utterances.items()
        },
    }


def duration_range(utterances: Sequence[Utterance]) -> dict[str, float]:
    """``{"min_seconds": ..., "max_seconds": ...}`` of ``utterances`` (empty for none)."""
    if not utterances:
        return {}
    durations = [u.duration for u in utterances]
    return {"min_seconds": round(min(durations), 3), "max_seconds": round(max(durations), 3)}


def prepare_manifests(data_cfg: DictConfig) -> dict[str, Path]:
    """Prepare (or find) the train/valid/test manifests (plans, for connected digits)."""
    if data_cfg.name == "fsdd_digits":
        return prepare_fsdd_digits(
            data_cfg.root,
            data_cfg.prepared_dir,
            download=data_cfg.download,
            test_speakers=list(data_cfg.get("test_speakers") or []),
            synthetic_voices=int(data_cfg.get("synthetic_voices") or 0),
            sample_rate=data_cfg.sample_rate,
        )
    if data_cfg.name == "fsdd_connected":
        return prepare_connected_digits(
            data_cfg.root,
            data_cfg.prepared_dir,
            num_utterances={
                "train": data_cfg.num_train,
                "valid": data_cfg.num_valid,
                "test": data_cfg.num_test,
            },
            min_digits=data_cfg.min_digits,
            max_digits=data_cfg.max_digits,
            silence_seconds=(data_cfg.silence_min, data_cfg.silence_max),
            seed=data_cfg.generation_seed,
            sample_rate=data_cfg.sample_rate,
            download=data_cfg.download,
        )
    if data_cfg.name == "manifest":
        return {split: Path(data_cfg[split]) for split in SPLITS}
    raise DataError(
        f"data.name={data_cfg.name!r} is unknown; choose one of: {', '.join(DATASETS)}."
    )


def shared_audio(utterances: dict[str, list[Utterance]]) -> dict[str, list[str]]:
    """Audio files that an evaluation split shares with an earlier split, or holds twice.

    A test utterance whose file is also in training (or validation, which picks the tested
    checkpoint) is scored on audio the run has learned from: the test figure then
    overstates the model, and nothing else says so. A file listed twice in one evaluation
    split counts twice in its metrics. Files are compared by their resolved paths.

    Returns:
        ``{"test in train": [paths], ...}`` for each overlap found (``valid in train``,
        ``test in train``, ``test in valid``, ``twice in valid``, ``twice in test``), each
        list sorted; empty when the splits are disjoint.
    """
    files = {
        split: [os.path.realpath(utt.path) for utt in utts] for split, utts in utterances.items()
    }
    found: dict[str, list[str]] = {}
    for later, earlier in (("valid", "train"), ("test", "train"), ("test", "valid")):
        if later in files and earlier in files:
            common = sorted(set(files[later]) & set(files[earlier]))
            if common:
                found[f"{later} in {earlier}"] = common
    for split in ("valid", "test"):
        repeated = sorted(path for path, n in Counter(files.get(split, [])).items() if n > 1)
        if repeated:
            found[f"twice in {split}"] = repeated
    return found


def warn_shared_audio(utterances: dict[str, list[Utterance]]) -> dict[str, list[str]]:
    """Log a warning for each overlap :func:`shared_audio` finds; returns them."""
    found = shared_audio(utterances)
    for overlap, paths in found.items():
        later, _, earlier = overlap.partition(" in ")
        what = (
            f"{len(paths)} audio file(s) of the {earlier} split are listed twice in it"
            if later == "twice"
            else f"{len(paths)} audio file(s) of the {later} split are also in the {earlier} split"
        )
        logger.warning(
            "%s (e.g. %s): its metrics count them %s. Fix: give every split its own "
            "utterances (data.train, data.valid, data.test).",
            what,
            ", ".join(paths[:3]),
            "twice" if later == "twice" else "on audio the run has seen",
        )
    return found


def load_utterances(
    manifests: dict[str, Path], skip_bad_files: bool
) -> tuple[dict[str, list[Utterance]], list[tuple[str, str]]]:
    """Read and check every split's manifest and audio headers before training starts;
    warns when the splits share audio files (:func:`warn_shared_audio`)."""
    splits, skipped = {}, []
    for split in SPLITS:
        utterances = read_manifest(manifests[split])
        good, bad = check_audio_files(utterances, skip_bad_files=skip_bad_files)
        if not good:
            raise DataError(
                f"No readable audio left in the {split} manifest {manifests[split]} "
                f"({len(bad)} bad files). Fix the files or the manifest."
            )
        for path, reason in bad:
            logger.warning("Skipping bad audio file %s: %s", path, reason)
        splits[split], skipped = good, skipped + bad
    warn_shared_audio(splits)
    return splits, skipped


def load_data(
    data_cfg: DictConfig,
) -> tuple[dict[str, list], list[tuple[str, str]], Path | None, dict]:
    """Prepare the configured data set and check it (audio headers) before training starts.

    Returns:
        ``(utterances per split, skipped (path, reason) pairs, recordings folder, record)``;
        the folder is that of the connected digits' source recordings, ``None`` for
        manifests; the record (``data_record``) goes into ``results.json``.
    """
    paths = prepare_manifests(data_cfg)
    if data_cfg.name == "fsdd_connected":
        plans, skipped, recordings = load_connected_digits(
            paths, data_cfg.root, data_cfg.skip_bad_files
        )
        for path, reason in skipped:
            logger.warning("Skipping the utterances that use bad recording %s: %s", path, reason)
        return plans, skipped, recordings, data_record(data_cfg, paths, plans)
    utterances, skipped = load_utterances(paths, data_cfg.skip_bad_files)
    return utterances, skipped, None, data_record(data_cfg, paths, utterances)


def make_datasets(
    utterances: dict[str, list],
    recordings: Path | None,
    sample_rate: int,
    tokenizer: CharTokenizer | None,
    speakers: list[str],
    cache_audio_mb: float = 0,
) -> dict[str, AudioDataset]:
    """One dataset per split: manifest audio files, or connected digits built on the fly.

    The connected digits' source ``recordings`` are read once per process and shared by
    the splits; forked DataLoader workers inherit them instead of reading the files again.
    Audio files are decoded once into memory alike when all splits' audio (float32, by
    the manifests' durations) comes to at most ``cache_audio_mb`` MiB (0: never).
    """
    if recordings is None:
        datasets = {
            split: AudioDataset(utts, sample_rate, tokenizer, speakers=speakers)
            for split, utts in utterances.items()
        }
        seconds = sum(sum(dataset.durations) for dataset in datasets.values())
        expected_mb = seconds * sample_rate * 4 / 2**20
        if 0 < expected_mb <= cache_audio_mb:
            held = sum(dataset.cache_audio() for dataset in datasets.values())
            logger.info(
                "Audio of %d utterances held in memory: %.0f MiB (data.cache_audio_mb=%g).",
                sum(len(dataset) for dataset in datasets.values()),
                held / 2**20,
                cache_audio_mb,
            )
        elif cache_audio_mb > 0:
            logger.info(
                "Audio read from its files for every batch: ~%.0f MiB is more than "
                "data.cache_audio_mb=%g.",
                expected_mb,
                cache_audio_mb,
            )
        return datasets
    used = plan_sources(utt for split in utterances.values() for utt in split)
    bank = RecordingBank.load(recordings, used, sample_rate)
    return {
        split: ConnectedDigitsDataset(utts, bank, tokenizer, speakers=speakers)
        for split, utts in utterances.items()
    }


def check_closed_set_speakers(cfg: DictConfig, utterances: dict[str, list]) -> list[str]:
    """The classes of speaker ID: the training split's speakers, sorted; refuses data that
    speaker ID cannot score.

    With fewer than two training speakers the classifier has nothing to tell apart: its loss
    is 0 from the first step and every validation and test utterance is "identified"
    (accuracy 100 %), a figure that says nothing (a manifest whose ``speaker`` column holds
    one name for everything, or a few connected-digit utterances that all drew one speaker,
    did exactly that). A validation or test speaker absent from training cannot be named;
    the dataset refused it with advice for manifests ("build evaluation sets with the
    training set's speakers") also where the splits are generated (connected digits).

    Raises:
        DataError: naming the speakers and the fix for the configured data set.
    """
    speakers = sorted({utt.speaker for utt in utterances["train"]})
    connected = cfg.data.name == "fsdd_connected"
    if len(speakers) < 2:
        found = f"{len(speakers)} ({', '.join(map(repr, speakers))})" if speakers else "none"
        fix = (
            "raise data.num_train (each utterance draws one speaker)"
            if connected
            else "give the training manifest (data.train) utterances of at least two speakers"
        )
        raise DataError(
            f"model={cfg.model.name} identifies the speakers of its training split, which has "
            f"{found}: with fewer than two there is nothing to tell apart (the accuracy would "
            f"be 100 % whatever the model heard). Fix: {fix}, or train an ASR model."
        )
    for split in ("valid", "test"):
        unseen = sorted({utt.speaker for utt in utterances[split]} - set(speakers))
        if not unseen:
            continue
        fix = (
            "raise data.num_train, so that the training utterances draw every speaker"
            if connected
            else f"drop their utterances from the {split} manifest, or add some of theirs to "
            "the training manifest (data.train)"
        )
        raise DataError(
            f"The {split} split has speakers that the training split has not, "
            f"{', '.join(map(repr, unseen))}: model={cfg.model.name} can only name the "
            f"speakers it trained on ({', '.join(speakers)}). Fix: {fix}."
        )
    return speakers


def build_data(
    cfg: DictConfig, device: torch.device, dist_info: DistributedInfo | None = None
) -> DataBundle:
    """Manifests -> checked datasets -> DataLoaders batched by total audio duration.

    ``dist_info`` (this process's rank and the world size) shards the loaders for DDP.
    """
    data_cfg = cfg.data
    dist_info = dist_info or DistributedInfo()

    # Rank 0 prepares and checks the data once; the others get its utterance lists.
    utterances, skipped, recordings, record = run_on_main(lambda: load_data(data_cfg))
    task = task_for(cfg.model)
    tokenizer = CharTokenizer() if task.needs_tokenizer else None
    if task.closed_set_speakers:  # the speakers are the classes: those trained on
        speakers = check_closed_set_speakers(cfg, utterances)
    else:  # speakers are not predicted; test speakers may be unseen
        speakers = sorted({utt.speaker for split in utterances.values() for utt in split})
    datasets = make_datasets(
        utterances,
        recordings,
        data_cfg.sample_rate,
        tokenizer,
        speakers,
        cache_audio_mb=float(data_cfg.cache_audio_mb),
    )
    budget = float(data_cfg.max_batch_seconds) * float(cfg.device.batch_scale)
    workers = int(cfg.device.num_workers)
    loaders = {}
    for split, dataset in datasets.items():
        sampler = DurationBatchSampler(
            dataset.durations,
            max_batch_seconds=budget,
            shuffle=split == "train",
            seed=cfg.seed,
            num_buckets=data_cfg.num_buckets,
            num_replicas=dist_info.world_size,
            rank=dist_info.rank,
            drop_uneven=split == "train",
            pad_to_buckets=data_cfg.pad_to_buckets,
            pad_quantum=PAD_QUANTUM_SAMPLES / data_cfg.sample_rate,
            # fixed shapes: training drops each bucket's partial batch (other utterances
            # every epoch), which halves the shapes to compile and capture
            drop_last=split == "train" and data_cfg.pad_to_buckets,
            ascending_epochs=int(data_cfg.ascending_epochs) if split == "train" else 0,
        )
        collate = (
            PadToBuckets(sampler.bucket_edges(), data_cfg.sample_rate)
            if data_cfg.pad_to_buckets
            else collate_audio
        )
        if split == "train":
            trained = sampler.epoch_utterances()
            record["train_utterances_per_epoch"] = trained  # results.json: what an epoch uses
            if trained < len(dataset):
                logger.info(
                    "Each training epoch uses %d of the %d training utterances: "
                    "data.pad_to_buckets leaves out each bucket's partial batch, and DDP "
                    "the batches that would give the processes uneven steps (other "
                    "utterances every epoch).",
                    trained,
                    len(dataset),
                )
        loaders[split] = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=bool(cfg.device.pin_memory) and device.type == "cuda",
            persistent_workers=workers > 0,
            generator=seeded_generator(cfg.seed),
            worker_init_fn=tied_worker_init(),  # no worker outlives a killed run
        )
    return DataBundle(
        train=loaders["train"],
        valid=loaders["valid"],
        test=loaders["test"],
        tokenizer=tokenizer,
        speakers=tuple(speakers),
        words=lexicon_words(u.transcript for u in utterances["train"]) if tokenizer else (),
        max_batch_seconds=budget,
        skipped_files=skipped,
        record=record,
    )
