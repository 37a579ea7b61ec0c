"""get_device: the one place that picks the device (preference, then env var, then CUDA/CPU)."""

from __future__ import annotations

import pytest
import torch

from aggregation import AggregationError, get_device
from aggregation.device import ENV_VAR


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_env_var_name():
    assert ENV_VAR == "FEDSHIELD_DEVICE"


@pytest.mark.parametrize("pref", ["cpu", "CPU", " cpu "])
def test_cpu(no_cuda, pref):
    assert get_device(pref) == torch.device("cpu")


@pytest.mark.parametrize("pref", [None, "", "auto"])
def test_auto_without_cuda_is_cpu(no_cuda, pref):
    assert get_device(pref) == torch.device("cpu")


@pytest.mark.parametrize("pref", [None, "auto"])
def test_auto_with_cuda_is_cuda(fake_cuda, pref):
    assert get_device(pref).type == "cuda"


def test_env_var_is_used_when_no_preference(fake_cuda, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cpu")
    assert get_device() == torch.device("cpu")
    assert get_device("auto") == torch.device("cpu")
    monkeypatch.setenv(ENV_VAR, "cuda:1")
    assert get_device() == torch.device("cuda:1")


def test_preference_wins_over_env_var(no_cuda, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "tpu")
    assert get_device("cpu") == torch.device("cpu")
    with pytest.raises(AggregationError, match="'tpu'"):
        get_device()


@pytest.mark.parametrize("pref", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_when_unavailable_raises(no_cuda, pref):
    with pytest.raises(AggregationError, match="CUDA is not present"):
        get_device(pref)


def test_cuda_from_env_when_unavailable_raises(no_cuda, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(AggregationError, match="FEDSHIELD_DEVICE must name an available device. Found 'cuda', but CUDA is not present"):
        get_device()
    with pytest.raises(AggregationError, match="^device must name an available device"):
        get_device("cuda")  # the config key's value: named as the key


def test_a_cuda_index_past_the_devices_is_refused(fake_cuda):
    assert get_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(AggregationError, match=r"Found 'cuda:2', but this machine has 2 CUDA device\(s\) \(cuda:0 to cuda:1\)"):
        get_device("cuda:2")


def test_cuda_index_when_available(fake_cuda):
    assert get_device("cuda:0") == torch.device("cuda:0")
    assert get_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize("pref", ["tpu", "gpu", "mps", "0", "cpu:0:1"])
def test_garbage_raises(no_cuda, pref):
    with pytest.raises(AggregationError, match=r"^device must be 'auto', 'cpu' or 'cuda\[:N\]'\. Found"):
        get_device(pref)


@pytest.mark.parametrize("pref", ["cuda:abc", "cudax"])
def test_malformed_cuda_string_raises_aggregation_error(fake_cuda, pref):
    with pytest.raises(AggregationError):
        get_device(pref)
