"""Benchmarks (not tests): each prints a table last and writes JSON (and a PNG) under `benchmarks/results/`.

    python -m benchmarks.ttp [--quick]   time to target validation loss: static, every fixed strategy, cona, oracle
    python -m benchmarks.switch          the cost of one switch on the local backend, next to its floor
    python -m benchmarks.overhead        heartbeat + gradient-statistics cost; planner time for 10^4 candidates

`docs/benchmarks.md` has the numbers, the plots and the machine they ran on.
"""
