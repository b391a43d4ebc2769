"""`metrics.tensorboard: true`: the orchestrator writes TensorBoard scalars as it tails heartbeats; read back here
from the event file itself."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from cona.orchestrator.tensorboard import TensorBoardWriter
from cona.protocol.heartbeat_record import Heartbeat
from cona.protocol.rundir import ExitCode
from cona.protocol.strategy import Strategy

from tests.conftest import REPO
from tests.test_scheduler import A, B, make_scheduler


def read_events(directory: Path) -> tuple[dict[str, list[tuple[int, float]]], list[tuple[int, str]]]:
    """({tag: [(step, value)]}, [(step, text)]) from every event file under `directory` (TFRecord framing: length,
    its CRC, the serialized Event, its CRC)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    texts: list[tuple[int, str]] = []
    files = sorted(directory.glob("events.out.tfevents.*"))
    assert files, f"no event file in {directory}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("tensor") and value.tensor.string_val:
                    texts.append((event.step, value.tensor.string_val[0].decode()))
                else:
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars, texts


def _beat(samples: int, strategy: Strategy, **fields) -> Heartbeat:
    values = dict(time=0.0, attempt=1, strategy=strategy.to_dict(), step=samples // strategy.gbs, samples=samples,
                  tokens=samples * 64, train_loss=3.0 - samples / 1000, lr=1e-3, step_time_s=0.1, samples_per_s=160.0)  # fmt: skip
    return Heartbeat(**{**values, **fields})


def test_the_writer_records_scalars_strategy_and_switches(tmp_path):
    writer = TensorBoardWriter(tmp_path)
    writer.heartbeats([_beat(16, A), _beat(32, A, val_loss=2.5, val_perplexity=12.18, event="eval")],
                      noise_estimate=40.0, noise_scale=64.0)  # fmt: skip
    writer.switch(source=A, target=B, cost_s=1.25, kind="in-place")
    writer.heartbeats([_beat(96, B)], noise_estimate=50.0, noise_scale=80.0)
    writer.close()
    scalars, texts = read_events(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(16, pytest.approx(2.984)), (32, pytest.approx(2.968)), (96, pytest.approx(2.904))]
    assert scalars["val/loss"] == [(32, 2.5)] and scalars["val/perplexity"] == [(32, pytest.approx(12.18))]
    assert scalars["noise/scale"] == [(32, 64.0), (96, 80.0)] and scalars["noise/estimate"] == [(32, 40.0), (96, 50.0)]
    assert scalars["train/samples_per_s"][0] == (16, 160.0) and scalars["train/gbs"][-1] == (96, 64.0)
    assert scalars["switch"] == [(32, 1.0)]
    assert [text for _, text in texts] == [
        f"{A.short()} from sample 16",
        f"switch {A.short()} → {B.short()} at sample 32 (in-place, 1.2 s)",
        f"{B.short()} from sample 96",
    ]


def test_the_scheduler_writes_the_heartbeats_it_tails(tmp_path):
    scheduler, backend = make_scheduler(tmp_path, "metrics.tensorboard=true")
    attempt = scheduler.start_or_resume()
    strategy = attempt.strategy
    lines = [_beat(k * strategy.gbs, strategy, attempt=attempt.number).to_dict() for k in (1, 2, 3)]
    heartbeat_file = scheduler.run_dir.heartbeat_file(attempt.number)
    heartbeat_file.parent.mkdir(parents=True, exist_ok=True)
    heartbeat_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    backend.exit_codes[attempt.number] = ExitCode.DONE
    scheduler.run()
    scalars, texts = read_events(scheduler.run_dir.root / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == [strategy.gbs, 2 * strategy.gbs, 3 * strategy.gbs]
    # The B_noise the policy ranks with before its first decision: the prior; unset, the base batch through the
    # critical-batch factor.
    policy = scheduler.job.policy
    prior = policy.prior_noise_scale or policy.critical_batch_factor * scheduler.job.batch.base_gbs
    assert scalars["noise/scale"] == [(3 * strategy.gbs, prior)] and texts[0][1] == f"{strategy.short()} from sample {strategy.gbs}"


def test_the_writer_loads_no_torch():
    code = ("import sys; from cona.orchestrator.tensorboard import TensorBoardWriter; import tempfile; "
            "TensorBoardWriter(tempfile.mkdtemp()).close(); print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_without_tensorboardx_the_run_refuses_in_one_line(tmp_path, monkeypatch):
    from cona.protocol.yamlconfig import ConfigError

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    with pytest.raises(ConfigError) as info:
        make_scheduler(tmp_path, "metrics.tensorboard=true")
    assert str(info.value) == ("metrics.tensorboard needs tensorboardX: pip install 'cona[tensorboard]' (or set "
                               "metrics.tensorboard: false)")  # fmt: skip
