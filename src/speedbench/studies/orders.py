"""The balanced random orders the rounds (rounds.py) and time to target (to_target.py) run the
variants in.

The orders come from a Williams design (a Latin square balanced for first-order carry-over; for
an odd number of variants the square and its mirror image): over one block of k rounds (2k for
odd k) every variant holds every position once (twice), and follows every other variant equally
often. Each block shuffles the design's rows and assigns the variants to its letters at random,
from `order_seed`: fresh entropy per run unless `bench.order_seed` gives one (`bench.seed` fixes
the models and the data only). trials.csv records `order_seed`, `round` and `position`, so
`bench.order_seed=<that value>` replays a run's orders; under torchrun rank 0's seed is used on
every rank.
"""
from __future__ import annotations

import secrets

import numpy as np

from speedbench import distributed


def williams_rows(k: int) -> list[list[int]]:
    """A Williams design for k letters: k sequences (k even) or 2k (k odd: the square and its
    mirror image) in which every letter holds every position, and follows every other letter,
    equally often. Row i is the first row 0, 1, k-1, 2, k-2, ... plus i (mod k)."""
    first, low, high = [0], 1, k - 1
    while len(first) < k:
        first.append(low)
        low += 1
        if len(first) < k:
            first.append(high)
            high -= 1
    rows = [[(x + i) % k for x in first] for i in range(k)]
    return rows + [row[::-1] for row in rows] if k % 2 else rows


def round_order(names: list[str], order_seed: int, round_: int, stream: int = 0) -> list[str]:
    """The variants in the order round `round_` runs them: a row of the Williams design of the
    round's block, the block's rows in a random order and the variants given to the letters at
    random, both drawn from (order_seed, stream, block). `stream` tells the models apart."""
    rows = williams_rows(len(names))
    block, row = divmod(round_, len(rows))
    rng = np.random.default_rng([order_seed, stream, block])
    letters, shuffled = rng.permutation(len(names)), rng.permutation(len(rows))
    return [names[letters[x]] for x in rows[shuffled[row]]]


def fresh_order_seed(dist_env: distributed.DistEnv | None = None) -> int:
    """Fresh entropy for a run's orders (63 bits), the same on every torchrun rank. A rank
    that dies before this first collective fails the job in one line, like a failed trial
    (there is no trial yet to write a row for)."""
    try:
        return distributed.same_on_every_rank(secrets.randbits(63), dist_env)
    except Exception as exc:
        if dist_env is None:
            raise
        distributed.report_failure(exc, dist_env, "agreeing on the round order")
        raise


def plan_order_seed(plan, dist_env: distributed.DistEnv | None = None) -> int:
    """The plan's order seed: bench.order_seed (the run's config) to replay, else fresh."""
    seed = plan.config.bench.order_seed
    return fresh_order_seed(dist_env) if seed is None else seed
