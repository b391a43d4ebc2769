"""The `cona` command line. Each subcommand is a small function; user errors exit 2 with one line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cona.orchestrator.backends import BACKENDS
from cona.orchestrator.backends.base import BackendError
from cona.protocol.yamlconfig import ConfigError


class UserError(Exception):
    """Any error the user can fix; printed as `cona: error: <message>` with exit code 2."""


def _add_config_args(parser: argparse.ArgumentParser, *, profile_required: bool = True) -> None:
    parser.add_argument(
        "--profile", required=profile_required, metavar="PROFILE.yaml",
        help="cluster profile: nodes, devices, network, storage and backend settings",
    )
    parser.add_argument("--job", required=True, metavar="JOB.yaml", help="job spec: model, data, batch bounds, target, policy")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a job field by its dotted path, e.g. --set optimizer.lr=3e-4 (repeatable)",
    )  # fmt: skip


def cmd_plan(args: argparse.Namespace) -> int:
    from cona.orchestrator.job import load_job
    from cona.orchestrator.planner import enumerate_candidates, rank_by_iter_time
    from cona.orchestrator.profile import load_profile

    profile = load_profile(args.profile)
    job = load_job(args.job, args.overrides)
    gbs_values = [args.gbs] if args.gbs else None
    candidates = enumerate_candidates(profile=profile, job=job, gbs_values=gbs_values)
    ranked = rank_by_iter_time(candidates)
    shown = ranked if args.top <= 0 else ranked[: args.top]
    rejected = [c for c in candidates if not c.feasible] if args.all else []
    if args.json:
        print(json.dumps([c.to_dict() for c in shown + rejected], indent=1))
        return 0
    from cona.orchestrator.tables import print_plan

    print_plan(profile=profile, job=job, shown=shown, rejected=rejected, num_feasible=len(ranked), num_total=len(candidates))
    return 0


def _policy_overrides(policy: str | None) -> list[str]:
    """`--policy cona|static|fixed:<strategy>|schedule` as job overrides."""
    if policy is None:
        return []
    name, _, strategy = policy.partition(":")
    valid = ("cona", "static", "fixed", "schedule")
    if name not in valid:
        import difflib

        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"--policy {policy!r}: {hint}valid: cona, static, fixed:<strategy>, schedule")
    overrides = [f"policy.name={name}"]
    if name == "fixed":
        if not strategy:
            raise UserError("--policy fixed needs a strategy, e.g. --policy fixed:dp=2,tp=1,pp=2,mbs=2,gbs=32")
        overrides.append(f"policy.strategy={strategy}")
    return overrides


def cmd_run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from cona.orchestrator.backends import make_backend
    from cona.orchestrator.job import load_job
    from cona.orchestrator.live import LiveView
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.runstate import RunLock, create_run, load_run
    from cona.orchestrator.scheduler import RunFailed, Scheduler
    from cona.protocol.rundir import RunDir

    if args.resume:
        run_dir = RunDir(Path(args.resume))
        if args.profile or args.job:
            raise UserError("--resume takes the profile and job from the run directory; drop --profile/--job")
        profile, job = load_run(run_dir)
    else:
        if not args.profile or not args.job:
            raise UserError("give --profile and --job (or --resume RUN_DIR)")
        profile = load_profile(args.profile)
        job = load_job(args.job, [*args.overrides, *_policy_overrides(args.policy)])
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = RunDir(Path(args.run_dir) if args.run_dir else Path(profile.storage.run_root) / f"{job.name}-{stamp}")
        if run_dir.run_yaml.exists():
            profile, job = load_run(run_dir)  # the same command again: resume, never overwrite
        else:
            create_run(run_dir=run_dir, profile=profile, job=job)
    view = LiveView(run_dir=run_dir, job=job, quiet=args.quiet)
    with RunLock(run_dir.lock):
        scheduler = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=make_backend(profile=profile, run_dir=run_dir, job=job),
                              on_update=view.update)  # fmt: skip
        view.begin(scheduler)
        try:
            state = scheduler.run()
        except RunFailed as e:
            view.end(scheduler)
            raise UserError(str(e)) from None
        view.end(scheduler)
    if not args.no_report and state.status in ("done", "stopped"):
        from cona.orchestrator.report import write_report

        png, md = write_report(run_dir)
        print(f"report: {md} and {png}")
    return 0 if state.status in ("done", "stopped") else 1


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cona.orchestrator.live import status_summary
    from cona.protocol.rundir import RunDir

    summary = status_summary(RunDir(Path(args.run_dir)))
    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True))
    else:
        from cona.orchestrator.live import print_status

        print_status(summary)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cona.orchestrator.runstate import load_run, log_event
    from cona.protocol.rundir import ControlRecord, RunDir

    run_dir = RunDir(Path(args.run_dir))
    load_run(run_dir)  # a clear error when this is not a run directory
    current = run_dir.read_control()
    seq = (current.seq if current else 0) + 1
    run_dir.write_control(ControlRecord(seq=seq, command="stop", reason="cona stop"))
    log_event(run_dir, "stop-command", seq=seq)
    print(f"asked {run_dir.root} to stop: the trainer checkpoints at its next step boundary and exits")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cona.orchestrator.report import write_report
    from cona.orchestrator.runstate import load_run
    from cona.protocol.rundir import RunDir

    run_dir = RunDir(Path(args.run_dir))
    load_run(run_dir)
    png, md = write_report(run_dir, out_dir=Path(args.out) if args.out else None)
    print(f"wrote {md} and {png}")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from cona.orchestrator.backends import backend_class
    from cona.orchestrator.job import load_job
    from cona.orchestrator.planner import enumerate_candidates
    from cona.orchestrator.policy import make_policy
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.throughput import ThroughputModel
    from cona.protocol.rundir import RunDir

    profile = load_profile(args.profile)
    job = load_job(args.job, args.overrides)
    if profile.backend != args.target:
        raise UserError(
            f"{args.profile}: backend is {profile.backend!r}; `cona render {args.target}` needs a {args.target} profile"
        )
    run_dir = RunDir(Path(args.run_dir or f"{profile.storage.run_root}/{job.name}-RUN"))
    # The strategy the run would start with: the policy's own choice over the feasible candidates.
    candidates = [c for c in enumerate_candidates(profile=profile, job=job) if c.feasible]
    if not candidates:
        raise UserError(f"no feasible strategy for {job.name} on {profile.name}; run `cona plan --all` to see why")
    policy = make_policy(job, profile=profile, candidates=candidates)
    strategy = policy.initial(candidates=candidates, throughput=ThroughputModel(candidates=candidates), samples=0)
    backend = backend_class(args.target)(run_dir=run_dir, profile=profile, job=job)
    sys.stdout.write(backend.render(strategy=strategy))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cona",
        description="Train LLMs while chaining parallelism strategies online (Slurm, Kubernetes or one machine).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan = sub.add_parser(
        "plan",
        help="list the feasible strategies, fastest per iteration first, and why the others are rejected",
        description="Enumerate every (dp, tp, pp, mbs, gbs) for the profile's devices, predict iteration time and "
        "memory per device with the analytical cost model, and rank the feasible ones by iteration time.",
    )
    _add_config_args(plan)
    plan.add_argument("--top", type=int, default=10, metavar="K", help="show the K fastest feasible strategies (0: all; default 10)")
    plan.add_argument("--all", action="store_true", help="also list every rejected strategy with its reason")
    plan.add_argument("--gbs", type=int, default=None, help="only consider this global batch size")
    plan.add_argument(
        "--json", action="store_true",
        help="print a JSON list of {dp, tp, pp, mbs, gbs, feasible, reason, iter_time_s, samples_per_s, memory_gb}",
    )  # fmt: skip
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser(
        "run",
        help="train a job to its target, switching strategies online",
        description="Create a run directory, launch the first strategy and drive the run to its target: tail "
        "heartbeats, estimate the gradient noise scale, rank every feasible strategy by progress per second and "
        "switch when one is clearly better net of the switch cost. Running the same command again (or --resume) "
        "adopts or relaunches the run; it never starts a second attempt.",
    )
    run.add_argument("--profile", metavar="PROFILE.yaml", help="cluster profile (backend, devices, network, storage)")
    run.add_argument("--job", metavar="JOB.yaml", help="job spec")
    run.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a job field by its dotted path, e.g. --set target.val_perplexity=5.5 (repeatable)",
    )  # fmt: skip
    run.add_argument("--run-dir", metavar="DIR", help="run directory (default: storage.run_root/<job name>-<time>)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an existing run directory (its own profile and job)")
    run.add_argument(
        "--policy", metavar="POLICY",
        help="cona (switch online), static (fastest at batch.base_gbs), fixed:<strategy>, or schedule (policy.schedule)",
    )  # fmt: skip
    run.add_argument("--quiet", action="store_true", help="no live view; only the final summary")
    run.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    run.set_defaults(func=cmd_run)

    status = sub.add_parser("status", help="show where a run stands", description="Show a run's status, strategy, "
                            "progress, noise scale, switches and the latest decision.")  # fmt: skip
    status.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=cmd_status)

    stop = sub.add_parser("stop", help="ask a run to checkpoint and stop", description="Write a stop command to the "
                          "run's control.json: the trainer checkpoints at its next step boundary and exits; the "
                          "orchestrator marks the run stopped. Resume later with `cona run --resume RUN_DIR`.")  # fmt: skip
    stop.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    stop.set_defaults(func=cmd_stop)

    report = sub.add_parser("report", help="write a PNG and a Markdown summary of a run", description="Plot "
                            "validation loss against wall time with switches marked, the noise scale against samples "
                            "and throughput per strategy (report.png), and summarize the run (report.md).")  # fmt: skip
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    report.add_argument("--out", metavar="DIR", help="where to write (default: the run directory)")
    report.set_defaults(func=cmd_report)

    render = sub.add_parser("render", help="print what cona would run or submit (the Slurm batch script, the local "
                            "command, the Kubernetes manifests)",
                            description="Render the sbatch script `cona run` submits for a Slurm profile, with "
                            "every profile value shell-quoted, the local command, or the Kubernetes objects (headless "
                            "Service and Indexed Job) of a run's first attempt.")  # fmt: skip
    render.add_argument("target", choices=sorted(BACKENDS),
                        help="the backend (slurm: the batch script; local: the command; kubernetes: the manifests)")  # fmt: skip
    _add_config_args(render)
    render.add_argument("--run-dir", metavar="DIR", help="run directory to render for (default: a placeholder)")
    render.set_defaults(func=cmd_render)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UserError, ValueError) as e:
        print(f"cona: error: {e}", file=sys.stderr)
        return 2
    except BackendError as e:
        print(f"cona: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cona: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
