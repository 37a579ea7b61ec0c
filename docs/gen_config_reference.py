"""Generate docs/configuration.md from the configuration dataclasses.

    python docs/gen_config_reference.py           # rewrite docs/configuration.md
    python docs/gen_config_reference.py --check   # exit 1 if it is out of date (tests/test_docs.py does this)

Each key's type and default come from its dataclass field; its rule ("must ...") is read from the
``check(...)`` calls in the dataclass's ``__post_init__`` where the rule is a literal (or an f-string of
module constants); its one-line description comes from DESCRIPTIONS below. A key without a description
is an error: add one here when you add a key.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "configuration.md"
COMMAND = "python docs/gen_config_reference.py"

# One line per key: what it does (the rule, type and default are taken from the code).
DESCRIPTIONS: dict[str, dict[str, str]] = {
    "run": {
        # ServerSettings
        "run-dir": "results directory; `--run-dir` overrides it. Unset: `runs/NAME-TIMESTAMP` under the working directory "
                   "(simulate), `runs/coordinator` next to the coordinator config. An existing one resumes",
        "num-rounds": "synchronous rounds (FedBuff: buffer releases)",
        "fraction-train": "fraction of the online nodes sampled per round (at least `min-nodes`); the sampling rate q "
                          "under central DP",
        "min-nodes": "nodes that must be online before a round starts, and the fewest a round samples",
        "wait-nodes-timeout": "seconds to wait for `min-nodes` nodes before the run fails",
        "round-timeout": "a round closes when all replies are in or at this deadline (seconds, counted from before "
                         "the push to a SuperLink and on Flower's engine; on the in-process and virtual engines, from after the push "
                         "that trained); FedBuff: a "
                         "message's time to live",
        "close-after-replies": "over-selection: close a round once this many updates are in (0: wait for all or the "
                               "deadline); refused under central DP and SecAgg+",
        "late-replies": "`drop` late replies, or `carry` them into a later round weighted by `staleness` (not under "
                        "central/distributed DP or SecAgg+)",
        "work-deadline": "seconds of local work a round should take: a node measured as too slow gets fewer local epochs "
                         "(at least 1); 0: off",
        "poll-interval": "seconds between checks for new replies (simulated seconds on the virtual engine)",
        "server-optimizer": "`fedavg`, `fedavgm`, `fedadam`, `fedyogi`, `fedadagrad` (Reddi et al. 2021): "
                            "`w <- w + lr * step(mean delta)`",
        "server-lr": "server learning rate; 0 means 1.0 under fedavg/fedavgm and must be given for the adaptive ones",
        "server-momentum": "FedAvgM's momentum, in [0, 1) (checked by the optimizer)",
        "server-beta1": "FedAdam/FedYogi/FedAdagrad first-moment decay, in [0, 1) (Flower's FedAdagrad has none: set 0 for it)",
        "server-beta2": "FedAdam/FedYogi second-moment decay, in [0, 1) (FedAdagrad sums its squares: unused)",
        "server-tau": "adaptive optimizers' epsilon (at least 1e-18)",
        "seed": "seed for sampling and initial weights (clients receive it: never used for DP noise)",
        "max-examples": "largest example count a reply may claim (its weight)",
        "max-update-mb": "largest update a reply may carry, MB",
        "max-update-norm": "largest L2 norm an update may have; a larger one is rejected",
        "device": "aggregation device; under `auto`, `FEDSHIELD_DEVICE=cpu|cuda` or else CUDA when present (clients follow `FEDSHIELD_DEVICE` or CUDA, never this key)",
        "selection": "`uniform` seeded sampling, or `fast-fair`: prefer fast nodes while each keeps between "
                     "1/`fairness` and `fairness` times its fair share",
        "fairness": "the bound `fast-fair` keeps every node's participation within",
        "clients-per-round": "nodes asked each round (at least `min-nodes`); 0: `fraction-train` of those online "
                             "decides. Refused under central DP and FedBuff",
        "central-eval-every": "every N rounds (and after the last) the coordinator evaluates the global model on the "
                              "task's test set; other rounds' rows hold nan (0: after the last round only)",
        "federated-eval-every": "every N rounds (and after the last) the round's clients evaluate the global model "
                                "on their held-out data; 0: off. Refused under local and distributed DP",
        # TaskSpec
        "task": "`digits`, `synthetic`, `package.module:Class` or `path/to/file.py:Class` (relative to the "
                "scenario or config file); see [tasks.md](tasks.md)",
        "partitioning": "how the task's training data is split across clients (`dirichlet`: label skew; the "
                        "choices are in the rule column)",
        "client-examples": "`partitioning = \"sample\"`: examples each client draws, with replacement (a population "
                           "larger than the data)",
        "dirichlet-alpha": "Dirichlet concentration of the label skew: smaller, more skew",
        "data-seed": "seed of the client split and of the held-out test split",
        "synthetic-alpha": "`synthetic` task: how much the sources' models differ (Li et al. 2020)",
        "synthetic-beta": "`synthetic` task: how much the sources' inputs differ",
        "hidden-units": "`digits` task: the MLP's hidden width (64-h-10)",
        # TrainSettings
        "local-epochs": "local epochs per round",
        "batch-size": "local mini-batch size",
        "lr": "local SGD learning rate",
        "momentum": "local SGD momentum",
        "proximal-mu": "FedProx: the local objective adds mu/2 ||w - w_global||^2 (0: FedAvg)",
        # AggregationSettings
        "codec": "how clients send updates: `dense`, `topk`, `qsgd`, `sign`",
        "codec-dtype": "`dense`: float32, float16 or bfloat16",
        "topk-ratio": "`topk`: fraction of coordinates sent",
        "topk-value-dtype": "`topk`: dtype of the values sent",
        "qsgd-bits": "`qsgd`: bits per coordinate (2, 4 or 8)",
        "qsgd-chunk": "`qsgd`: coordinates sharing one scale",
        "error-feedback": "`topk` and `sign`: keep what was not sent and add it next round",
        "aggregator": "`mean`, `norm-bounded-mean`, `median`, `trimmed-mean`, `krum`, `multi-krum`",
        "clip-norm": "`norm-bounded-mean`: updates are scaled down to this L2 norm",
        "trim-beta": "`trimmed-mean`: fraction trimmed at each end",
        "krum-f": "`krum`/`multi-krum`: Byzantine clients tolerated (needs 2f + 3 updates)",
        "krum-m": "`multi-krum`: updates averaged (needs m + f updates too)",
        "slow-link-mbps": "a node reporting an uplink below this gets `slow-link-codec` (0: off; sync rounds only)",
        "slow-link-codec": "the codec slow links are asked for",
        # PrivacySettings
        "dp": "`none`, `central`, `local` (DP-SGD with Opacus on clients), `distributed` (Skellam noise under "
              "SecAgg+); see [privacy.md](privacy.md)",
        "dp-clip": "central/distributed DP: L2 clip of each update",
        "dp-noise-multiplier": "central/distributed DP: noise std / `dp-clip`; 0: calibrate from `target-epsilon`",
        "target-epsilon": "budget: a round that would pass it is not started; 0: none",
        "dp-delta": "delta of the (epsilon, delta) guarantee",
        "accountant": "`pld` (privacy loss distributions, tightest) or `rdp`; used for calibration, the budget and "
                      "reports (distributed DP always uses `rdp`, its proven bound)",
        "dp-secure-noise": "central DP: draw the noise from the OS CSPRNG",
        "adaptive-clipping": "central DP: move the clip toward a quantile of the update norms (Andrew et al. 2021)",
        "clip-target-quantile": "adaptive clipping: the target quantile",
        "clip-learning-rate": "adaptive clipping: the clip's geometric step",
        "clip-count-noise": "adaptive clipping: noise std of the clipped count (0: auto, ~1.58 z)",
        "dp-expected-clients": "central DP: the public count the noised sum is divided by (0: fraction-train x the "
                               "clients of the run; must be set with `--insecure`)",
        "local-noise-multiplier": "local DP: DP-SGD's noise multiplier",
        "local-max-grad-norm": "local DP: DP-SGD's per-example clip",
        # AsyncSettings
        "workflow": "`sync` rounds, or `fedbuff` (buffered asynchronous aggregation)",
        "concurrency": "FedBuff: clients kept training at once",
        "buffer-size": "FedBuff: replies per release",
        "max-staleness": "FedBuff and carried replies: oldest accepted update, in versions",
        "staleness": "staleness weight: `constant` or `polynomial` ((1+s)^-a)",
        "staleness-a": "the polynomial's exponent a",
        # SecureAggSettings
        "secure-aggregation": "`none` or `secagg+` (the coordinator learns only the sum); see "
                              "[secure-aggregation.md](secure-aggregation.md)",
        "secagg-degree": "neighbours per node k (0: chosen from `secagg-dropout-rate`; >= n-1: complete graph)",
        "secagg-threshold": "shares needed to rebuild a secret t (0: k/2 + 1)",
        "secagg-dropout-rate": "dropout the graph is sized for; under distributed DP, the survivors the noise is sized for",
        "secagg-bits": "ring Z_2^b for masked values: 32, 16 or 8",
        "secagg-clip": "every coordinate is clipped to +-clip before quantizing (counted, never silent)",
        "secagg-weighting": "`num-examples` (capped at `secagg-max-weight`) or `uniform`",
        "secagg-max-weight": "cap on a client's example-count weight under SecAgg+",
        "secagg-sparse-ratio": "< 1: a shared random subset of coordinates each round, with error feedback",
        "secagg-stage-timeout": "seconds each protocol stage waits for its replies",
        "secagg-pipeline": "set round r+1 up during round r: two round trips a round instead of four",
    },
    "simulation": {
        "name": "run name (the run directory's prefix)",
        "engine": "`flower` (Flower's simulation engine on Ray), `inprocess` (no Ray), `virtual` (simulated clock "
                  "from device tiers)",
        "num-supernodes": "simulated clients",
        "client-cpus": "Flower engine: CPUs per client actor (Flower starts `ray-num-cpus` / `client-cpus` actors; on a Ray instance "
                       "of the run's own, checked at start: >= 0.25 and <= the CPUs Ray gets)",
        "client-gpus": "Flower engine: GPUs per client actor (0 on a machine without CUDA, checked at start)",
        "ray-num-cpus": "Flower engine: CPUs of the Ray instance it starts (0: all; at most the machine's, checked at start)",
        "ray-address": "Flower engine: join this Ray cluster (`auto`, `HOST:6379`, `ray://HOST:10001`) instead of "
                       "starting one",
        "batched": "in-process engine: train a round's clients together where the task allows (else one by one, "
                   "said once in the log)",
        "batched-shards": "in-process engine, batched: 0 trains in this process; N > 0 shards each round's batched "
                          "training over N Ray actors (one CPU each) on a Ray instance the run starts (`ray-num-cpus`) "
                          "or the cluster at `ray-address`; the same results (needs `fedshield[simulation]`)",
        "sites": "in-process engine: edge aggregators between the coordinator and the clients, each holding a "
                 "consecutive block of them and running its own round with the `[site]` table's settings (0: none)",
    },
    "coordinator": {
        "host": "address the SuperLink listens on (and the server certificate must name)",
        "port": "the SuperLink's port (Fleet, Control and Runtime APIs share it)",
        "certs-dir": "`ca.crt`, `server.crt`, `server.key` from `fedshield certs init` (keep `ca.key` elsewhere)",
        "enrolled-keys": "client public keys (`.pub` from `fedshield keys new`) admitted to the run",
        "state-dir": "the SuperLink's log (`superlink.log`), its Flower home and the app directory (its state is in "
                     "memory: a restarted coordinator starts a fresh SuperLink and resumes the run from `run-dir`)",
        "start-timeout": "seconds to wait for the started SuperLink to answer",
        "status-port": "the run's status page (and `status.json`) on 127.0.0.1: 0 a free port, printed at start; -1 none",
    },
    "upstream": {
        "coordinator": "HOST:PORT of the coordinator above (`fedshield aggregator start`)",
        "root-cert": "the coordinator above's CA certificate (its `ca.crt`)",
        "key": "this aggregator's node private key (`fedshield keys new`); its `.pub` enrolled at the coordinator above",
        "poll-interval": "seconds between the upward node's requests for work; after 10 s without work it backs off to one every max(3 s, this)",
    },
    "tiers": {
        "name": "tier name",
        "fraction": "share of the simulated nodes in this tier (normalised to sum to 1)",
        "compute-s-per-example": "seconds per training example per local epoch",
        "uplink-mbps": "uplink, Mbit/s",
        "downlink-mbps": "downlink, Mbit/s",
        "latency-s": "one-way latency added to each transfer, seconds",
        "sigma": "compute time is multiplied by LogNormal(0, sigma)",
        "availability": "probability a node is online in a time window",
        "dropout": "probability a reply never arrives",
    },
}

CROSS_KEY_RULES = """\
Rules that tie several keys together (checked once, when the config is read; the error names the key):

- A setting the chosen mode would ignore is refused when it differs from its default: `dp-clip` and
  `dp-noise-multiplier` outside central/distributed DP, `dp-secure-noise` and `dp-expected-clients` outside
  central DP, `dp-delta` and `accountant` under `dp = "none"`, a `local-*` key without `dp = "local"`, `clip-target-quantile`,
  `clip-learning-rate`, `clip-count-noise` without `adaptive-clipping`, `target-epsilon` outside
  central/distributed DP. Settings of other codecs, rules or `secagg-*` without SecAgg+ are range-checked
  and unused, so a scenario can carry the alternatives a `--set` switches to.
- `workflow = "fedbuff"`: `fraction-train = 1.0`, `close-after-replies = 0`, `late-replies = "drop"`,
  `work-deadline = 0`, `selection = "uniform"`, `slow-link-mbps = 0`, `federated-eval-every = 0`; under a rule
  other than `mean` a release takes one update per node, so `buffer-size` <= the nodes.
- `dp = "central"`: `workflow = "sync"`, `selection = "uniform"`, `close-after-replies = 0`,
  `aggregator = "mean"`, no SecAgg+; `dp-noise-multiplier > 0` or `target-epsilon > 0`; a given multiplier must
  let round 1 fit in `target-epsilon`; a target is calibrated now, so an unreachable one fails before the run.
- `dp = "distributed"`: `secure-aggregation = "secagg+"`, `secagg-weighting = "uniform"`, no adaptive clipping,
  `secagg-clip >= dp-clip (1 + 8 z / s)` with s the fewest survivors of a `min-nodes` round.
- `secure-aggregation = "secagg+"`: `aggregator = "mean"`, `codec = "dense"`, `workflow = "sync"`,
  `slow-link-mbps = 0`, `selection = "uniform"`, `work-deadline = 0`, `close-after-replies = 0`,
  `min-nodes >= 3`, and a round of `min-nodes` nodes must satisfy k/2 < t <= k.
- `federated-eval-every > 0`: `workflow = "sync"`, `dp` not `local` or `distributed`.
- `late-replies = "carry"`: no central/distributed DP, no SecAgg+.
- `proximal-mu = 0` under `dp = "local"` (DP-SGD's loop has no proximal term).
- Krum / Multi-Krum / trimmed mean: `min-nodes` (FedBuff: `buffer-size`) and a non-zero `close-after-replies`
  must give the rule the updates it needs (Krum 2f + 3, Multi-Krum also m + f, trimmed mean the fewest n with
  floor(`trim-beta` n) >= 1).
- Scenario: `min-nodes <= num-supernodes`; `[[tiers]]` only with `engine = "virtual"`; `ray-address` only with
  `engine = "flower"` or `batched-shards > 0`; `batched-shards > 0` only with `engine = "inprocess"`, `batched = true`
  and no `sites`. Coordinator: `min-nodes` (and FedBuff's `buffer-size` under a robust rule) <= the enrolled
  keys; at least one enrolled key unless `--insecure`; under central DP with `--insecure`, `dp-expected-clients`
  must be set.
"""


def _toml(value: typing.Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _type(hint: typing.Any) -> str:
    if hint in (int, float, str, bool):
        return {int: "integer", float: "number", str: "string", bool: "boolean"}[hint]
    if typing.get_origin(hint) is tuple:
        return "list of strings"
    return str(hint)


def _rules(cls: type) -> dict[str, list[str]]:
    """key -> the rules ``check(ok, "key", rule, found)`` in ``cls.__post_init__`` states, where the rule is a
    literal or an f-string of the module's constants (others are left to DESCRIPTIONS)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    module = sys.modules[cls.__module__].__dict__
    out: dict[str, list[str]] = {}
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__"):
            continue
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "check"
                    and len(call.args) >= 3 and isinstance(call.args[1], ast.Constant)):
                continue
            try:
                rule = eval(compile(ast.Expression(call.args[2]), "<rule>", "eval"), dict(module))  # noqa: S307
            except Exception:  # an f-string of locals or of the instance: described by hand instead
                continue
            if isinstance(rule, str):
                out.setdefault(call.args[1].value, []).append(f"must {rule}")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(classes: list[type], section: str, with_rules: bool = True) -> list[str]:
    desc = DESCRIPTIONS[section]
    rows = ["| key | type | default | what it does | rule |", "|---|---|---|---|---|"]
    missing = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        rules = _rules(cls) if with_rules else {}
        for f in dataclasses.fields(cls):
            key = f.name.replace("_", "-")
            if key not in desc:
                missing.append(f"{section}.{key}")
                continue
            rule = "; ".join(rules.get(key, []))
            rows.append(f"| `{key}` | {_type(hints[f.name])} | `{_toml(f.default)}` | {_cell(desc[key])} | {_cell(rule)} |")
    if missing:
        raise SystemExit(f"{COMMAND}: no description for {', '.join(missing)}: add one to DESCRIPTIONS in "
                         "docs/gen_config_reference.py")
    return rows


def _tiers() -> list[str]:
    from simulations.scenario import REQUIRED_TIER_KEYS, TIER_KEYS, TIER_RULES
    from simulations.virtual import DEFAULT_TIERS, DeviceProfile

    fields = {f.name: f for f in dataclasses.fields(DeviceProfile)}
    desc = DESCRIPTIONS["tiers"]
    missing = sorted(set(TIER_KEYS) - set(desc))
    if missing:
        raise SystemExit(f"{COMMAND}: no description for tiers.{missing[0]}: add one to DESCRIPTIONS")
    rows = ["| key | default | what it does | rule |", "|---|---|---|---|"]
    for key, attr in TIER_KEYS.items():
        default = "required" if key in REQUIRED_TIER_KEYS else f"`{_toml(fields[attr].default)}`"
        rule = f"must be {TIER_RULES[key][-1]}" if key in TIER_RULES else "must be a non-empty string"
        rows.append(f"| `{key}` | {default} | {_cell(desc[key])} | {_cell(rule)} |")
    rows += ["", "Without `[[tiers]]` the virtual engine uses these:", "",
             "| name | fraction | compute-s-per-example | uplink-mbps | downlink-mbps | latency-s | sigma | availability "
             "| dropout |", "|---|---|---|---|---|---|---|---|---|"]
    for frac, p in DEFAULT_TIERS:
        rows.append(f"| {p.tier} | {frac:g} | {p.compute_s_per_example:g} | {p.uplink_mbps:g} | {p.downlink_mbps:g} | "
                    f"{p.latency_s:g} | {p.sigma:g} | {p.availability:g} | {p.dropout:g} |")
    return rows


def generate() -> str:
    from clients.config import TaskSpec, TrainSettings
    from coordinator.config import (AggregationSettings, AsyncSettings, PrivacySettings, RunConfig, SecureAggSettings,
                                    ServerSettings)
    from coordinator.aggregator import UpstreamSettings
    from coordinator.service import ServiceSettings
    from simulations.scenario import SimulationSettings

    groups = [(ServerSettings, "rounds, limits, server optimizer"), (TaskSpec, "the task and its data split"),
              (TrainSettings, "local training"), (AggregationSettings, "codecs and aggregation rules"),
              (PrivacySettings, "differential privacy"), (AsyncSettings, "workflow: sync or FedBuff"),
              (SecureAggSettings, "secure aggregation (SecAgg+)")]
    covered = {cls for cls, _ in groups}
    hints = typing.get_type_hints(RunConfig)
    if set(hints.values()) != covered:  # a settings group added to RunConfig must get a section here
        raise SystemExit(f"{COMMAND}: RunConfig's groups changed ({sorted(c.__name__ for c in set(hints.values()))}); "
                         "list the new one in generate()")
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses: do not edit by hand. -->",
        "",
        "Scenario files (`fedshield simulate`) have `[simulation]`, `[run]`, for the virtual engine `[[tiers]]`, and "
        "with edge aggregators `[site]`.",
        "The coordinator config (`fedshield coordinator start --config`) has `[coordinator]` and `[run]`; an edge "
        "aggregator's (`fedshield aggregator start --config`) also `[upstream]`.",
        "`[run]` keys are also Flower's `run_config` keys (`pyproject.toml`'s `[tool.flwr.app.config]`).",
        "Keys are kebab-case; an unknown key is an error that names the closest known one. On the command",
        "line, `--set run.KEY=VALUE` or `--set simulation.KEY=VALUE` (the value is read as TOML: quote strings,",
        "`--set 'run.dp=\"central\"'`). Every value is checked before anything starts; a bad one is one line,",
        "`fedshield: error: run.lr must be in (0, 100]. Found -1.0.`",
        "",
        "The rule column is read from the dataclasses' `__post_init__` checks; rules that tie several keys",
        "together are listed after the `[run]` tables.",
        "",
        "## [run]",
        "",
    ]
    for cls, title in groups:
        lines += [f"### {title} (`{cls.__module__}.{cls.__name__}`)", "", *_table([cls], "run"), ""]
    cross = CROSS_KEY_RULES.rstrip()
    if "clients_per_round" in {f.name for f in dataclasses.fields(ServerSettings)}:
        cross += ("\n- `clients-per-round > 0`: `fraction-train = 1.0`, no central DP (its secret Poisson sample is set "
                  "by `fraction-train`), `workflow = \"sync\"`.")
    lines += ["### Rules between keys", "", cross, ""]
    lines += ["## [simulation]", "", f"`{SimulationSettings.__module__}.SimulationSettings`.", "",
              *_table([SimulationSettings], "simulation"), ""]
    lines += ["## [[tiers]]", "", "Device tiers for the virtual engine (`simulations.scenario.parse_tiers`, "
              "`simulations.virtual.DeviceProfile`). A node's time for a message: latency + bytes / link, plus "
              "compute-s-per-example x examples x epochs x LogNormal(0, sigma).", "", *_tiers(), ""]
    lines += ["## [site]", "", "Edge aggregators' settings, with `simulation.sites > 0` (`simulations.scenario.site_config`): "
              "any `[run]` key but the task's, the clients' training, `seed`, `num-rounds` and `run-dir`, which come "
              "with the coordinator's message each round. Defaults: the coordinator's `round-timeout`, "
              "`fraction-train = 1.0`, `min-nodes = 1`. A site runs synchronous rounds (validation, codec, `aggregator`, "
              "SecAgg+, central DP of its own) and replies upward with its aggregate and its weight; its rows are in "
              "`RUN_DIR/sites/site-K/metrics.csv`. Above the sites: no SecAgg+ nor FedBuff, `min-nodes <= sites`.", ""]
    lines += ["## [coordinator]", "", f"`{ServiceSettings.__module__}.ServiceSettings`. Relative paths are relative to "
              "the config file.", "", *_table([ServiceSettings], "coordinator"), ""]
    lines += ["## [upstream]", "", "An edge aggregator's config (`fedshield aggregator start --config`) is a coordinator "
              "config, `[coordinator]` (the site's SuperLink, its agents' enrolled keys) and `[run]` (the site's round, "
              "as `[site]` above, but naming the coordinator's task; the clients' training and the seed come with the "
              "coordinator's message), with "
              f"this table for the coordinator above (`{UpstreamSettings.__module__}.UpstreamSettings`; paths relative "
              "to the config file).", "", *_table([UpstreamSettings], "upstream"), ""]
    lines += ["## Environment variables", "",
              "| variable | effect |", "|---|---|",
              "| `FEDSHIELD_DEVICE` | `cpu`, `cuda` or `cuda:N`: the device of clients (in-process and agents) and, where `device = \"auto\"` (the default), of aggregation; unset, CUDA when present |",
              "| `FEDSHIELD_KERNELS` | `torch`: turn off the fused CPU kernels (numba) |",
              "| `FEDSHIELD_TORCH_THREADS` | torch threads in clients and agents |",
              "| `FEDSHIELD_AGENT_STATE_DIR` | the agent's default `--state-dir` |",
              "| `FEDSHIELD_HOME` | where `flwr run .` runs write (`runs/run-<id>/`; default `~/.fedshield`) |",
              "| `RAY_AUTH_MODE`, `RAY_AUTH_TOKEN` | Ray token authentication (see [researcher.md](researcher.md)) |", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = generate()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
