"""HostReads: host reads of tensor values found on the CPU, each with the line that made it."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from amp_utils.host_reads import HostReads

x = torch.arange(6.0)


@pytest.mark.parametrize(
    ("read", "what"),
    [
        (lambda: x.sum().item(), "_local_scalar_dense"),
        (lambda: float(x[0]), "_local_scalar_dense"),
        (lambda: bool(x.sum() > 0), "_local_scalar_dense"),
        (lambda: range(int(x.max())), "_local_scalar_dense"),
        (lambda: torch.equal(x, x), "aten.equal"),
        (lambda: x.tolist(), "Tensor.tolist()"),
        (lambda: x.numpy(), "Tensor.numpy()"),
        (lambda: x[x > 2], "boolean-mask index"),
        (lambda: x.nonzero(), "aten.nonzero"),
        (lambda: x.unique(), "unique"),
        (lambda: torch.repeat_interleave(x, x.long()), "without output_size"),
        (
            lambda: F.ctc_loss(
                torch.randn(8, 2, 5).log_softmax(-1),
                torch.ones(2, 3, dtype=torch.long),
                torch.tensor([8, 7]),
                torch.tensor([3, 2]),
            ),
            "CTC loss",
        ),
    ],
)
def test_each_kind_of_host_read_is_found_with_its_line(read, what) -> None:
    with HostReads() as reads:
        read()
    assert reads.found, f"{what} was not seen"
    assert what in reads.found[0].what
    assert reads.found[0].where.endswith("in <lambda>")
    assert "test_host_reads.py:" in reads.found[0].where


def test_device_side_work_reads_nothing() -> None:
    """A forward and backward with masks, indexing, fixed-size repeats and a loss."""
    model = torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    wav, lens = torch.randn(3, 1, 8), torch.tensor([8, 6, 5])
    with HostReads() as reads:
        mask = torch.arange(8) < lens.unsqueeze(1)
        out = model(wav * mask.unsqueeze(1))
        picked = out[torch.tensor([0, 2])]  # an integer index: fixed size
        repeated = torch.repeat_interleave(lens, torch.tensor([1, 1, 1]), output_size=3)
        loss = picked.logsumexp(-1).mean() + torch.where(mask, 1.0, 0.0).sum() + repeated.sum()
        loss.backward()
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True).step()
    assert reads.found == [], reads.report()


def test_the_report_lists_each_place_once() -> None:
    with HostReads() as reads:
        for _ in range(3):
            x.sum().item()
    assert len(reads.found) == 3
    assert len(reads.report().splitlines()) == 1
    assert "test_host_reads.py" in reads.report()


def test_tolist_and_numpy_are_themselves_again_afterwards() -> None:
    before = (torch.Tensor.tolist, torch.Tensor.numpy)
    with pytest.raises(RuntimeError, match="boom"), HostReads():
        raise RuntimeError("boom")
    assert (torch.Tensor.tolist, torch.Tensor.numpy) == before
    with HostReads() as reads:
        pass
    x.tolist()
    assert reads.found == []


def test_other_threads_are_not_watched() -> None:
    """A DataLoader's pin-memory thread goes on meanwhile: its reads are not the step's."""
    with HostReads() as reads:
        thread = threading.Thread(target=lambda: (x.tolist(), x.sum().item()))
        thread.start()
        thread.join()
    assert reads.found == []


def counting_backend(calls: list[int]):
    """A torch.compile backend that runs the traced graph and counts each run."""

    def backend(graph_module, example_inputs):
        def run(*args):
            calls.append(1)
            return graph_module.forward(*args)

        return run

    return backend


class UserBlock(torch.nn.Module):
    """A user-defined block (TorchDynamo does not trace torch.nn containers compiled in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))


def test_compiled_code_checked_under_it_stays_compiled_afterwards() -> None:
    """Inside HostReads compiled code runs eagerly (its reads are still found); afterwards
    it runs compiled again. TorchDynamo skipped a frame met under the dispatch mode and
    never compiled it again: one checked warm-up step of ``graph_step`` left the compiled
    Conformer blocks eager in every captured step (2026-11-26 H200 profile)."""
    torch._dynamo.reset()
    calls: list[int] = []
    block = UserBlock()
    block.compile(backend=counting_backend(calls), dynamic=True)
    inp = torch.randn(3, 6)
    block(inp)
    assert len(calls) == 1  # compiled and run
    with HostReads() as reads:
        float(block(inp).detach().sum())
    assert len(calls) == 1, "compiled code ran under the dispatch mode"
    assert reads.found and "_local_scalar_dense" in reads.found[0].what
    block(inp)
    block(torch.randn(5, 6))  # a new shape: the dynamic graph serves it
    assert len(calls) == 3, "compiled code no longer runs after a HostReads check"
    torch._dynamo.reset()
