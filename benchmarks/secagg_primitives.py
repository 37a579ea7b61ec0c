"""SecAgg+ primitives: fedshield vs Flower 1.42 in the same run.

    python benchmarks/secagg_primitives.py [--json FILE]

Mask expansion (ours: AES-256-CTR keyed by the full 32-byte seed; Flower: numpy
RandomState from a 32-bit seed) and Shamir sharing of a 32-byte secret at n=100, t=51.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulations import bench as _report  # noqa: E402

from privacy.secagg.masking import expand_seed  # noqa: E402
from privacy.secagg.shamir import combine, split  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    a = p.parse_args()
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    rep = _report.Report("secagg_primitives")
    words, seed, secret = 1_000_000, os.urandom(32), os.urandom(32)
    ours = _report.best_of(lambda: expand_seed(seed, words))
    theirs = _report.best_of(lambda: pseudo_rand_gen(seed, 2**32, [(words,)]), repeat=3)
    rep.add("expand a 32-byte seed into 1M mask words", ours * 1e3, "ms", "flwr pseudo_rand_gen (32-bit seed)",
            theirs * 1e3, "faster, full-entropy seed", theirs > ours)
    shares, fl_shares = split(secret, 51, 100), create_shares(secret, 51, 100)
    assert combine(shares[:51], 51) == secret and combine_shares(fl_shares[:51]) == secret
    ours = _report.best_of(lambda: split(secret, 51, 100))
    theirs = _report.best_of(lambda: create_shares(secret, 51, 100), repeat=2)
    rep.add("Shamir split 32 B, n=100, t=51", ours * 1e3, "ms", "flwr create_shares", theirs * 1e3, "", None)
    ours = _report.best_of(lambda: combine(shares[:51], 51))
    theirs = _report.best_of(lambda: combine_shares(fl_shares[:51]), repeat=2)
    rep.add("Shamir combine 51 shares", ours * 1e3, "ms", "flwr combine_shares", theirs * 1e3, "", None)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
