"""amp_utils.distributed and the DDP parts of Brain/Checkpointer, in 2 real gloo processes.

Each check runs in both ranks of one spawned 2-process group (started through the same
environment variables torchrun sets) and writes what it saw to a JSON file per rank; the
tests then compare the ranks' reports.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import signal
import socket
import sys
import traceback
import weakref
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from amp_utils import (
    Brain,
    Checkpointer,
    DistributedConfigError,
    EpochCounter,
    Stage,
    TrainingInterrupted,
)
from amp_utils.checkpoint import STATE_FILE, read_state
from amp_utils.distributed import (
    DistributedInfo,
    all_reduce_counts,
    any_rank,
    destroy_distributed,
    distributed_info,
    init_distributed,
    resolve_backend,
    run_on_main,
)
from recipes.speaker.brain import SpeakerBrain

WORLD_SIZE = 2


class TinyBrain(Brain):
    def compute_forward(self, batch, stage):
        return self.modules.model(batch[0])

    def compute_objectives(self, predictions, batch, stage):
        return torch.nn.functional.mse_loss(predictions, batch[1])


def _fail_on_main() -> None:
    raise ValueError("prepared data is broken")


def _checks(rank: int, tmp: Path) -> dict:
    """Everything each rank reports; runs inside the process group."""
    report: dict = {}
    info = init_distributed("auto", "cpu")
    report["info"] = [info.world_size, info.rank, info.backend, info.is_main]

    # run_on_main: rank 0's result everywhere; its exception raised everywhere.
    report["main_result"] = run_on_main(lambda: f"made by rank {distributed_info().rank}")
    try:
        run_on_main(_fail_on_main)
        report["main_error"] = None
    except ValueError as err:
        report["main_error"] = str(err)

    report["any_rank"] = any_rank(rank == 1, False)
    report["counts"] = all_reduce_counts({"edits": rank + 1, "total": 10})

    # Checkpointer: only rank 0 writes; every rank can load once the call returns.
    model = torch.nn.Linear(3, 3)
    ckpt = Checkpointer(tmp / "ckpts", {"model": model})
    saved = ckpt.save_and_keep_only(meta={"loss": 1.0}, num_to_keep=1)
    report["saved_is_none"] = saved is None
    report["ckpts_after_save"] = len(ckpt.list_checkpoints())

    # Brain: DDP wrapping, gradient all-reduces only on stepping batches (no_sync).
    torch.manual_seed(0)
    brain = TinyBrain(
        {"model": torch.nn.Linear(4, 2)},
        opt_class=lambda p: torch.optim.SGD(p, lr=0.1),
        run_opts={"grad_accumulation_factor": 2, "noprogressbar": True},
    )
    brain.on_fit_start()
    ddp = brain.modules.model
    report["wrapped"] = type(ddp).__name__
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        buffer = bucket.buffer()
        torch.distributed.all_reduce(buffer)
        fut = torch.futures.Future()
        fut.set_result(buffer / WORLD_SIZE)
        return fut

    ddp.register_comm_hook(None, counting_hook)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen))] * 4
    brain.modules.train()
    for step in range(1, 5):
        brain.step = step
        brain.fit_batch(batches[step - 1])
    brain.flush_pending()
    report["allreduce_calls"] = len(calls)
    report["optimizer_steps"] = brain.optimizer_step
    report["weights"] = [p.detach().flatten().tolist() for p in ddp.module.parameters()]
    report["avg_train_loss"] = brain.avg_train_loss

    # Plain datasets handed to the Brain are sharded for training (SpeechBrain's behaviour).
    loader = brain.make_dataloader(list(range(10)), Stage.TRAIN, batch_size=2, shuffle=True)
    report["train_shard"] = [int(i) for batch in loader for i in batch]

    # SyncBatchNorm is CUDA-only in PyTorch: asking for it on CPU fails with the fix.
    try:
        TinyBrain({"model": torch.nn.BatchNorm1d(4)}, run_opts={"sync_batchnorm": True})
        report["sync_bn_error"] = None
    except DistributedConfigError as err:
        report["sync_bn_error"] = str(err)

    report["stopped_in_validation"] = _stop_in_validation(rank, tmp, at=(1, 2))
    # rank 0 signalled in its 4th batch, while rank 1 (3 batches) steps through empty rounds
    report["stopped_after_a_shard_ended"] = _stop_in_validation(rank, tmp, at=(0, 4))

    report["stopped_in_window"] = _stop_in_window(rank, tmp)

    # A window whose gradients overflowed on one rank only is non-finite on every rank
    # (the resumed ranks skip its step together, as the all-reduced step would have).
    for p in ddp.module.parameters():
        p.grad = torch.full_like(p, float("inf") if rank == 0 else 1.0)
    report["window_saved_as"] = brain._pending_grads()

    # Speaker metrics: each rank counts its own shard; the reported accuracy is global.
    speaker = SpeakerBrain(modules={}, run_opts={"noprogressbar": True})
    speaker.correct, speaker.total = (9, 10) if rank == 0 else (1, 10)
    speaker.on_stage_end(Stage.TEST, 0.5, None)
    report["accuracy"] = speaker.test_metrics["accuracy"]
    return report


def _stop_in_validation(rank: int, tmp: Path, at: tuple[int, int]) -> dict:
    """A SIGTERM to one rank alone, ``at`` = (rank, its validation batch) of epoch 1; rank 0
    has 5 validation batches, rank 1 has 3 (evaluation shards may differ). Both ranks must
    stop after the same round with one mid-epoch checkpoint positioned after the epoch's
    training, then resume: epoch 1 validated in full, epoch 2 trained."""
    ckpt_dir = tmp / f"ckpts_valid_{at[0]}_{at[1]}"
    seen: list[tuple[int, int]] = []
    signalled = [False]

    class Validating(TinyBrain):
        def evaluate_batch(self, batch, stage):
            loss = super().evaluate_batch(batch, stage)
            if stage == Stage.VALID:
                seen.append((self._epoch_counter.current, self.step))
                if (rank, self.step) == at and not signalled[0]:
                    signalled[0] = True
                    os.kill(os.getpid(), signal.SIGTERM)
            return loss

    def fit() -> Validating:
        torch.manual_seed(0)
        brain = Validating(
            {"model": torch.nn.Linear(4, 2)},
            opt_class=lambda p: torch.optim.SGD(p, lr=0.1),
            run_opts={"noprogressbar": True},
            checkpointer=Checkpointer(ckpt_dir),
        )
        gen = torch.Generator().manual_seed(rank)
        data = TensorDataset(torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen))
        valid = TensorDataset(
            torch.randn(20 if rank == 0 else 12, 4), torch.randn(20 if rank == 0 else 12, 2)
        )
        brain.fit(EpochCounter(2), DataLoader(data, batch_size=4), DataLoader(valid, batch_size=4))
        return brain

    result: dict = {}
    try:
        fit()
        result["error"] = None
    except TrainingInterrupted as err:
        result["error"] = str(err)
    result["seen"] = list(seen)
    checkpoints = Checkpointer(ckpt_dir).list_checkpoints()
    result["checkpoints"] = [(c.end_of_epoch, c.meta.get("intra_epoch")) for c in checkpoints]
    seen.clear()
    resumed = fit()
    result["resumed_seen"] = list(seen)
    result["resumed_steps"] = resumed.optimizer_step
    return result


def _stop_in_window(rank: int, tmp: Path) -> dict:
    """A SIGTERM to rank 1 alone after its 5th batch of epoch 1, inside the second window
    of 4 accumulated batches (no_sync: each rank holds its own partial gradients). Batch
    6's loss all-reduce carries rank 1's flag and every rank reads it at batch 7, so both
    must stop after batch 7, not at the window's end (batch 8), each saving its own
    gradients; the resumed run must end exactly as an uninterrupted one."""
    signalled = [False]

    class Accumulating(TinyBrain):
        def on_fit_batch_end(self, batch, outputs, loss, should_step):
            if signal_at and (rank, self.step) == (1, 5) and not signalled[0]:
                signalled[0] = True
                os.kill(os.getpid(), signal.SIGTERM)

    def fit(ckpt_dir: Path) -> Accumulating:
        torch.manual_seed(0)
        brain = Accumulating(
            {"model": torch.nn.Linear(4, 2)},
            opt_class=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            run_opts={"noprogressbar": True, "grad_accumulation_factor": 4},
            checkpointer=Checkpointer(ckpt_dir),
        )
        gen = torch.Generator().manual_seed(rank)
        data = TensorDataset(torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen))
        brain.fit(EpochCounter(2), DataLoader(data, batch_size=2))
        return brain

    def weights(brain: Accumulating) -> list[list[float]]:
        return [p.detach().flatten().tolist() for p in brain.modules.model.parameters()]

    signal_at = False
    reference = fit(tmp / "window_ref")
    result: dict = {"reference": weights(reference), "steps": reference.optimizer_step}
    signal_at = True
    try:
        fit(tmp / "window_run")
        result["error"] = None
    except TrainingInterrupted as err:
        result["error"] = str(err)
    [saved] = Checkpointer(tmp / "window_run").list_checkpoints()
    state = read_state(saved.path / STATE_FILE)["state"]["brain"]
    result["saved_grads"] = [
        None if grads is None else [g.flatten().tolist() for g in grads["grads"]]
        for grads in state["rank_pending_grads"]
    ]
    signal_at = False
    resumed = fit(tmp / "window_run")
    result["resumed"] = weights(resumed)
    result["resumed_steps"] = resumed.optimizer_step
    return result


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
    )
    torch.set_num_threads(1)
    faulthandler.enable()  # a native crash prints the Python stack
    out = Path(tmp) / f"rank{rank}.json"
    try:
        out.write_text(json.dumps(_checks(rank, Path(tmp))))
    except Exception:  # reported to the test, which fails with the traceback
        out.write_text(json.dumps({"error": traceback.format_exc()}))
    # Leave together (rank 0 hosts the rendezvous store), without interpreter teardown:
    # the reports are written, and the harness only needs a clean exit code.
    torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ddp_unit")
    mp.spawn(_worker, args=(_free_port(), str(tmp)), nprocs=WORLD_SIZE, join=True)
    found = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for report in found:
        assert "error" not in report, report.get("error")
    return found


def test_process_group_from_torchrun_variables(reports):
    assert [r["info"] for r in reports] == [[2, 0, "gloo", True], [2, 1, "gloo", False]]


def test_run_on_main_shares_the_result_and_the_error(reports):
    assert {r["main_result"] for r in reports} == {"made by rank 0"}
    assert {r["main_error"] for r in reports} == {"prepared data is broken"}


def test_collectives(reports):
    assert all(r["any_rank"] == [True, False] for r in reports)
    assert all(r["counts"] == {"edits": 3.0, "total": 20.0} for r in reports)


def test_checkpoint_written_once_by_rank_zero(reports):
    assert [r["saved_is_none"] for r in reports] == [False, True]
    assert all(r["ckpts_after_save"] == 1 for r in reports)


def test_brain_wraps_ddp_and_syncs_gradients_only_on_optimizer_steps(reports):
    assert all(r["wrapped"] == "DistributedDataParallel" for r in reports)
    assert all(r["allreduce_calls"] == 2 for r in reports)  # 4 batches, accumulation 2
    assert all(r["optimizer_steps"] == 2 for r in reports)
    assert reports[0]["weights"] == reports[1]["weights"]  # ranks stay in sync
    assert reports[0]["avg_train_loss"] == pytest.approx(reports[1]["avg_train_loss"])


def test_plain_training_datasets_are_sharded(reports):
    shards = [r["train_shard"] for r in reports]
    assert all(len(shard) == 5 for shard in shards)
    assert sorted(shards[0] + shards[1]) == list(range(10))


def test_sync_batchnorm_on_cpu_fails_with_the_fix(reports):
    assert all("trainer.sync_batchnorm=false" in r["sync_bn_error"] for r in reports)


def test_ddp_ranks_stop_together_when_one_is_signalled_in_validation(reports):
    """The trained epoch is saved at once, not after validation; the ranks (with 5 and 3
    validation batches) stop after the same round and resume exactly: epoch 1 validated
    from its start, epoch 2 trained (4 batches of 4 per epoch and rank)."""
    for report in reports:
        stopped = report["stopped_in_validation"]
        assert stopped["error"] and "epoch 1, batch 4" in stopped["error"], stopped
        assert stopped["seen"] == [[1, 1], [1, 2]], stopped  # stopped after round 2
        assert stopped["checkpoints"] == [[False, True]]  # one mid-epoch checkpoint
        assert stopped["resumed_steps"] == 8
    assert [v for v in reports[0]["stopped_in_validation"]["resumed_seen"] if v[0] == 1] == [
        [1, b] for b in range(1, 6)
    ]
    assert [v for v in reports[1]["stopped_in_validation"]["resumed_seen"] if v[0] == 1] == [
        [1, b] for b in range(1, 4)
    ]


def test_ddp_ranks_stop_together_after_a_shorter_shard_has_ended(reports):
    """Rank 1's 3 validation batches are done when rank 0 is signalled in its 4th: rank 1
    steps through empty rounds, asking with rank 0, and stops with it."""
    seen = [r["stopped_after_a_shard_ended"]["seen"] for r in reports]
    assert seen == [[[1, b] for b in range(1, 5)], [[1, b] for b in range(1, 4)]]
    for report in reports:
        stopped = report["stopped_after_a_shard_ended"]
        assert "epoch 1, batch 4" in stopped["error"] and stopped["resumed_steps"] == 8
        assert stopped["checkpoints"] == [[False, True]]


def test_ddp_ranks_stop_together_inside_an_accumulation_window_and_resume_exactly(reports):
    for report in reports:
        window = report["stopped_in_window"]
        assert window["error"] is not None and "epoch 1, batch 7." in window["error"]
        assert window["steps"] == window["resumed_steps"] == 4
        assert window["resumed"] == window["reference"]  # bit for bit
    # each rank saved its own partial sum of the window's 3 batches (they differ)
    first, second = reports[0]["stopped_in_window"]["saved_grads"]
    assert first is not None and second is not None and first != second
    assert (
        reports[0]["stopped_in_window"]["reference"] == reports[1]["stopped_in_window"]["reference"]
    )


def test_a_window_that_overflowed_on_one_rank_is_saved_as_non_finite_by_all(reports):
    assert [r["window_saved_as"] for r in reports] == [
        {"grads": None, "window_finite": False}
    ] * WORLD_SIZE


def test_metric_counts_are_summed_over_ranks(reports):
    assert all(r["accuracy"] == pytest.approx(50.0) for r in reports)


def test_single_process_is_not_distributed():
    assert init_distributed("auto", "cpu") == DistributedInfo()
    assert not DistributedInfo().enabled and DistributedInfo().is_main
    assert run_on_main(lambda: 7) == 7


def test_backend_choice_is_checked():
    assert resolve_backend("auto", "cuda") == "nccl"
    assert resolve_backend("auto", "cpu") == "gloo"
    with pytest.raises(DistributedConfigError, match="nccl needs device=cuda.*gloo"):
        resolve_backend("nccl", "cpu")
    with pytest.raises(DistributedConfigError, match="choose one of: auto, nccl, gloo"):
        resolve_backend("mpi", "cpu")


def test_each_rank_gets_its_own_gpu(monkeypatch):
    from amp_utils import distributed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert distributed._local_gpu(3) == 3
    with pytest.raises(DistributedConfigError, match="one process per GPU"):
        distributed._local_gpu(4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # SLURM bound one GPU
    assert distributed._local_gpu(2) == 0


def test_ending_the_group_frees_ddp_modules_left_in_reference_cycles(monkeypatch):
    """A DDP module in a reference cycle (the Brain after ``train()`` returns) holds the process
    group through its reducer. ``destroy_distributed`` (run at exit) must free it while the
    interpreter is alive, or gloo's group is torn down during interpreter finalization, where
    a rank can abort (SIGABRT, "terminate called without an active exception")."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    gc.disable()  # only destroy_distributed may collect the cycle
    try:
        assert init_distributed("gloo", "cpu").enabled
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        ddp(torch.randn(3, 2)).sum().backward()
        cycle = {"ddp": ddp}
        cycle["self"] = cycle
        freed = weakref.ref(ddp)
        del ddp, cycle
        assert freed() is not None  # only the cycle keeps it
        destroy_distributed()
        assert freed() is None
        assert not torch.distributed.is_initialized()
    finally:
        gc.enable()
        destroy_distributed()  # a no-op unless an assertion above failed first


def test_a_sum_over_ranks_comes_back_to_the_host_with_a_blocking_copy(monkeypatch):
    """With nccl a host tensor is summed on the GPU; a non-blocking copy back lands in
    pinned memory later, while callers read the sum at once (metric counts, validation
    rounds). Here the collective is a no-op and the copies are recorded."""
    from amp_utils import distributed

    copies = []
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copies.append((args, kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(distributed, "_multi_process", lambda: True)
    monkeypatch.setattr(distributed, "_comm_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda tensor, op=None: None)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    summed = distributed.all_reduce_sum(torch.tensor([1.0, 2.0]))
    assert summed.tolist() == [1.0, 2.0]
    back = copies[-1]
    assert back[0] == (torch.device("cpu"),) and back[1] is False
