"""One rank of ``conftest.run_on_gloo`` when the fork launcher starts the ranks:
``gloo_rank.py SCENARIOS.pkl RESULTS.pt`` unpickles the scenarios function and runs it
as conftest._gloo_worker does for spawned ranks (rank, world size and port from the
torchrun variables the launcher sets)."""

import os
import pickle
import sys

from conftest import _gloo_worker

if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        scenarios = pickle.load(f)
    _gloo_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                 int(os.environ["MASTER_PORT"]), scenarios, sys.argv[2])
