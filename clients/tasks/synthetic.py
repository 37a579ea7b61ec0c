"""FedProx's Synthetic(alpha, beta) (Li et al., 2020), multinomial logistic regression.

Data comes from ``NUM_SOURCES`` sources; source k draws u_k ~ N(0, alpha),
W_k, b_k ~ N(u_k, 1), B_k ~ N(0, beta), v_k ~ N(B_k, 1), x ~ N(v_k, diag(j^-1.2)),
and y = argmax(W_k x + b_k). The pooled set is then split like any other.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from .base import Dataset, Task
from .digits import stratified_split

DIM, CLASSES, NUM_SOURCES, PER_SOURCE = 60, 10, 30, 200


def synthetic(alpha: float, beta: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    cov = np.arange(1, DIM + 1, dtype=np.float64) ** -1.2
    u = rng.normal(0, np.sqrt(alpha), NUM_SOURCES)
    big_b = rng.normal(0, np.sqrt(beta), NUM_SOURCES)
    w = rng.normal(u[:, None, None], 1.0, (NUM_SOURCES, CLASSES, DIM))
    b = rng.normal(u[:, None], 1.0, (NUM_SOURCES, CLASSES))
    v = rng.normal(big_b[:, None], 1.0, (NUM_SOURCES, DIM))
    x = v[:, None, :] + rng.normal(0, 1, (NUM_SOURCES, PER_SOURCE, DIM)) * np.sqrt(cov)
    logits = np.einsum("skd,snd->snk", w, x) + b[:, None, :]
    return x.reshape(-1, DIM).astype(np.float32), logits.argmax(-1).reshape(-1).astype(np.int64)


class SyntheticTask(Task):
    name = "synthetic"
    input_dim = DIM
    input_shape = (DIM,)
    target_shape = ()
    num_classes = CLASSES

    def load_data(self) -> tuple[Dataset, Dataset]:
        x, y = synthetic(self.spec.synthetic_alpha, self.spec.synthetic_beta, self.spec.data_seed)
        # stratify needs >= 2 samples per class: fall back to the label-agnostic split if not.
        counts = np.bincount(y, minlength=CLASSES)
        if (counts[counts > 0] < 2).any():
            rng = np.random.default_rng(self.spec.data_seed)
            perm = rng.permutation(len(y))
            cut = int(len(y) * 0.8)
            return Dataset(x[perm[:cut]], y[perm[:cut]]), Dataset(x[perm[cut:]], y[perm[cut:]])
        return stratified_split(x, y, self.spec.data_seed)

    def build_model(self) -> nn.Module:
        return nn.Linear(DIM, CLASSES)
