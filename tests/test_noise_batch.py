"""The default noise-scale estimator measures the state, not the batch that measures it (issue: a larger batch must
not make its own estimate larger). From one training state, with the parameters held (LR 0) while AdamW's moments
follow the gradients of the batch being trained, the estimates at two batch sizes 8× apart must agree within 25%;
`benchmarks.noise_batch` is the full measurement (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from cona.orchestrator.job import PolicySpec

from benchmarks.noise_batch import Settings, measure


@pytest.mark.slow
def test_default_estimator_agrees_across_batches_at_one_state():
    default = PolicySpec().noise_estimator
    result = measure(Settings(workload="gpt", states=(2048,), batches=(16, 128), steps=160, warmup=40, seed=0,
                              modes=("held",)))  # fmt: skip
    rows = {r["batch"]: r for r in result["rows"]}
    assert set(rows) == {16, 128} and all(r["mode"] == "held" for r in rows.values())
    small, large = rows[16][default], rows[128][default]
    assert small is not None and large is not None and small > 0 and large > 0
    assert max(small, large) / min(small, large) <= 1.25, f"{default}: {small:.1f} at 16 vs {large:.1f} at 128"
    # The Adam-preconditioned kind is measured on the same steps: it is the batch-dependent one (not the default).
    adam_small, adam_large = rows[16]["adam"], rows[128]["adam"]
    assert adam_small is not None and adam_large is not None and adam_large / adam_small > 1.5
