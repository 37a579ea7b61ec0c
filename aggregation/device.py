"""The one place that chooses the aggregation / training device."""

from __future__ import annotations

import os
import re

import torch

from ._errors import AggregationError

ENV_VAR = "FEDSHIELD_DEVICE"


def get_device(preference: str | None = None, key: str = "device") -> torch.device:
    """Return the device fedshield computes on.

    Order: ``preference`` (from config) if given and not ``"auto"``, else the
    ``FEDSHIELD_DEVICE`` environment variable, else CUDA when present, else CPU.
    All other code follows the device of the tensors it is given.
    """
    given = preference not in (None, "", "auto")
    source = key if given else ENV_VAR  # what the error names: the config key (``key``), or the variable
    choice = preference if given else os.environ.get(ENV_VAR, "")
    choice = choice.strip().lower() or "auto"
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:\d+)?", choice):
        if not torch.cuda.is_available():
            raise AggregationError(f"{source} must name an available device. Found {choice!r}, but CUDA is not present "
                                   "(use 'cpu' or 'auto').")
        index, count = int(choice.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            raise AggregationError(f"{source} must name an available device. Found {choice!r}, but this machine has "
                                   f"{count} CUDA device(s) (cuda:0 to cuda:{count - 1}).")
        return torch.device(choice)
    raise AggregationError(f"{source} must be 'auto', 'cpu' or 'cuda[:N]'. Found {choice!r}.")


def moved(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``: without waiting onto a GPU (ordered on its current stream, so later
    work there sees it), waiting onto the host. ``non_blocking`` from a GPU to the host returns
    before the copy lands (into pinned memory), and host code reading it then reads garbage."""
    device = torch.device(device)
    return tensor.to(device, non_blocking=device.type != "cpu")


def memory_bytes(device: torch.device) -> int:
    """Total memory of ``device`` in bytes: the GPU's for CUDA, the machine's physical memory for CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no bound known here
        return 1 << 62

