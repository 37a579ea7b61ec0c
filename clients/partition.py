"""Seeded splits of a labelled data set across clients (IID or Dirichlet over labels)."""

from __future__ import annotations

import numpy as np

from ._errors import ConfigError


def iid_partition(num_samples: int, num_parts: int, seed: int) -> list[np.ndarray]:
    """Shuffle and deal indices into ``num_parts`` near-equal parts."""
    _check_parts(num_samples, num_parts)
    perm = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(p) for p in np.array_split(perm, num_parts)]


def dirichlet_partition(
    labels: np.ndarray, num_parts: int, alpha: float, seed: int, min_size: int = 2, max_tries: int = 1000
) -> list[np.ndarray]:
    """Label-skewed split: each class is spread over parts by a Dirichlet(alpha) draw.

    Small ``alpha`` gives strong skew. Draws again (same generator, so still
    deterministic) until every part holds at least ``min_size`` samples.
    """
    labels = np.asarray(labels)
    if not alpha > 0:
        raise ConfigError(f"dirichlet-alpha must be > 0. Found {alpha!r}.")
    if not 1 <= num_parts or num_parts * min_size > len(labels):  # (one bound, the tighter: not two in turn)
        raise ConfigError(f"num-partitions must be in [1, {len(labels) // min_size}] so that every part of the "
                          f"{len(labels)} samples holds >= {min_size}. Found {num_parts}.")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    owner = np.empty(len(labels), dtype=np.int64)
    parts_ids = np.arange(num_parts)
    for _ in range(max_tries):
        props = rng.dirichlet(np.full(num_parts, alpha), size=len(classes))
        for idx, p in zip(by_class, props, strict=True):  # one vectorized step per class
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            owner[idx] = np.repeat(parts_ids, np.diff(cuts, prepend=0, append=len(idx)))
        sizes = np.bincount(owner, minlength=num_parts)
        if sizes.min() >= min_size:  # each part's indices in increasing order, as np.sort would give
            return np.split(np.argsort(owner, kind="stable"), np.cumsum(sizes)[:-1])
    raise ConfigError(
        f"dirichlet-alpha={alpha} with {num_parts} parts must leave every part >= {min_size} samples. "
        f"Found none in {max_tries} draws; raise alpha or lower the number of clients."
    )


def _check_parts(num_samples: int, num_parts: int) -> None:
    if not 1 <= num_parts <= num_samples:
        raise ConfigError(f"num-partitions must be in [1, {num_samples}]. Found {num_parts}.")
