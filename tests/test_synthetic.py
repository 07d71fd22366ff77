"""The synthetic stress input of paper Sec. 6.2 (foscar.synthetic.stress_inputs)."""
import math

import pytest
import torch

import foscar
from foscar.synthetic import stress_inputs


def logits(q, k):
    """q . k / sqrt(D) of every (batch, query head, token), GQA h -> h // (Hq / Hkv), in float64."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.double().reshape(B, Hkv, Hq // Hkv, D)
    return torch.einsum("bhgd,bhnd->bhgn", qg, k.double()) / math.sqrt(D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_shapes_dtype_device(dtype):
    q, k, v = stress_inputs(2, 8, 2, 48, 64, dtype=dtype)
    assert q.shape == (2, 8, 64)
    assert k.shape == v.shape == (2, 2, 48, 64)
    for t in (q, k, v):
        assert t.dtype == dtype and t.device.type == "cpu"
        assert torch.isfinite(t.double()).all()


def test_deterministic_by_seed():
    a = stress_inputs(1, 4, 2, 64, 64, seed=7)
    b = stress_inputs(1, 4, 2, 64, 64, seed=7)
    c = stress_inputs(1, 4, 2, 64, 64, seed=8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not any(torch.equal(x, z) for x, z in zip(a, c))


def test_leaves_global_rng_alone():
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    stress_inputs(1, 2, 1, 16, 64)
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("B,Hq,Hkv,L,D,dtype", [
    (1, 32, 8, 512, 128, torch.float32),
    (2, 4, 4, 100, 64, torch.float32),
    (3, 6, 1, 33, 256, torch.float64),
    (1, 2, 1, 2, 64, torch.float64),
])
def test_logits_have_unit_std(B, Hq, Hkv, L, D, dtype):
    q, k, _ = stress_inputs(B, Hq, Hkv, L, D, seed=3, dtype=dtype)
    std = logits(q, k).std(correction=0).item()
    assert std == pytest.approx(1.0, rel=1e-6)


def test_amplified_channels_stand_out():
    amp = 10.0
    q, k, v = stress_inputs(2, 8, 4, 256, 128, amplified_channels=8, amplification=amp, ramp=(1.0, 1.0),
                            dtype=torch.float64)
    rms = k.pow(2).mean(dim=(0, 1, 2)).sqrt()  # per channel
    top = rms.topk(8).indices
    rest = torch.ones(128, dtype=torch.bool)
    rest[top] = False
    ratio = rms[top] / rms[rest].median()
    assert ratio.min() > 0.8 * amp and ratio.max() < 1.2 * amp
    assert rms[rest].max() < 1.3 * rms[rest].median()  # nothing else stands out
    vrms = v.pow(2).mean(dim=(0, 1, 2)).sqrt()  # V is left alone
    assert vrms.max() < 1.3 and vrms.min() > 0.7


def test_no_amplified_channels():
    _, k, _ = stress_inputs(2, 8, 4, 256, 128, amplified_channels=0, ramp=(1.0, 1.0))
    rms = k.double().pow(2).mean(dim=(0, 1, 2)).sqrt()
    assert rms.max() < 1.3 * rms.median()


def test_token_scale_ramps():
    _, k, _ = stress_inputs(2, 8, 8, 400, 128, ramp=(0.5, 2.0))
    rms = k.double().pow(2).mean(dim=(0, 1, 3)).sqrt()  # per token
    first, last = rms[:40].mean(), rms[-40:].mean()
    ramp = torch.linspace(0.5, 2.0, 400, dtype=torch.float64)
    want = ramp[-40:].mean() / ramp[:40].mean()  # the token scale's ramp, last tenth over first tenth
    assert (last / first).item() == pytest.approx(want.item(), rel=0.05)


@pytest.mark.parametrize("kwargs,name", [
    (dict(batch=0), "batch"),
    (dict(batch=1.0), "batch"),
    (dict(num_qo_heads=6, num_kv_heads=4), "num_qo_heads"),
    (dict(num_qo_heads=0), "num_qo_heads"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(seq_len=1), "seq_len"),
    (dict(head_dim=0), "head_dim"),
    (dict(seed=1.5), "seed"),
    (dict(amplified_channels=-1), "amplified_channels"),
    (dict(amplified_channels=65), "amplified_channels"),
    (dict(amplification=0.0), "amplification"),
    (dict(amplification=float("nan")), "amplification"),
    (dict(ramp=(1.0,)), "ramp"),
    (dict(ramp=(0.0, 1.0)), "ramp"),
    (dict(ramp=(1.0, float("inf"))), "ramp"),
    (dict(dtype=torch.int32), "dtype"),
    (dict(device="no-such-device"), "device"),
])
def test_bad_arguments(kwargs, name):
    args = dict(batch=1, num_qo_heads=4, num_kv_heads=2, seq_len=16, head_dim=64)
    args.update(kwargs)
    pos = [args.pop(n) for n in ("batch", "num_qo_heads", "num_kv_heads", "seq_len", "head_dim")]
    with pytest.raises(foscar.InvalidArgumentError, match=name) as info:
        stress_inputs(*pos, **args)
    assert info.value.argument == name
