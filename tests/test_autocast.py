"""AMPConfig, TorchAutocast and fwd_default_precision: SpeechBrain's API and behaviour."""

import pytest
import torch

from amp_utils import AMPConfig, TorchAutocast, fwd_default_precision


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        (None, torch.float32),
        ("fp32", torch.float32),
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
    ],
)
def test_ampconfig_from_name(name, dtype):
    assert AMPConfig.from_name(name).dtype == dtype


@pytest.mark.parametrize("bad", ["fp8", "float16", "BF16", ""])
def test_ampconfig_rejects_unknown_names_listing_valid_ones(bad):
    with pytest.raises(ValueError) as err:
        AMPConfig.from_name(bad)
    for valid in ("fp32", "fp16", "bf16"):
        assert valid in str(err.value)


def test_torch_autocast_is_noop_for_fp32():
    layer = torch.nn.Linear(4, 4)
    with TorchAutocast(device_type="cpu", dtype=torch.float32) as ctx:
        assert not torch.is_autocast_enabled("cpu")
        assert layer(torch.randn(2, 4)).dtype == torch.float32
    assert ctx is None
    with TorchAutocast(device_type="cpu"):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_autocast_lowers_matmul_precision_on_cpu(dtype):
    layer = torch.nn.Linear(4, 4)
    with TorchAutocast(device_type="cpu", dtype=dtype):
        assert torch.is_autocast_enabled("cpu")
        assert layer(torch.randn(2, 4)).dtype == dtype
    assert not torch.is_autocast_enabled("cpu")


def test_torch_autocast_reraises_with_dtype_and_device(monkeypatch):
    ctx = TorchAutocast(device_type="cpu", dtype=torch.bfloat16)

    def broken_enter():
        raise RuntimeError("unsupported")

    monkeypatch.setattr(ctx.context, "__enter__", broken_enter)
    with pytest.raises(RuntimeError, match="dtype=torch.bfloat16.*device=cpu") as err:
        ctx.__enter__()
    assert isinstance(err.value.__cause__, RuntimeError)


class _Doubler(torch.nn.Module):
    @fwd_default_precision
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Doc kept."""
        return x @ x.transpose(-1, -2)


class _Float64(torch.nn.Module):
    @fwd_default_precision(cast_inputs=torch.float64)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fwd_default_precision_runs_fp32_under_cpu_autocast(dtype):
    x = torch.randn(3, 3, dtype=dtype)
    with torch.autocast("cpu", dtype=dtype):
        assert _Doubler()(x).dtype == torch.float32
        assert _Doubler()(x, force_allow_autocast=True).dtype == dtype


def test_fwd_default_precision_custom_cast_and_metadata():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _Float64()(torch.randn(2)).dtype == torch.float64
    assert _Doubler.forward.__name__ == "forward"
    assert _Doubler.forward.__doc__ == "Doc kept."


def test_fwd_default_precision_changes_nothing_outside_autocast():
    x = torch.randn(3, 3, dtype=torch.bfloat16)
    assert _Doubler()(x).dtype == torch.bfloat16
    assert _Float64()(torch.randn(2)).dtype == torch.float32


@fwd_default_precision
def _computing_dtype(*args, **kwargs) -> tuple:
    """A free function (no ``self`` first): the dtypes it computes on, and autocast's state."""
    tensors = [*args, *kwargs.values()]
    return (
        [t.dtype for t in tensors if isinstance(t, torch.Tensor)],
        torch.is_autocast_enabled("cpu"),
    )


def test_fwd_default_precision_takes_keyword_arguments_and_numbers_first():
    """torch's custom_fwd marks its first argument: a call with keyword arguments only
    failed (IndexError) even outside autocast, and a number first failed under it."""
    x, n = torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.int64)
    assert _computing_dtype(logits=x, lengths=n) == ([torch.bfloat16, torch.int64], False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _computing_dtype(logits=x, lengths=n) == ([torch.float32, torch.int64], False)
        assert _computing_dtype(3, x) == ([torch.float32], False)
        assert _computing_dtype(x, n) == ([torch.float32, torch.int64], False)


@pytest.mark.parametrize("autocast", [False, True])
def test_fwd_default_precision_compiles_without_a_graph_break(autocast):
    """torch.compile traces decorated forwards in one graph (``fullgraph``), inside and
    outside autocast: a module pinned to fp32 inside a compiled Conformer block, the
    x-vector's pooling and the fp32 emulation of CUDA's LayerNorms graph-broke at
    ``torch.amp.is_autocast_available``, which TorchDynamo cannot trace (torch 2.11)."""
    from amp_utils.module_precision import run_in_fp32

    torch._dynamo.reset()
    pinned = torch.nn.Linear(3, 3)
    run_in_fp32(pinned)

    def step(x: torch.Tensor) -> tuple:
        free = _computing_dtype(x)[0]  # a free function: cast and autocast off by hand
        return _Doubler()(x), pinned(x), _Float64()(x), torch.zeros(len(free))

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    x = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected, got = step(x), compiled(x)
    for want, out in zip(expected, got, strict=True):
        assert out.dtype == want.dtype
        torch.testing.assert_close(out, want)
    assert got[0].dtype == got[1].dtype == torch.float32  # fp32 even under autocast


@pytest.mark.gpu
def test_fwd_default_precision_on_cuda(cuda_device):
    x = torch.randn(3, 3, device=cuda_device)
    with torch.autocast("cuda", dtype=torch.float16):
        assert _Doubler()(x).dtype == torch.float32
        assert _Doubler()(x, force_allow_autocast=True).dtype == torch.float16


def test_no_deprecated_amp_spellings_in_code():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    needle = "torch.cuda" + ".amp"
    offenders = [
        str(p)
        for folder in ("amp_utils", "recipes", "data")
        for p in (root / folder).rglob("*.py")
        if needle in p.read_text()
    ]
    assert offenders == []


def test_torch_autocast_dtype_none_is_the_device_default_as_in_speechbrain():
    """``dtype=None`` means torch.autocast's default dtype for the device, as SpeechBrain's
    TorchAutocast passes it on; it was taken for float32 and autocast stayed off."""
    with TorchAutocast(device_type="cpu", dtype=None):
        assert torch.is_autocast_enabled("cpu")
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.get_autocast_dtype("cpu")
    assert not torch.is_autocast_enabled("cpu")
