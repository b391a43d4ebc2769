"""`cona profile` (measure a few strategies before training) and `cona run --measured` (start from them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from cona.orchestrator import profiling
from cona.orchestrator.job import load_job
from cona.orchestrator.planner import enumerate_candidates
from cona.orchestrator.policy import ConaPolicy
from cona.orchestrator.profile import load_profile
from cona.orchestrator.runstate import create_run, read_state, stored_measurements
from cona.orchestrator.throughput import ThroughputModel
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import REPO

PROFILE = REPO / "slurm" / "profiles" / "local-cpu.yaml"
JOB = REPO / "examples" / "tiny-gpt.yaml"


@pytest.fixture
def setup():
    profile, job = load_profile(PROFILE), load_job(JOB)
    candidates = enumerate_candidates(profile=profile, job=job, num_devices=profile.num_gpus, feasible_only=True)
    return profile, job, candidates


def test_the_picked_strategies_measure_the_start_layout_at_several_batches_and_the_other_layouts_once(setup):
    _, job, candidates = setup
    base = job.batch.base_gbs
    picked = profiling.pick_strategies(candidates, base_gbs=base, top=6)
    first = min((c for c in candidates if c.gbs == base), key=lambda c: (c.iter_time_s, c.pp, c.tp, c.mbs))
    assert picked[0] == first.strategy  # where a run starts
    start = first.strategy.layout()
    # That layout at every batch of [base/2, 4·base] where it runs: its fixed cost told from its per-sample cost.
    runs = {c.gbs for c in candidates if c.strategy.layout() == start and base / 2 <= c.gbs <= 4 * base}
    same = [s for s in picked if s.layout() == start]
    assert {s.gbs for s in same} == runs and len(same) == len(runs) > 1 and picked[: len(same)] == same
    assert picked[1].gbs == 2 * base  # the nearest batch first, the larger on a tie
    # Then other layouts at the base batch, each once, fastest first.
    rest = picked[len(same):]
    assert rest and all(s.gbs == base for s in rest) and len({s.layout() for s in rest}) == len(rest)
    assert start not in {s.layout() for s in rest}
    assert len(picked) == 6 and len(set(picked)) == 6
    two = profiling.pick_strategies(candidates, base_gbs=base, top=2)
    assert two == picked[:2] and two[0].layout() == two[1].layout()  # even two measure one layout at two batches
    with pytest.raises(ValueError, match="--top must be at least 1"):
        profiling.pick_strategies(candidates, base_gbs=base, top=0)


def test_the_profiling_job_runs_each_strategy_for_its_steps_and_stops_after_the_last(setup):
    profile, job, _ = setup
    run_job, chosen, steps = profiling.profiling_job(
        profile, job, top=None, strategies="dp=4,tp=1,pp=1,mbs=4,gbs=16; dp=2,tp=1,pp=2,mbs=8,gbs=32", steps=5
    )
    assert chosen == [Strategy(4, 1, 1, 4, 16), Strategy(2, 1, 2, 8, 32)] and steps == 5
    assert run_job.policy.name == "schedule"
    assert [(e.samples, e.strategy) for e in run_job.policy.schedule] == [
        (0, "dp=4,tp=1,pp=1,mbs=4,gbs=16"), (80, "dp=2,tp=1,pp=2,mbs=8,gbs=32")]  # fmt: skip
    assert run_job.target.max_samples == 80 + 5 * 32 and run_job.target.val_perplexity is None
    assert run_job.eval.interval_samples > run_job.target.max_samples  # no evaluation inside the step times
    _, default_chosen, default_steps = profiling.profiling_job(profile, job, top=None, strategies=None, steps=None)
    assert len(default_chosen) == profiling.DEFAULT_TOP
    assert default_steps == profiling.DEFAULT_HEARTBEATS * job.heartbeat.interval_steps


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategies": "dp=4,tp=1,pp=1,mbs=4,gbs=16", "top": 2}, "give --top or --strategies, not both"),
        ({"strategies": "dp=4,tp=1,pp=1,mbs=4,gbz=16"}, "--strategies entry 0"),
        ({"strategies": " ; "}, "--strategies names no strategy"),
        ({"strategies": ""}, "--strategies names no strategy"),  # not the default set
        # Refused before anything runs: one heartbeat per strategy is its warm-up, so nothing would be measured.
        ({"steps": 0}, "--steps 0 gives each strategy fewer than 2 heartbeats"),
        ({"steps": 1}, r"--steps 1 gives each strategy fewer than 2 heartbeats \(heartbeat.interval_steps=1; the "
                       r"first after each switch is warm-up\): give at least 2"),
        # It named target.max_samples, a field the user never set.
        ({"steps": 10**20}, r"--steps 100000000000000000000: a profile measures each strategy for a few heartbeats; "
                            r"give at most 100,000"),
    ],
)
def test_a_bad_choice_of_what_to_profile_is_one_line(setup, kwargs, message):
    profile, job, _ = setup
    with pytest.raises((ConfigError, ValueError), match=message) as info:
        profiling.profiling_job(profile, job, **{"top": None, "strategies": None, "steps": None, **kwargs})
    assert "\n" not in str(info.value)


def entry(strategy: Strategy, time_s: float, predicted_s: float | None = None) -> dict:
    return {"strategy": strategy.to_dict(), "times": [time_s] * 9, "count": 12, "predicted_s": predicted_s, "time_s": time_s}


def test_measurements_seed_the_start(setup):
    """Measured step times change where a run starts: the base batch's fastest layout by the cost model, measured
    ten times slower than predicted and another layout at its prediction, moves the start to that layout."""
    _, job, candidates = setup
    policy = ConaPolicy.from_spec(job.policy, base_gbs=job.batch.base_gbs)
    unmeasured, _ = policy.start(candidates=candidates, throughput=ThroughputModel(candidates=candidates))
    other = min((c for c in candidates if c.gbs == unmeasured.gbs and c.strategy.layout() != unmeasured.layout()),
                key=lambda c: c.iter_time_s)  # fmt: skip
    slow = next(c for c in candidates if c.strategy == unmeasured)
    seeded = ThroughputModel(candidates=candidates)
    seeded.absorb([entry(unmeasured, 10 * slow.iter_time_s), entry(other.strategy, other.iter_time_s)])
    started, _ = ConaPolicy.from_spec(job.policy, base_gbs=job.batch.base_gbs).start(candidates=candidates, throughput=seeded)
    assert started.layout() != unmeasured.layout()


def test_a_record_from_another_setup_is_refused_naming_the_field(tmp_path, setup):
    profile, job, _ = setup
    run = RunDir(tmp_path / "p")
    run.root.mkdir()
    profiling.write_measured(run, profile=profile, job=job, measured=[entry(Strategy(4, 1, 1, 4, 16), 0.1)])
    record, source = profiling.load_measured(run.root)
    profiling.check_compatible(record, source, profile, job)  # the same setup: accepted
    faster = load_profile(PROFILE, ["accelerator.peak_tflops=0.1"])
    with pytest.raises(ConfigError, match=r"profile\.accelerator\.peak_tflops is 0\.1 here but 0\.05 where it was measured"):
        profiling.check_compatible(record, source, faster, job)
    no_stats = load_job(JOB, ["heartbeat.gradient_stats=false"])
    with pytest.raises(ConfigError, match=r"job\.heartbeat\.gradient_stats is False here but True"):
        profiling.check_compatible(record, source, profile, no_stats)
    # What does not change a step time is not compared: the data, the optimizer, the target, the node count.
    profiling.check_compatible(record, source, profile, load_job(JOB, ["optimizer.lr=1e-3", "target.max_samples=10"]))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no measured.json there"),
        ("{not json", "not a measurement record written by `cona profile`"),
        ('{"measured": [{"strategy": {"dp": 1}}], "fingerprint": {}}', "not a measurement record"),
        ('{"measured": [{"strategy": {"dp": 4, "tp": 1, "pp": 1, "mbs": 4, "gbs": 16}, "times": [-1]}], '
         '"fingerprint": {}}', "step times must be positive"),
        ('{"measured": [], "fingerprint": {}}', "holds no measured strategy"),
        (b"\xff\xfe", "not a measurement record"),
    ],
)
def test_a_bad_record_is_one_line_naming_the_file(tmp_path, content, message):
    if isinstance(content, bytes):
        (tmp_path / "measured.json").write_bytes(content)
    elif content is not None:
        (tmp_path / "measured.json").write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        profiling.load_measured(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_the_measurements_are_stored_with_the_run(tmp_path, setup):
    profile, job, _ = setup
    run = RunDir(tmp_path / "r")
    measured = [entry(Strategy(4, 1, 1, 4, 16), 0.1, 0.2)]
    create_run(run_dir=run, profile=profile, job=job, measured=measured)
    assert stored_measurements(run) == measured
    plain = RunDir(tmp_path / "plain")
    create_run(run_dir=plain, profile=profile, job=job)
    assert stored_measurements(plain) == []
    for damaged in ([{"strategy": {"dp": 4}, "times": [0.1]}], [{"times": [0.1]}], "x", 3,
                    [{"strategy": Strategy(4, 1, 1, 4, 16).to_dict(), "times": ["slow"]}],
                    measured + measured):  # a strategy twice: which one counts would be an accident  # fmt: skip
        bad = RunDir(tmp_path / f"bad-{len(str(damaged))}-{type(damaged).__name__}")
        create_run(run_dir=bad, profile=profile, job=job)
        document = bad.run_yaml.read_text() + yaml.safe_dump({"measured": damaged})
        bad.run_yaml.write_text(document)
        with pytest.raises(ConfigError, match=r"run\.yaml: its `measured` step times are damaged") as info:
            stored_measurements(bad)
        assert "\n" not in str(info.value)


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cona.orchestrator.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
def test_profile_then_run_from_its_measurements(tmp_path):
    """A real `cona profile` (4 processes, two strategies, in-place switch between them), then `cona run
    --measured` from it: the run starts with the profile's measurements in its throughput model."""
    prof = tmp_path / "prof"
    out = cli("profile", "--profile", str(PROFILE), "--job", str(JOB), "--run-dir", str(prof), "--quiet", "--steps", "8",
              "--strategies", "dp=4,tp=1,pp=1,mbs=4,gbs=16;dp=2,tp=1,pp=2,mbs=4,gbs=32")  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    record = json.loads((prof / "measured.json").read_text())
    measured = {Strategy.from_dict(e["strategy"]): e for e in record["measured"]}
    assert set(measured) == {Strategy(4, 1, 1, 4, 16), Strategy(2, 1, 2, 4, 32)}
    assert all(e["count"] >= 2 and all(t > 0 for t in e["times"]) for e in measured.values())
    assert "d4t1p1 m4 g16" in out.stdout and "d2t1p2 m4 g32" in out.stdout and "--measured" in out.stdout

    mismatch = cli("run", "--profile", str(PROFILE), "--job", str(JOB), "--measured", str(prof),
                   "--set", "heartbeat.gradient_stats=false", "--run-dir", str(tmp_path / "refused"))  # fmt: skip
    assert mismatch.returncode == 2 and mismatch.stderr.count("\n") == 1
    assert "job.heartbeat.gradient_stats" in mismatch.stderr and not (tmp_path / "refused").exists()

    run = tmp_path / "run"
    started = cli("run", "--profile", str(PROFILE), "--job", str(JOB), "--measured", str(prof), "--run-dir", str(run),
                  "--quiet", "--no-report", "--set", "target.max_samples=160", "--set", "target.val_perplexity=null")  # fmt: skip
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    kept = {Strategy.from_dict(e["strategy"]): e["count"]
            for e in read_state(RunDir(run)).model["throughput"]["measured"]}  # fmt: skip
    assert all(kept.get(s, 0) >= e["count"] for s, e in measured.items())


def test_plan_says_where_a_run_would_start_from_the_measurements(tmp_path, setup, capsys):
    from cona.orchestrator import cli

    profile, job, candidates = setup
    argv = ["plan", "--profile", str(PROFILE), "--job", str(JOB), "--top", "1"]
    assert cli.main(argv) == 0
    before = capsys.readouterr().out.strip().splitlines()[-1]
    start = ConaPolicy.from_spec(job.policy, base_gbs=job.batch.base_gbs).start(
        candidates=candidates, throughput=ThroughputModel(candidates=candidates))[0]  # fmt: skip
    assert before.startswith(f"cona starts on {start.short()}:")
    slow = next(c for c in candidates if c.strategy == start)
    other = min((c for c in candidates if c.gbs == start.gbs and c.strategy.layout() != start.layout()),
                key=lambda c: c.iter_time_s)  # fmt: skip
    run = RunDir(tmp_path / "p")
    run.root.mkdir()
    profiling.write_measured(run, profile=profile, job=job,
                             measured=[entry(start, 10 * slow.iter_time_s), entry(other.strategy, other.iter_time_s)])  # fmt: skip
    assert cli.main([*argv, "--measured", str(run.root)]) == 0
    out = capsys.readouterr().out
    after = out.strip().splitlines()[-1]
    assert "with the step times measured in" in after and not after.startswith(f"cona starts on {start.short()} ")
    # The table is ranked by the calibrated times, each with its source: the measured-slow start is not first.
    assert "fastest calibrated iteration first" in out and "calibrated" in out and "from" in out
    rows = [line for line in out.splitlines() if "│" in line and ("measured" in line or "fitted" in line
            or "one point" in line or "others" in line)]  # fmt: skip
    assert len(rows) == 1  # --top 1: the fastest calibrated, with its source
    assert cli.main(["plan", "--profile", str(PROFILE), "--job", str(JOB), "--json", "--top", "0", "--measured", str(run.root)]) == 0
    table = json.loads(capsys.readouterr().out)
    times = [row["calibrated_iter_time_s"] for row in table]
    assert times == sorted(times)
    def key(row):
        return (row["dp"], row["tp"], row["pp"], row["mbs"], row["gbs"])

    by = {key(row): row for row in table}
    mine = (start.dp, start.tp, start.pp, start.mbs, start.gbs)
    assert by[mine]["calibrated_from"] == "measured"
    assert by[mine]["calibrated_iter_time_s"] == pytest.approx(10 * slow.iter_time_s)
    assert key(table[0]) != mine and table[0]["calibrated_iter_time_s"] < 10 * slow.iter_time_s
    assert cli.main([*argv, "--measured", str(run.root), "--gbs", "16"]) == 2
    assert "drop --gbs" in capsys.readouterr().err
