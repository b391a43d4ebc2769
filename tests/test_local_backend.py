"""The local backend on its own: real processes, a stand-in for torchrun."""

from __future__ import annotations

import signal
import sys
import time

from cona.orchestrator.backends.base import AttemptStatus
from cona.orchestrator.backends.crashcause import torchrun_root_cause
from cona.orchestrator.backends.local import LocalBackend
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy

STRATEGY = Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=1)


class ExitingBackend(LocalBackend):
    """Runs `python -c 'exit(code)'` instead of torchrun."""

    def __init__(self, *, run_dir: RunDir, code: int) -> None:
        super().__init__(run_dir=run_dir)
        self.code = code

    def command(self, *, attempt: int, strategy: Strategy) -> list[str]:
        return [sys.executable, "-c", f"raise SystemExit({self.code})"]


def _wait(backend: LocalBackend, attempt) -> object:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        outcome = backend.poll(attempt)
        if outcome.status.finished:
            return outcome
        time.sleep(0.1)
    raise AssertionError("the stand-in attempt did not finish")


def test_exit_code_is_recorded_for_a_relative_run_directory(tmp_path, monkeypatch):
    """`cona run` without --run-dir uses the relative `runs/<name>`; the wrapper runs inside the run directory."""
    monkeypatch.chdir(tmp_path)
    run_dir = RunDir(tmp_path.joinpath("runs", "relative").relative_to(tmp_path))
    run_dir.root.mkdir(parents=True)
    for code, status in ((0, AttemptStatus.DONE), (42, AttemptStatus.SWITCHED), (3, AttemptStatus.CRASHED)):
        backend = ExitingBackend(run_dir=run_dir, code=code)
        attempt = backend.launch(attempt=code + 1, strategy=STRATEGY)
        outcome = _wait(backend, attempt)
        assert outcome.status is status and outcome.exit_code == code, outcome
        assert (tmp_path / "runs" / "relative" / "attempts" / str(code + 1) / "exit_code").read_text().strip() == str(code)


def test_an_attempt_continued_in_place_is_watched_through_the_launch_that_started_it(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    backend = ExitingBackend(run_dir=run_dir, code=0)
    first = backend.launch(attempt=1, strategy=STRATEGY)
    smaller = Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=2)
    backend.offer_in_place(first, number=2, strategy=smaller)
    second = backend.continued(first, number=2, strategy=smaller)
    backend.offer_in_place(second, number=3, strategy=STRATEGY)
    third = backend.continued(second, number=3, strategy=STRATEGY)
    assert second.backend_id == third.backend_id == first.backend_id
    assert third.extra["launched_as"] == 1
    # The trainer learns the strategy it goes on with from the offered launch record.
    offered = run_dir.read_launch(2)
    assert offered is not None and offered.in_place and offered.strategy == smaller and offered.extra["launched_as"] == 1
    assert run_dir.read_launch(3).extra["launched_as"] == 1
    outcome = _wait(backend, third)
    assert outcome.status is AttemptStatus.DONE and outcome.exit_code == 0


def test_a_max_steps_stop_exits_0_and_is_still_told_stopped_by_its_exit_record(tmp_path):
    """A trainer that stopped at its own --max-steps exits 0 (a normal end for torchrun), but its exit record says
    STOPPED: the backend reads the record first, so the orchestrator still tells stopped from done."""
    from cona.protocol.rundir import MAX_STEPS_REASON, ExitCode, ExitRecord, process_exit_status

    assert process_exit_status(ExitCode.STOPPED, reason=MAX_STEPS_REASON) == 0
    assert process_exit_status(ExitCode.STOPPED, reason="signal SIGTERM (1 rank)") == ExitCode.STOPPED
    assert process_exit_status(ExitCode.SWITCH, reason=MAX_STEPS_REASON) == ExitCode.SWITCH
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run_dir.write_exit(1, ExitRecord(exit_code=int(ExitCode.STOPPED), name="STOPPED", reason=MAX_STEPS_REASON,
                                     step=5, time=time.time()))  # fmt: skip
    backend = ExitingBackend(run_dir=run_dir, code=0)
    outcome = _wait(backend, backend.launch(attempt=1, strategy=STRATEGY))
    assert outcome.status is AttemptStatus.STOPPED and outcome.exit_code == ExitCode.STOPPED, outcome


def test_more_processes_than_this_machine_carries_are_warned_about_once(tmp_path, monkeypatch, capsys):
    """Every process of a local run is on this machine, whatever nodes the profile emulates: 4 × 32 renders
    `--nproc-per-node=128`, which a 2-CPU machine cannot run as planned. One stderr line, once per count."""
    from pathlib import Path

    from cona.orchestrator.backends.local import backend as local
    from cona.orchestrator.profile import load_profile

    monkeypatch.setattr(local, "usable_cpus", lambda: 2)
    monkeypatch.setattr(local, "machine_memory_bytes", lambda: 2**40)  # the memory warning is another test's
    profile_path = Path(__file__).resolve().parent.parent / "slurm" / "profiles" / "local-cpu.yaml"
    profile = load_profile(profile_path, ["nodes=4", "gpus_per_node=32"])
    backend = LocalBackend(run_dir=RunDir(tmp_path / "run"), profile=profile)
    wide = Strategy(dp=128, tp=1, pp=1, mbs=1, gbs=128)
    assert "--nproc-per-node=128" in backend.render(strategy=wide)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("cona: warning: the local backend starts 128 trainer processes on this one machine")
    assert "2 CPU(s) for them, more than 2 per CPU" in line and "4 × 32" in line
    assert "lower nodes or gpus_per_node in the profile" in line
    backend.render(strategy=wide)  # said already: not at every relaunch
    backend.render(strategy=Strategy(dp=64, tp=1, pp=1, mbs=1, gbs=64))
    assert capsys.readouterr().err == ""
    # The shipped profile's load, 4 processes on 2 CPUs, is what cona is measured at: no warning.
    LocalBackend(run_dir=RunDir(tmp_path / "run"), profile=profile).render(strategy=Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4))
    assert capsys.readouterr().err == ""
    # A launch warns too (the first attempt of `cona run`, or a later one that starts more processes).
    run_dir = RunDir(tmp_path / "launched")
    run_dir.root.mkdir()
    exiting = ExitingBackend(run_dir=run_dir, code=0)
    _wait(exiting, exiting.launch(attempt=1, strategy=Strategy(dp=5, tp=1, pp=1, mbs=1, gbs=5)))
    (line,) = capsys.readouterr().err.splitlines()
    assert "starts 5 trainer processes" in line and "profile's nodes" not in line


def test_more_processes_than_gpus_or_more_memory_than_the_machine_has_are_warned_about(tmp_path, monkeypatch, capsys):
    """A local GPU profile that starts more processes than the machine shows GPUs (process k takes GPU k: the rest
    fail), and a CPU profile whose processes × accelerator.memory exceed the machine's memory (the planner lets each
    fill it): one stderr line each, once per count, beside the CPU warning, which stays quiet here."""
    from pathlib import Path

    from cona.orchestrator.backends.local import backend as local
    from cona.orchestrator.profile import load_profile

    monkeypatch.setattr(local, "usable_cpus", lambda: 64)
    profiles = Path(__file__).resolve().parent.parent / "slurm" / "profiles"
    monkeypatch.setattr(local, "visible_gpus", lambda: 1)
    gpu = LocalBackend(run_dir=RunDir(tmp_path / "run"), profile=load_profile(profiles / "local-h200.yaml", ["gpus_per_node=4"]))
    gpu.render(strategy=Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=1))
    assert capsys.readouterr().err == ""
    gpu.render(strategy=Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("cona: warning: the local backend starts 4 trainer processes") and "shows 1 GPU(s)" in line
    assert "1 × 4" in line and "lower nodes or gpus_per_node" in line
    gpu.render(strategy=Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4))
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(local, "visible_gpus", lambda: None)  # unknown (no NVIDIA driver here): nothing said
    LocalBackend(run_dir=RunDir(tmp_path / "run"), profile=gpu.profile).render(strategy=Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4))
    assert capsys.readouterr().err == ""

    monkeypatch.setattr(local, "machine_memory_bytes", lambda: 8 * 2**30)
    cpu = LocalBackend(run_dir=RunDir(tmp_path / "run"), profile=load_profile(profiles / "local-cpu.yaml"))  # 4 GiB each
    cpu.render(strategy=Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=2))
    assert capsys.readouterr().err == ""
    cpu.render(strategy=Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4))
    (line,) = capsys.readouterr().err.splitlines()
    assert "starts 4 trainer processes on the CPU" in line and "accelerator.memory='4 GiB' (16.0 GiB in all)" in line
    assert "this machine has 8.0 GiB" in line and "lower accelerator.memory" in line
    # With the job known, what each process will hold (the memory model's peak and the runtime), not the cap: the
    # tiny model's few MB fit 8 GiB; 1.5 GiB is too little for 4 processes of the runtime alone.
    from cona.orchestrator.job import load_job

    tiny = load_job(Path(__file__).resolve().parent.parent / "examples" / "tiny-gpt.yaml")
    strategy = Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16)
    LocalBackend(run_dir=RunDir(tmp_path / "run"), profile=cpu.profile, job=tiny).render(strategy=strategy)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(local, "machine_memory_bytes", lambda: 3 * 2**29)
    LocalBackend(run_dir=RunDir(tmp_path / "run"), profile=cpu.profile, job=tiny).render(strategy=strategy)
    (line,) = capsys.readouterr().err.splitlines()
    assert "each predicted to need 0.51 GiB" in line and "d4t1p1 m4 g16" in line and "this machine has 1.5 GiB" in line


def test_visible_gpus_counts_device_nodes_narrowed_by_cuda_visible_devices(tmp_path, monkeypatch):
    from cona.orchestrator.backends.local.backend import visible_gpus

    assert visible_gpus(tmp_path) is None  # no NVIDIA device node: unknown, not 0
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(tmp_path) == 3
    for listed, count in (("0,2", 2), ("", 0), ("1,-1,2", 1), ("GPU-8a1b,GPU-77c2", 2), ("0,1,2,3,4", 3)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
        assert visible_gpus(tmp_path) == count, listed


# torchrun's summary of a failed attempt (torch 2.13), as the attempt's log ends with it.
SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
cona.trainer FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-07_20:41:11
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 21696)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-07_20:41:04
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : {code} (pid: 21699){signal}
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 21699
============================================================
"""




def torchrun_summary(*, rank: int = 3, code: int = -9, at: str = "20:41:04") -> str:
    """`SUMMARY` naming `rank` with exit `code` (negative: the signal) as the root cause, seen at `at` on 2026-12-07."""
    name = f"  ({signal.Signals(-code).name})" if code < 0 else ""
    text = SUMMARY.format(code=code, signal=name).replace("2026-12-07_20:41:04", f"2026-12-07_{at}")
    return text.replace("rank      : 3 (local_rank: 3)", f"rank      : {rank} (local_rank: {rank % 4})")


class CrashingBackend(LocalBackend):
    """Prints `text` (torchrun's output) and exits 1, as torchrun does when a worker failed."""

    def __init__(self, *, run_dir: RunDir, text: str) -> None:
        super().__init__(run_dir=run_dir)
        self.text = text

    def command(self, *, attempt: int, strategy: Strategy) -> list[str]:
        return [sys.executable, "-c", f"import sys; sys.stdout.write({self.text!r}); raise SystemExit(1)"]


def test_a_crash_names_the_rank_that_died_and_of_what(tmp_path):
    """The crash line said only `torchrun exited 1`, though the attempt's log named the rank and the signal, and the
    rank's exception went by in its traceback. A rank killed by a signal is named with it (torchrun's root cause);
    one that raised, with the exception its own record holds (the earliest: the others died of its loss)."""
    from cona.protocol.rundir import CrashRecord

    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    cases = [
        (SUMMARY.format(code=-9, signal="  (SIGKILL)"), [], "rank 3 killed by SIGKILL (torchrun exited 1)"),
        (SUMMARY.format(code=1, signal=""), [CrashRecord(0, "RuntimeError: Connection closed by peer", 2.0),
                                             CrashRecord(3, "ValueError: injected on one rank", 1.0)],
         "rank 3: ValueError: injected on one rank (torchrun exited 1)"),
        (SUMMARY.format(code=1, signal=""), [], "rank 3 exited 1 (torchrun exited 1)"),
        ("", [CrashRecord(1, "KeyError: 'x'", 1.0), CrashRecord(0, "KeyError: 'x'", 1.1)],
         "ranks 0, 1: KeyError: 'x' (torchrun exited 1)"),
        ("no summary: torchrun itself failed\n", [], "torchrun exited 1"),
    ]  # fmt: skip
    for number, (text, records, detail) in enumerate(cases, start=1):
        for record in records:
            run_dir.write_crash(number, record)
        backend = CrashingBackend(run_dir=run_dir, text=text)
        outcome = _wait(backend, backend.launch(attempt=number, strategy=STRATEGY))
        assert outcome.status is AttemptStatus.CRASHED and outcome.exit_code == 1, outcome
        assert outcome.detail == detail, (number, outcome)


def test_of_several_nodes_summaries_the_failure_seen_first_is_the_root_cause(tmp_path):
    """A multi-node attempt (Slurm, Kubernetes) has one log per node, each ending with its own torchrun's summary:
    the root cause is the failure seen first, a signal before an exit code in the same second (the killed rank's
    peers fail of its loss); a log without a summary, or none at all, says nothing."""

    def root(*texts: str | None) -> tuple[int, int] | None:
        logs = []
        for index, text in enumerate(texts):
            logs.append(tmp_path / f"node-{index}.log")
            logs[-1].unlink(missing_ok=True)
            if text is not None:
                logs[-1].write_text(text)
        found = torchrun_root_cause(logs)
        return (found.rank, found.exit_code) if found is not None else None

    consequence = torchrun_summary(rank=0, code=1, at="20:41:05")
    killed = torchrun_summary(rank=6, code=-9, at="20:41:04")
    assert root(consequence, killed) == (6, -9)
    assert root(torchrun_summary(rank=0, code=1, at="20:41:04"), killed) == (6, -9)  # the same second
    assert root(torchrun_summary(rank=0, code=1, at="20:41:03"), killed) == (0, 1)  # seen a second before
    assert root("training\n", None, killed) == (6, -9)
    assert root("training\n", None) is None
    # One log with two summaries (a step run again after a requeue appends to it): the last one.
    assert root(torchrun_summary(rank=1, code=-15, at="20:40:00") + "requeued\n" + consequence) == (0, 1)
    assert torchrun_root_cause([]) is None and torchrun_root_cause([tmp_path / "missing.log"]) is None
