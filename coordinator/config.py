"""The run configuration: one frozen dataclass built once from run_config / TOML."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from aggregation import available_server_optimizers
from clients.config import TaskSpec, TrainSettings, build_config, check, config_keys, split_mapping, to_mapping
from clients._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How the coordinator runs rounds (kebab-case keys in ``[run]`` / run_config)."""

    run_dir: str = ""
    num_rounds: int = 20
    fraction_train: float = 1.0
    min_nodes: int = 2
    wait_nodes_timeout: float = 120.0
    round_timeout: float = 300.0
    poll_interval: float = 0.1
    server_optimizer: str = "fedavg"
    server_lr: float = 1.0
    seed: int = 0
    max_examples: int = 10_000_000
    max_update_mb: float = 512.0
    max_update_norm: float = 1.0e4
    device: str = "auto"

    def __post_init__(self) -> None:
        check(1 <= self.num_rounds <= 1_000_000, "num-rounds", "be in [1, 1000000]", self.num_rounds)
        check(0 < self.fraction_train <= 1, "fraction-train", "be in (0, 1]", self.fraction_train)
        check(self.min_nodes >= 1, "min-nodes", "be >= 1", self.min_nodes)
        check(self.wait_nodes_timeout > 0, "wait-nodes-timeout", "be > 0 seconds", self.wait_nodes_timeout)
        check(self.round_timeout > 0, "round-timeout", "be > 0 seconds", self.round_timeout)
        check(0 < self.poll_interval <= 10, "poll-interval", "be in (0, 10] seconds", self.poll_interval)
        opts = available_server_optimizers()
        check(self.server_optimizer in opts, "server-optimizer", f"be one of {opts}", self.server_optimizer)
        check(self.server_lr > 0, "server-lr", "be > 0", self.server_lr)
        check(self.seed >= 0, "seed", "be >= 0", self.seed)
        check(self.max_examples >= 1, "max-examples", "be >= 1", self.max_examples)
        check(self.max_update_mb > 0, "max-update-mb", "be > 0", self.max_update_mb)
        check(self.max_update_norm > 0, "max-update-norm", "be > 0", self.max_update_norm)
        check(self.device in ("auto", "cpu") or self.device.startswith("cuda"), "device", "be auto, cpu or cuda[:N]", self.device)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs: server settings, the task, the clients' training."""

    server: ServerSettings = ServerSettings()
    task: TaskSpec = TaskSpec()
    train: TrainSettings = TrainSettings()

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], where: str = "run") -> "RunConfig":
        """Build from one flat kebab-case mapping; unknown keys are an error."""
        known = set(config_keys(ServerSettings)) | set(config_keys(TaskSpec)) | set(config_keys(TrainSettings))
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]} is not a known key. Known keys: {', '.join(sorted(known))}.")
        server, task, train = split_mapping(mapping, ServerSettings, TaskSpec, TrainSettings)
        return cls(
            server=build_config(ServerSettings, server, where),
            task=build_config(TaskSpec, task, where),
            train=build_config(TrainSettings, train, where),
        )

    def to_mapping(self) -> dict[str, Any]:
        return {**to_mapping(self.server), **to_mapping(self.task), **to_mapping(self.train)}

    def replace(self, **server_changes: Any) -> "RunConfig":
        return dataclasses.replace(self, server=dataclasses.replace(self.server, **server_changes))
