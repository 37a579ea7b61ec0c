"""A tiny next-token language model on generated text, with its own training loop (Adam, gradient
clipping, mixed precision where the device has it) and its own metric (perplexity).

Sentences come from a seeded Markov chain over a 64-token vocabulary; the model reads the last 8 tokens
(an embedding per position, concatenated) and predicts the next one. Run it:
fedshield simulate examples/scenarios/next-token.toml
"""

import math

import numpy as np
import torch
from torch import nn

from clients import Dataset, Task

VOCAB, CONTEXT, TOKENS = 64, 8, 40_000


def markov_text(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(1234)  # the language (its transitions) is fixed; the text drawn from it is seeded
    logits = rng.normal(0, 2.5, (VOCAB, VOCAB))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    cum = probs.cumsum(1)
    draws = np.random.default_rng(seed).random(n)
    out = np.empty(n, np.int64)
    out[0] = 0
    for i in range(1, n):  # (data generation, once per process)
        out[i] = min(int(np.searchsorted(cum[out[i - 1]], draws[i])), VOCAB - 1)
    return out


def windows(tokens: np.ndarray) -> Dataset:
    idx = np.arange(CONTEXT)[None, :] + np.arange(len(tokens) - CONTEXT)[:, None]
    return Dataset(tokens[idx], tokens[CONTEXT:])


class NextToken(Task):
    num_classes = VOCAB
    x_dtype = "int64"  # token ids stay integers
    input_shape = (CONTEXT,)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 128), nn.ReLU(),
                             nn.Linear(128, VOCAB))

    def load_data(self) -> tuple[Dataset, Dataset]:
        text = markov_text(TOKENS, self.spec.data_seed)
        cut = int(len(text) * 0.8)
        return windows(text[:cut]), windows(text[cut:])

    def evaluate(self, model, data, batch_size=1024):
        out = super().evaluate(model, data, batch_size)  # loss (mean cross-entropy) and accuracy
        return {**out, "perplexity": math.exp(min(out["loss"], 50.0))}

    def train(self, model, data, settings, generator):
        device = next(model.parameters()).device
        x, y = torch.from_numpy(data.x).to(device), torch.from_numpy(data.y).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=settings.lr)
        model.train()
        total, seen = 0.0, 0
        for _ in range(settings.local_epochs):
            for batch in torch.randperm(len(y), generator=generator).to(device).split(settings.batch_size):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = self.loss(model(x[batch]), y[batch])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                total, seen = total + loss.item() * len(batch), seen + len(batch)
        return {"train-loss": total / max(seen, 1)}
