"""The cost of one switch, split into its parts, next to its physical floor, on the local backend or on Slurm.

    python -m benchmarks.switch [--models tiny,50m] [--modes relaunch,in-place] [--profile slurm/profiles/local-cpu.yaml]
    python -m benchmarks.switch --models tiny --profile slurm/profiles/local-slurm.yaml   # the local Slurm cluster (switch-slurm.json)

For each model a real run (`cona.orchestrator.scheduler.Scheduler` + the profile's backend: `LocalBackend`,
torchrun, gloo on CPU; or `SlurmBackend`, an `srun` step per attempt in one batch job — exactly what `cona run`
does) follows a `schedule` policy A → B → A, so each run measures two switches that reshard the
checkpoint between layouts (A: dp=4; B: dp=2 × pp=2), once per switch mode: `relaunch` (the trainer exits and
the backend starts a new torchrun) and `in-place` (`policy.in_place_switch`: the same processes rebuild the model,
optimizer and meshes for the new strategy). Each switch is timed from the decision (the scheduler's
`switch` event, control.json written) to the end of the first optimizer step under the new strategy (the new
attempt's first periodic heartbeat), split with the timestamps the run leaves behind:

    step boundary   decision → the trainer starts its checkpoint (it finishes the step in flight first)
    save            checkpoint start (trainer_state.json `time`) → COMPLETE marker written
    exit            COMPLETE → torchrun exited (mtime of attempts/<n>/exit_code, written by the local backend; on
                    Slurm the step's end as the batch script recorded it, attempts/<n>/slurm-exit.json `time`);
                    in place: COMPLETE → the old model is released (the new attempt's startup.json `main_start`)
    launch+rdzv     torchrun exited → the new attempt starts loading: the scheduler's poll, torchrun, interpreter
                    and `import torch` in every worker, the process-group rendezvous, model build
                    (attempts/<n>/startup.json: process_start, main_start, dist_ready, model_ready, load_start);
                    in place: the model build alone (main_start → load_start)
    load            load_start → load_end (DCP read and reshard)
    first step      load_end → first heartbeat of the new attempt

The floor, measured in the same run on the same filesystem: the checkpoint's bytes over the measured write
bandwidth (write + fsync of as many bytes) plus the same bytes over the measured read bandwidth (reading that file
back, from the page cache just as the trainer reads its just-written checkpoint), plus the wall time of
`python -c "import torch"` (median of 3).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, fmt_s, print_table, run_main, shown, write_json

MODELS: dict[str, list[str]] = {
    "tiny": [],  # examples/tiny-gpt.yaml: 0.24M parameters
    "50m": ["model.num_layers=16", "model.hidden_size=512", "model.num_heads=8", "model.num_kv_heads=8",
            "model.ffn_hidden_size=2048"],  # 50.7M parameters
}  # fmt: skip
STRATEGY_A = "dp=4,tp=1,pp=1,mbs=2,gbs=8"
STRATEGY_B = "dp=2,tp=1,pp=2,mbs=2,gbs=8"
PHASES = ("step boundary", "save", "exit", "launch+rdzv", "load", "first step")


def _job(model: str, switch_at: list[int], max_samples: int, *, in_place: bool) -> Any:
    from cona.orchestrator.job import job_from_dict, job_to_dict, load_job

    job = load_job(REPO / "examples/tiny-gpt.yaml", [
        *MODELS[model], "policy.name=cona", "policy.decision_interval_s=1", f"target.max_samples={max_samples}",
        "target.val_perplexity=1.01", "eval.interval_samples=1000000", "eval.num_windows=4", "eval.batch_size=4",
        "checkpoint.interval_steps=100000", "checkpoint.keep=4", "heartbeat.interval_steps=1",
        f"policy.in_place_switch={str(in_place).lower()}",
        f"data.path={REPO / 'data/shakespeare.txt'}",
    ])  # fmt: skip
    strategies = [STRATEGY_A, STRATEGY_B, STRATEGY_A]
    data = job_to_dict(job)
    data["name"] = f"bench-switch-{model}"
    data["policy"]["name"] = "schedule"
    data["policy"]["schedule"] = [{"samples": n, "strategy": s}
                                  for n, s in zip([0, *switch_at], strategies, strict=True)]  # fmt: skip
    return job_from_dict(data, source="benchmarks.switch job")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure_run(model: str, *, in_place: bool, profile_path: str, keep: bool) -> dict[str, Any]:
    from cona.orchestrator.backends import make_backend
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.runstate import create_run, read_events
    from cona.orchestrator.scheduler import Scheduler
    from cona.protocol.rundir import RunDir

    profile = load_profile(REPO / profile_path)
    if model == "tiny":
        job = _job(model, switch_at=[80, 480], max_samples=1200, in_place=in_place)
    else:
        job = _job(model, switch_at=[16, 48], max_samples=72, in_place=in_place)
    runs = REPO / "runs"
    runs.mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"bench-switch-{model}-", dir=runs))
    run_dir = RunDir(root)
    create_run(run_dir=run_dir, profile=profile, job=job)
    started = time.time()
    backend = make_backend(profile=profile, run_dir=run_dir, job=job)
    scheduler = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend)
    try:
        state = scheduler.run()
    finally:
        backend.close()  # a Slurm job idling after the last attempt
    wall = time.time() - started
    if state.status != "done":
        raise RuntimeError(f"{model}: the run ended {state.status}: {state.reason} (see {root})")
    events = read_events(run_dir)
    switches = [e for e in events if e["event"] == "switch"]
    launches = {e["attempt"]: e for e in events if e["event"] == "launch"}
    completes = [e for e in events if e["event"] == "switch-complete"]
    out = []
    checkpoint_bytes = []
    for i, sw in enumerate(switches):
        old, new = sw["attempt"], sw["attempt"] + 1
        exit_record = run_dir.read_exit(old)
        assert exit_record is not None and exit_record.step is not None, f"attempt {old} left no exit record"
        ckpt = run_dir.checkpoint_dir(exit_record.step)
        trainer_state = json.loads((ckpt / "trainer_state.json").read_text())
        marker = json.loads((ckpt / "COMPLETE").read_text())
        size = sum(marker["files"].values())
        checkpoint_bytes.append(size)
        startup = json.loads((run_dir.attempt_dir(new) / "startup.json").read_text())
        if startup.get("in_place"):
            assert exit_record.next_attempt == new, f"attempt {old} did not switch in place"
            exited = startup["main_start"]
        elif (run_dir.attempt_dir(old) / "exit_code").exists():  # the local backend's wrapper wrote it
            exited = (run_dir.attempt_dir(old) / "exit_code").stat().st_mtime
        else:  # Slurm: the batch script's helper recorded the step's end once srun returned
            exited = json.loads((run_dir.attempt_dir(old) / "slurm-exit.json").read_text())["time"]
        beats = _read_jsonl(run_dir.heartbeat_file(new))
        first = next(b for b in beats if b.get("event") is None)
        t = {
            "decision": sw["time"], "save_start": trainer_state["time"], "save_end": marker["time"], "exited": exited,
            "launched": launches[new]["time"], "process_start": startup.get("process_start"),
            "main_start": startup["main_start"], "dist_ready": startup["dist_ready"],
            "model_ready": startup["model_ready"], "load_start": startup["load_start"], "load_end": startup["load_end"],
            "first_step": first["time"],
        }  # fmt: skip
        phases = {
            "step boundary": t["save_start"] - t["decision"],
            "save": t["save_end"] - t["save_start"],
            "exit": t["exited"] - t["save_end"],
            "launch+rdzv": t["load_start"] - t["exited"],
            "load": t["load_end"] - t["load_start"],
            "first step": t["first_step"] - t["load_end"],
        }
        launch_parts = {
            "orchestrator reaction": t["launched"] - t["exited"],
            "torchrun + interpreter start": t["main_start"] - t["launched"],
            "imports + rendezvous": t["dist_ready"] - t["main_start"],
            "model build": t["load_start"] - t["dist_ready"],
        } if not startup.get("in_place") else {"model build": t["load_start"] - t["dist_ready"]}  # fmt: skip
        out.append({
            "from": sw["from"], "to": sw["to"], "checkpoint_bytes": size, "total_s": t["first_step"] - t["decision"],
            "scheduler_switch_cost_s": completes[i]["switch_cost_s"] if i < len(completes) else None,
            "phases_s": phases, "launch_parts_s": launch_parts, "timestamps": t,
        })  # fmt: skip
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    from cona.orchestrator.job import job_to_dict

    return {
        "model": model, "mode": "in-place" if in_place else "relaunch", "num_params": job.model.num_params,
        "backend": profile.backend,
        "run_dir": str(root) if keep else None,
        "wall_s": wall, "switches": out, "job": job_to_dict(job),
    }  # fmt: skip


def measure_floor(num_bytes: int, directory: Path) -> dict[str, Any]:
    """Write + fsync `num_bytes` (at least 64 MiB), read them back, and time `python -c "import torch"`."""
    size = max(num_bytes, 64 << 20)
    chunk = os.urandom(1 << 20)
    writes, reads = [], []
    for _ in range(3):
        fd, name = tempfile.mkstemp(dir=directory, prefix=".bench-disk-")
        try:
            started = time.perf_counter()
            with os.fdopen(fd, "wb") as f:
                left = size
                while left > 0:
                    left -= f.write(chunk[: min(left, len(chunk))])
                f.flush()
                os.fsync(f.fileno())
            writes.append(size / (time.perf_counter() - started))
            started = time.perf_counter()
            with open(name, "rb") as f:
                while f.read(1 << 22):
                    pass
            reads.append(size / (time.perf_counter() - started))
        finally:
            os.unlink(name)
    imports = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        imports.append(time.perf_counter() - started)
    write_bw, read_bw, import_s = statistics.median(writes), statistics.median(reads), statistics.median(imports)
    return {"write_bytes_per_s": write_bw, "read_bytes_per_s": read_bw, "import_torch_s": import_s,
            "samples": {"write": writes, "read": reads, "import_torch": imports}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.switch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,50m", help="comma-separated: tiny, 50m")
    parser.add_argument("--modes", default="relaunch,in-place", help="comma-separated: relaunch, in-place")
    parser.add_argument("--profile", default="slurm/profiles/local-cpu.yaml")
    parser.add_argument("--keep", action="store_true", help="keep the run directories under runs/")
    parser.add_argument("--out", default=None, help="JSON to write: a bare name goes under benchmarks/results "
                        "(default switch.json, switch-<backend>.json for another backend)")
    args = parser.parse_args(argv)
    results = []
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in ("relaunch", "in-place"):
            parser.error(f"unknown mode {mode!r}; valid: relaunch, in-place")
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
        runs = []
        for mode in modes:
            print(f"switch benchmark: {model}, {mode} ...", file=sys.stderr, flush=True)
            runs.append(measure_run(model, in_place=mode == "in-place", profile_path=args.profile, keep=args.keep))
        size = max(s["checkpoint_bytes"] for run in runs for s in run["switches"])
        floor = measure_floor(size, REPO / "runs")
        for run in runs:
            for s in run["switches"]:
                b = s["checkpoint_bytes"]
                s["floor_s"] = b / floor["write_bytes_per_s"] + b / floor["read_bytes_per_s"] + floor["import_torch_s"]
                s["over_floor"] = s["total_s"] / s["floor_s"]
            run["floor"] = floor
            results.append(run)
    backend = results[0]["backend"] if results else "local"
    # One file per backend: a Slurm run does not replace the local backend's numbers.
    name = "switch.json" if backend == "local" else f"switch-{backend}.json"
    path = write_json(args.out or name, {"benchmark": "switch", "profile": args.profile,
                                      "strategies": [STRATEGY_A, STRATEGY_B], "models": results})  # fmt: skip
    rows = []
    for run in results:
        f = run["floor"]
        for i, s in enumerate(run["switches"]):
            short = f"{s['from']['dp']}×{s['from']['pp']}→{s['to']['dp']}×{s['to']['pp']}"
            rows.append([
                f"{run['model']} ({run['num_params'] / 1e6:.1f}M) {run['mode']} #{i + 1} dp×pp {short}",
                f"{s['checkpoint_bytes'] / 1e6:.1f} MB", *(fmt_s(s["phases_s"][p]) for p in PHASES),
                fmt_s(s["total_s"]), fmt_s(s["floor_s"]), f"{s['over_floor']:.2f}×",
            ])  # fmt: skip
        print(f"{run['model']} {run['mode']}: floor parts: write {f['write_bytes_per_s'] / 1e6:,.0f} MB/s, read "
              f"{f['read_bytes_per_s'] / 1e6:,.0f} MB/s, python -c 'import torch' {f['import_torch_s']:.2f} s; "
              f"launch+rdzv (in place: rebuild) parts of switch #1: "
              + ", ".join(f"{k} {fmt_s(v)}" for k, v in run["switches"][0]["launch_parts_s"].items()))  # fmt: skip
    print(f"JSON {shown(path)}")
    print_table(f"switch cost on the {backend} backend (decision → first step under the new strategy)",
                ["switch", "checkpoint", *PHASES, "total", "floor", "total/floor"], rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
