"""The `cona` command line. Each subcommand is a small function; user errors exit 2 with one line on stderr."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.orchestrator.backends import BACKENDS
from cona.orchestrator.backends.base import BackendError
from cona.protocol.yamlconfig import ConfigError

if TYPE_CHECKING:
    from cona.orchestrator.job import Job
    from cona.orchestrator.profile import ClusterProfile
    from cona.protocol.rundir import RunDir
    from cona.protocol.strategy import Strategy


DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "local-cpu.yaml"
"""The embedded local default (`slurm/profiles/local-cpu.yaml`, installed with the package): one machine, 4 trainer
processes on the CPU. What `cona run`, `plan` and `profile` use without `--profile`."""


class UserError(Exception):
    """Any error the user can fix; printed as `cona: error: <message>` with exit code 2."""


def _add_config_args(
    parser: argparse.ArgumentParser, *, profile_required: bool = True, job_required: bool = True,
    profile_default: bool = False,
) -> None:  # fmt: skip
    parser.add_argument(
        "--profile", required=profile_required and not profile_default, metavar="PROFILE.yaml",
        default=str(_shown_default()) if profile_default else None,
        help="cluster profile: nodes, devices, network, storage and backend settings"
        + (" (default: the embedded local one, 4 CPU processes on this machine)" if profile_default else ""),
    )
    parser.add_argument(
        "--profile-set", dest="profile_overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a profile field by its dotted path, e.g. --profile-set kubernetes.image=reg/cona:1 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--job", required=job_required, metavar="JOB.yaml", help="job spec: model, data, batch bounds, target, policy")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a job field by its dotted path, e.g. --set optimizer.lr=3e-4 (repeatable)",
    )  # fmt: skip


def _shown_default() -> Path:
    """`DEFAULT_PROFILE` as a user would write it: relative to the working directory when it lies below it."""
    try:
        return DEFAULT_PROFILE.relative_to(Path.cwd())
    except ValueError:
        return DEFAULT_PROFILE


def cmd_plan(args: argparse.Namespace) -> int:
    from cona.orchestrator.job import load_job
    from cona.orchestrator.planner import (
        batch_hint,
        device_hint,
        enumerate_candidates,
        memory_hint,
        rank_by_iter_time,
        ties_with_best,
    )
    from cona.orchestrator.profile import load_profile

    if args.top < 0:
        raise UserError(f"--top {args.top}: give a positive count, or 0 for every feasible strategy")
    profile = load_profile(args.profile, args.profile_overrides)
    job = load_job(args.job, args.overrides)
    if args.gbs is not None and args.gbs <= 0:
        raise UserError(f"--gbs {args.gbs}: give a positive global batch size (or leave --gbs out for every one)")
    gbs_values = [args.gbs] if args.gbs else None
    measured = None
    if args.measured:
        if args.gbs is not None or job.policy.name != "cona":
            raise UserError("--measured says where the cona policy would start from measured step times; drop --gbs "
                            "(and --set policy.name)")  # fmt: skip
        from cona.orchestrator.profiling import load_compatible

        measured = load_compatible(args.measured, profile, job)
    candidates = enumerate_candidates(profile=profile, job=job, gbs_values=gbs_values)
    ranked = rank_by_iter_time(candidates)
    if not ranked and not args.all and not args.json:
        at = f" at --gbs {args.gbs}" if args.gbs else ""
        low, high = job.batch.min_gbs, job.batch.max_gbs
        if args.gbs and not low <= args.gbs <= high:  # then no other reason matters: say it alone
            raise UserError(f"no feasible strategy for {job.name} on {profile.name}{at}: it is outside the job's "
                            f"batch bounds [{low}, {high}]; give a --gbs within them, or widen them with --set "
                            f"batch.{'min' if args.gbs < low else 'max'}_gbs={args.gbs}")  # fmt: skip
        from cona.orchestrator.elastic import is_elastic

        # An elastic run starts on fewer nodes when nothing fits on all of them (`cona render` shows which).
        elastic = (f"the profile is elastic (min_nodes={profile.min_nodes}): a run starts on the largest node count "
                   "where a strategy fits, `--profile-set nodes=K` plans K nodes; ") if is_elastic(profile) else ""  # fmt: skip
        devices = device_hint(profile, job, profile.num_gpus, gbs_values, "--gbs" if args.gbs else "batch.max_gbs")
        raise UserError(f"no feasible strategy for {job.name} on {profile.name}{at} among {len(candidates)} "
                        f"candidates on all {profile.num_gpus} devices; {devices}"
                        f"{batch_hint(profile, job, profile.num_gpus, gbs_values)}"
                        f"{memory_hint(profile, candidates)}{elastic}run `cona plan --all` to see why each is rejected")  # fmt: skip
    from cona.orchestrator.throughput import ThroughputModel

    throughput = ThroughputModel(candidates=ranked)
    calibrated = None
    if measured is not None:
        # The measurements calibrate every layout (`ThroughputModel`): rank by those times, as `cona run --measured`
        # will, and show each one's source beside the cost model's prediction; ≈best on the same times.
        throughput.absorb(measured[0].measured)
        calibrated = {c.strategy: throughput.estimate(c) for c in ranked}
        order = sorted(ranked, key=lambda c: (calibrated[c.strategy][0], c.iter_time_s))
        ties = ties_with_best(ranked, time_s=lambda c: calibrated[c.strategy][0])
    else:
        order = ranked
        ties = ties_with_best(ranked)
    shown = order if args.top <= 0 else order[: args.top]
    rejected = [c for c in candidates if not c.feasible] if args.all else []
    if args.json:
        rows = []
        for c in shown + rejected:
            row = {**c.to_dict(), "within_model_error_of_best": c.strategy in ties}
            if calibrated is not None and c.strategy in calibrated:
                row.update(calibrated_iter_time_s=calibrated[c.strategy][0], calibrated_from=calibrated[c.strategy][1])
            rows.append(row)
        print(json.dumps(rows, indent=1))
        return 0
    from cona.orchestrator.tables import print_plan

    print_plan(profile=profile, job=job, shown=shown, rejected=rejected, num_feasible=len(ranked),
               num_total=len(candidates), ties=ties, calibrated=calibrated,
               measured_in=measured[1] if measured is not None else None)  # fmt: skip
    if ranked and args.gbs is None and job.policy.name == "cona":
        # The fastest iteration is not where cona starts: say where it does and why, as its first launch will.
        from cona.orchestrator.policy import make_policy

        policy = make_policy(job, profile=profile, candidates=ranked)
        measured_in = f" (with the step times measured in {measured[1]})" if measured is not None else ""
        start, reason = policy.start(candidates=ranked, throughput=throughput)
        print(f"cona starts on {start.short()}{measured_in}: {reason}")
    return 0


def _policy_overrides(policy: str | None, overrides: Sequence[str] = ()) -> list[str]:
    """`--policy cona|static|fixed:<strategy>|schedule` as job overrides, after the command's `--set` `overrides`."""
    if policy is None:
        return []
    # `--policy fixed:... --set policy.name=static`: the later override won without a word; which was meant is
    # the user's to say. (`--set policy.schedule=...` goes with `--policy schedule` and stays.)
    clash = [o for o in overrides if o.partition("=")[0].strip() in ("policy", "policy.name", "policy.strategy")]
    if clash:
        raise UserError(f"--policy {policy} and --set {clash[0]} both set the policy; give it once")
    name, _, strategy = policy.partition(":")
    valid = ("cona", "static", "fixed", "schedule")
    if name not in valid:
        import difflib

        # Case-blind: `CONA` (the project's name as written in prose) is as close to `cona` as `Static` to `static`.
        close = difflib.get_close_matches(name.lower(), valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"--policy {policy!r}: {hint}valid: cona, static, fixed:<strategy>, schedule")
    if strategy and name != "fixed":  # `static:dp=...` meant `fixed:dp=...`; dropping the text would run another policy
        raise UserError(f"--policy {policy!r}: only fixed takes a strategy after ':' (did you mean "
                        f"--policy fixed:{strategy}?); cona, static and schedule take none")  # fmt: skip
    overrides = [f"policy.name={name}"]
    if name == "fixed":
        if not strategy:
            raise UserError("--policy fixed needs a strategy, e.g. --policy fixed:dp=2,tp=1,pp=2,mbs=2,gbs=32")
        overrides.append(f"policy.strategy={strategy}")
    return overrides


def cmd_run(args: argparse.Namespace) -> int:
    import time

    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.runstate import load_run
    from cona.protocol.rundir import RunDir

    if args.resume:
        run_dir = RunDir(Path(args.resume))
        if args.profile or args.job or args.overrides or args.policy or args.run_dir or args.measured:
            raise UserError(
                "--resume takes the profile, job and policy (and any --measured step times) from the run directory; "
                "drop --profile/--job/--set/--policy/--run-dir/--measured (--profile-set slurm.*=... or env.*=... "
                "may change how an ended run's jobs are submitted)"
            )
        profile, job = load_run(run_dir, resume=True)  # a run.yaml cut short is refused, not run with defaults
        if args.profile_overrides:  # the fix a refused submission asked for: a QOS, an account, the time limit
            from cona.orchestrator.runstate import amend_profile

            profile = amend_profile(run_dir, args.profile_overrides, check=_check_backend_clients)
        else:
            _check_backend_clients(profile, run_dir)
    else:
        if not args.job:
            raise UserError("give --job (and --profile: the embedded local one without it), or --resume RUN_DIR")
        profile = load_profile(args.profile or _shown_default(), args.profile_overrides)
        job = load_job(args.job, [*args.overrides, *_policy_overrides(args.policy, args.overrides)])
        measured = None
        if args.measured:
            from cona.orchestrator.profiling import load_compatible

            measured = load_compatible(args.measured, profile, job)[0].measured
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = RunDir(Path(args.run_dir) if args.run_dir else Path(profile.storage.run_root) / f"{job.name}-{stamp}")
        profile, job = _create_or_same(run_dir, profile, job, measured=measured, source=args.job)
    from cona.orchestrator.scheduler import drive

    state, failure = drive(run_dir=run_dir, profile=profile, job=job, quiet=args.quiet)
    if failure is not None:
        raise UserError(failure)
    if not args.no_report and state.status in ("done", "stopped"):
        from cona.orchestrator.report import write_report

        png, md = write_report(run_dir)
        print(f"report: {md} and {png}")
    return 0 if state.status in ("done", "stopped") else 1


def _create_or_same(
    run_dir: RunDir, profile: ClusterProfile, job: Job, *, measured: list[dict[str, Any]] | None = None,
    source: str | None = None,
) -> tuple[ClusterProfile, Job]:  # fmt: skip
    """Create the run (its directory, policy, input files and backend clients checked first), or, when `run_dir`
    holds this very run (the same command again), its stored profile and job: resume, never overwrite. `source`:
    the job file, named in a refusal of its input."""
    from cona.orchestrator.runstate import create_run
    from cona.protocol.inputs import check_inputs

    if run_dir.run_yaml.exists():
        _check_backend_clients(profile, run_dir)
        return _same_run(run_dir, profile, job)
    _refuse_foreign_directory(run_dir)
    # Checked before the run exists, as a run's job is fixed once it does: a run directory created from a bad
    # schedule, or for data the trainer will refuse, would be resumed, bad input and all, by the corrected command.
    first_strategy(profile, job)
    check_inputs(job, source=source)  # the trainer's own checks of its files, on their names and sizes
    _check_backend_clients(profile, run_dir)
    create_run(run_dir=run_dir, profile=profile, job=job, measured=measured)
    return profile, job


def _refuse_foreign_directory(run_dir: RunDir) -> None:
    """UserError for a `--run-dir` that exists, holds files and is no run (no run.yaml): a run would scatter its
    files among the user's (`--run-dir .`, `--run-dir data`). An empty directory is used; a run's is resumed."""
    from cona.protocol.rundir import file_given_as_run_dir

    root = run_dir.root
    if (problem := file_given_as_run_dir(root, new=True)) is not None:  # "cannot create it (File exists)" said less
        raise UserError(f"--run-dir {problem}")
    if not root.is_dir() or run_dir.run_yaml.exists():
        return
    try:
        # A temporary file of a run.yaml whose writer died is a run's start, not the user's file.
        entries = [p.name for p in root.iterdir() if not p.name.startswith(f".{run_dir.run_yaml.name}.")]
    except OSError as e:
        raise UserError(f"--run-dir {root}: cannot list it ({e.strerror}); pick a readable directory") from None
    if entries:
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise UserError(f"--run-dir {root}: not a cona run directory (no run.yaml) and not empty ({shown}); pick a "
                        "new path, or an empty directory")  # fmt: skip


def _check_backend_clients(profile: ClusterProfile, run_dir: RunDir | None = None) -> None:
    """The backend's command-line clients and what it submits, before a run directory is created or an attempt
    launched: a Slurm profile without `sbatch` on PATH, or with an `extra_sbatch` entry, `python` or `setup` that its
    batch script cannot carry (checked only as it was rendered), left a run directory behind whose status said
    running."""
    if profile.backend == "slurm":
        from cona.orchestrator.backends.slurm.backend import check_clients, check_partition
        from cona.orchestrator.backends.slurm.script import render_batch_script

        # Raises ConfigError; the job's name is checked already.
        render_batch_script(profile, None, run_dir.root if run_dir is not None else Path.cwd() / "run", job_name="cona")
        check_clients()
        check_partition(profile)


def cmd_profile(args: argparse.Namespace) -> int:
    import time

    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.profiling import profiling_job
    from cona.orchestrator.scheduler import drive
    from cona.protocol.rundir import RunDir

    # `profiling_job` replaces the job's policy and target with its own schedule and end: a `--set` of them was
    # dropped without a word (`--set policy.name=static` profiled as always).
    for override in args.overrides:
        key = override.partition("=")[0].strip()
        if key in ("policy", "target", "policy.name", "policy.strategy", "policy.schedule") or key.startswith("target."):
            raise UserError(f"--set {override}: cona profile runs its own schedule over the strategies it measures "
                            "and ends after the last, so it reads no policy or target; drop it (it is for cona run)")  # fmt: skip
    profile = load_profile(args.profile, args.profile_overrides)
    job, strategies, steps = profiling_job(profile, load_job(args.job, args.overrides), top=args.top,
                                           strategies=args.strategies, steps=args.steps)  # fmt: skip
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{job.name}-profile-{stamp}"
    run_dir = RunDir(Path(args.run_dir) if args.run_dir else Path(profile.storage.run_root) / name)
    profile, job = _create_or_same(run_dir, profile, job, source=args.job)
    print(f"cona profile: {len(strategies)} strategies, {steps} steps each ({', '.join(s.short() for s in strategies)}),"
          f" in {run_dir.root}")  # fmt: skip
    state, failure = drive(run_dir=run_dir, profile=profile, job=job, quiet=args.quiet)
    if failure is not None:
        raise UserError(failure)
    if state.status != "done":
        raise UserError(f"{run_dir.root}: the profiling run ended {state.status}; go on with the same command and "
                        f"--run-dir {run_dir.root}")  # fmt: skip
    from cona.orchestrator.profiling import finish_profile

    print(finish_profile(run_dir, profile=profile, job=job, state=state))
    return 0


def _same_run(run_dir: RunDir, profile: ClusterProfile, job: Job) -> tuple[ClusterProfile, Job]:
    """The stored profile and job of an existing `run_dir`, if they are the ones asked for (the same command run
    again); UserError when the command names another job or profile, which resuming would silently drop."""
    from cona.orchestrator.job import job_to_dict
    from cona.orchestrator.runstate import load_run

    stored_profile, stored_job = load_run(run_dir, resume=True)
    asked = job.model_copy(deep=True)
    asked.data.path = str(Path(job.data.path).resolve())  # as create_run stored it
    changed = [name for name, a, b in (
        ("profile", profile.model_dump(mode="json"), stored_profile.model_dump(mode="json")),
        ("job", job_to_dict(asked), job_to_dict(stored_job)),
    ) if a != b]  # fmt: skip
    if changed:
        raise UserError(
            f"--run-dir {run_dir.root} holds a run with another {' and '.join(changed)}; resume it as it is with "
            f"`cona run --resume {run_dir.root}`, or pick another --run-dir"
        )
    return stored_profile, stored_job


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cona.orchestrator.live import status_summary
    from cona.protocol.rundir import RunDir

    if _remote(args):
        from cona.orchestrator.backends.kubernetes.remote import remote_status

        with _no_cluster_is_no_run(args):
            summary = remote_status(args.run_dir, namespace=_namespace(args))
    else:
        summary = status_summary(RunDir(Path(args.run_dir)))
    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True))
    else:
        from cona.orchestrator.live import print_status

        print_status(summary)
    return 0


NEVER_STARTED_S = 60.0
"""A run directory this old with no orchestrator lock, no attempt and no state was never started (`cmd_stop`)."""


def cmd_stop(args: argparse.Namespace) -> int:
    from cona.orchestrator.runstate import load_run, read_state, request_stop
    from cona.protocol.rundir import RunDir

    if _remote(args):
        from cona.orchestrator.backends.kubernetes.remote import remote_stop

        with _no_cluster_is_no_run(args):
            print(remote_stop(args.run_dir, namespace=_namespace(args)))
        return 0
    from cona.orchestrator.live import orphaned

    run_dir = RunDir(Path(args.run_dir))
    profile, job = load_run(run_dir)  # a clear error when this is not a run directory
    state = read_state(run_dir)
    if state.final:
        print(f"{run_dir.root} already ended ({state.status}); nothing to stop")
        return 0
    import time

    never = state.status == "created" and not state.attempts and not run_dir.lock.exists()
    if never and time.time() - run_dir.run_yaml.stat().st_mtime > NEVER_STARTED_S:
        # No orchestrator ever took this run: a stop written now would be acted on by the next `cona run --resume`,
        # which would stop after its first step. (Within NEVER_STARTED_S of its creation `cona run` may be about
        # to take it: the stop is written, and that orchestrator acts on it.)
        print(f"{run_dir.root} was created but never started; nothing to stop (no stop command written); start it "
              f"with `cona run --resume {run_dir.root}`")  # fmt: skip
        return 0
    orphan = orphaned(run_dir, profile=profile, job=job, state=state)
    if orphan is not None and orphan.stopped:
        print(f"{run_dir.root} is stopped already (its trainer served a stop while its orchestrator was gone); "
              f"nothing to stop; resume it with `cona run --resume {run_dir.root}`")  # fmt: skip
        return 0
    if orphan is not None and orphan.trainer_seen_s is None:
        # Nobody would act on a stop now, so the next `cona run --resume` would: it would stop after one step.
        trainer = (f"attempt {orphan.attempt}'s trainer is gone too ({orphan.trainer_end})" if orphan.trainer_end
                   else "no trainer of it has written lately")  # fmt: skip
        print(f"{run_dir.root} is not running: its orchestrator (pid {orphan.pid}) is gone and {trainer}; nothing to "
              f"stop (no stop command written); resume it with `cona run --resume {run_dir.root}`")  # fmt: skip
        return 0
    # An orchestrator gone, its trainer trains on unattended and reads control.json itself: the stop is for that
    # trainer alone, so that it cannot outlive it (a crash before it served it must not stop the next resume).
    request_stop(run_dir, attempt=orphan.attempt if orphan is not None else None)
    if orphan is not None:
        seen = "'s trainer is still writing" if orphan.heartbeating else " was launched lately (no heartbeat yet)"
        print(f"asked {run_dir.root} to stop: its orchestrator (pid {orphan.pid}) is gone, but attempt {orphan.attempt}"
              f"{seen}; it checkpoints at its next step boundary and exits; resume later with "
              f"`cona run --resume {run_dir.root}` (the stop is for this trainer alone: a resume goes on training)")  # fmt: skip
        return 0
    print(f"asked {run_dir.root} to stop: the trainer checkpoints at its next step boundary and exits")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cona.orchestrator.report import write_report
    from cona.orchestrator.runstate import load_run
    from cona.protocol.rundir import RunDir

    if _remote(args):
        from cona.orchestrator.backends.kubernetes.remote import remote_report

        out = Path(args.out or f"{args.run_dir}-report")
        with _no_cluster_is_no_run(args):
            md, fetched = remote_report(args.run_dir, namespace=_namespace(args), out_dir=out)
        print(f"wrote {md}" + (f" and {fetched}" if fetched else ""))
        return 0
    run_dir = RunDir(Path(args.run_dir))
    load_run(run_dir)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out}: a file, not a directory; give a directory for the report")
    try:
        png, md = write_report(run_dir, out_dir=Path(args.out) if args.out else None)
    except OSError as e:
        if args.out or e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC):
            raise
        # A run directory on a read-only mount or another user's (an archive, a colleague's run) is still
        # readable: the report can go elsewhere.
        raise UserError(f"{e.filename or run_dir.root}: {e.strerror}; write the report elsewhere with --out DIR") from None
    print(f"wrote {md} and {png}")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from cona.orchestrator.backends import backend_class
    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile
    from cona.protocol.rundir import RunDir

    profile = load_profile(args.profile, args.profile_overrides)
    job = load_job(args.job, [*args.overrides, *_policy_overrides(args.policy, args.overrides)])
    if profile.backend != args.target:
        raise UserError(
            f"{args.profile}: backend is {profile.backend!r}; `cona render {args.target}` needs a {args.target} profile"
        )
    run_dir = RunDir(Path(args.run_dir or f"{profile.storage.run_root}/{job.name}-RUN"))
    backend = backend_class(args.target)(run_dir=run_dir, profile=profile, job=job)
    sys.stdout.write(backend.render(strategy=first_strategy(profile, job)))
    return 0


def first_strategy(profile: ClusterProfile, job: Job) -> Strategy:
    """The strategy a run would start with: the policy's own choice over the feasible candidates."""
    from itertools import chain

    from cona.orchestrator.elastic import node_range, startable_nodes
    from cona.orchestrator.planner import enumerate_candidates, no_feasible_strategy
    from cona.orchestrator.policy import make_policy
    from cona.orchestrator.scheduler import device_counts
    from cona.orchestrator.throughput import ThroughputModel

    # The candidates the scheduler plans with (a schedule may name smaller worlds). The run starts on all devices
    # when anything fits there (`RunModel.initial_strategy`), so the other node counts of an elastic range —
    # thousands on a large elastic profile — are enumerated only when nothing does: `startable_nodes` from the
    # top stops at the first count that can start.
    startable = startable_nodes(profile, job, descending=True)
    top = next(startable, None)
    # Worlds below the range that a `schedule`/`fixed` policy names (`device_counts`) are always its candidates.
    in_range = {n * profile.gpus_per_node for n in node_range(profile)}
    named = [c for d in device_counts(profile, job) if d not in in_range
             for c in enumerate_candidates(profile=profile, job=job, num_devices=d, feasible_only=True)]  # fmt: skip
    if top is not None and top[0] == profile.nodes:
        candidates = top[1] + named
    else:
        candidates = named + [c for _, pool in chain([top] if top else [], startable) for c in pool]
    if not candidates:
        raise UserError(no_feasible_strategy(profile, job))
    policy = make_policy(job, profile=profile, candidates=candidates)
    return policy.initial(candidates=candidates, throughput=ThroughputModel(candidates=candidates), samples=0)


def cmd_submit(args: argparse.Namespace) -> int:
    import time

    from cona.orchestrator.backends.kubernetes.render import render_attempt
    from cona.orchestrator.backends.kubernetes.runobjects import (
        RUN_NAME_MAX,
        dump_objects,
        render_submission,
        run_dir_for,
        run_name,
    )
    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile

    if args.resume:
        if args.profile or args.job or args.overrides or args.name or args.policy:
            raise UserError("--resume takes the profile and job from the run; drop --profile/--job/--set/--name/--policy "
                            "(--profile-set kubernetes.image=... may change how an ended run's pods are submitted)")  # fmt: skip
        if args.resume != run_name(args.resume):
            # No submitted run has such a name (`render_submission` refuses it), so no cluster is asked; a run
            # directory given here was answered "no such run directory" although it was one.
            if Path(args.resume).exists() or "/" in args.resume:
                raise UserError(f"--resume {args.resume}: a path, not the name of a submitted run; a run directory is "
                                f"resumed with `cona run --resume {args.resume}`")  # fmt: skip
            raise UserError(f"--resume {args.resume}: not the name of a submitted run (a DNS-1035 label of at most "
                            f"{RUN_NAME_MAX} characters, e.g. {run_name(args.resume)!r}); `cona submit` printed the "
                            "run's name")  # fmt: skip
        from cona.orchestrator.backends.kubernetes.remote import resume

        with _no_cluster_is_no_run(args, run=args.resume, directory=False):
            print(resume(args.resume, namespace=_namespace(args), profile_set=args.profile_overrides))
        return 0
    if args.namespace is not None:
        # A new run's objects all go to the profile's namespace (its workloads, Lease and PVC live there too):
        # an -n that named another one was silently ignored.
        raise UserError("-n/--namespace is for --resume; a new run goes to the profile's kubernetes.namespace: "
                        "set it there or give --profile-set kubernetes.namespace=NS")  # fmt: skip
    if not args.profile or not args.job:
        raise UserError("give --profile and --job (or --resume RUN)")
    profile = load_profile(args.profile, args.profile_overrides)
    job = load_job(args.job, [*args.overrides, *_policy_overrides(args.policy, args.overrides)])
    if profile.backend != "kubernetes":
        raise UserError(f"{args.profile}: backend is {profile.backend!r}; cona submit needs a kubernetes profile "
                        "(use `cona run` for local and slurm profiles)")  # fmt: skip
    if not Path(job.data.path).is_absolute():
        raise UserError(
            f"data.path {job.data.path!r} is relative: the pods read it in their own filesystem; give its absolute "
            f"path on the PVC, e.g. --set data.path={profile.kubernetes.mount_path}/data/{Path(job.data.path).name}"  # type: ignore[union-attr]
        )
    now = time.time()
    run = args.name or run_name(f"{job.name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}")
    objects = render_submission(profile=profile, job=job, run=run, submitted=now)
    # Everything the orchestrator will render is checked here, before anything is created on the cluster.
    render_attempt(profile=profile, strategy=first_strategy(profile, job), attempt=1, run_dir=run_dir_for(profile, run))
    if args.dry_run:
        sys.stdout.write(dump_objects(objects))
        return 0
    from cona.orchestrator.backends.kubernetes.remote import submit

    run, namespace = submit(objects)
    print(f"submitted run {run} to namespace {namespace}: ConfigMap {run} and orchestrator Job {objects[1]['metadata']['name']}")
    print(f"follow it: cona status {run} --namespace {namespace}   stop it: cona stop {run} --namespace {namespace}")
    return 0


def cmd_orchestrate(args: argparse.Namespace) -> int:
    from cona.orchestrator.backends.kubernetes.incluster import orchestrate

    return orchestrate(args.run, namespace=args.namespace, quiet=args.quiet)


def _remote(args: argparse.Namespace) -> bool:
    """Whether RUN names a run on Kubernetes rather than a run directory here: it is not a path that exists, and
    it is a bare name (a run's Kubernetes name has no `/`), or a namespace was given."""
    path = Path(args.run_dir)
    if path.exists() and args.namespace is not None:
        # Which one was meant is not ours to guess: the directory was read and -n dropped without a word.
        other = "" if "/" in args.run_dir else ", or give the run's name from a directory without that path"
        raise UserError(f"{args.run_dir}: a path here, but -n/--namespace {args.namespace} is for a run on Kubernetes; "
                        f"drop -n to use the path{other}")  # fmt: skip
    return not path.exists() and ("/" not in args.run_dir or args.namespace is not None)


@contextlib.contextmanager
def _no_cluster_is_no_run(args: argparse.Namespace, run: str | None = None, *, directory: bool = True) -> Iterator[None]:
    """RUN is no directory here and no Kubernetes API can be reached: most likely a mistyped run directory.
    `directory`: whether RUN may name a run directory at all (`cona submit --resume` takes only a run's name)."""
    try:
        yield
    except BackendError as e:
        if "cannot load the API configuration" not in str(e):
            raise
        if not directory:
            here = f"; a run directory here is resumed with `cona run --resume {run}`" if Path(str(run)).exists() else ""
            raise UserError(f"--resume {run}: no Kubernetes API to look for a submitted run of that name ({e}){here}") from None
        name = run or args.run_dir
        raise UserError(f"{name}: no such run directory, nor a Kubernetes API to look for a run of that name "
                        f"({e})") from None  # fmt: skip


def _namespace(args: argparse.Namespace) -> str:
    """--namespace, else the kubeconfig context's namespace (as kubectl), else `default`."""
    from cona.orchestrator.backends.kubernetes.api import context_namespace

    return args.namespace or context_namespace() or "default"


def build_parser() -> argparse.ArgumentParser:
    from cona.protocol.cliargs import OptionParser

    # A misspelled option is answered with the close one and the command's valid ones (`OptionParser`).
    parser = OptionParser(
        prog="cona",
        description="Train LLMs while chaining parallelism strategies online (Slurm, Kubernetes or one machine).",
    )
    from cona.orchestrator import cona_version

    parser.add_argument("--version", action="version", version=f"cona {cona_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan = sub.add_parser(
        "plan",
        help="list the feasible strategies, fastest per iteration first, and why the others are rejected",
        description="Enumerate every (dp, tp, pp, mbs, gbs) for the profile's devices, predict iteration time and "
        "memory per device with the analytical cost model, and rank the feasible ones by iteration time.",
    )
    _add_config_args(plan, profile_default=True)
    plan.add_argument("--top", type=int, default=10, metavar="K", help="show the K fastest feasible strategies (0: all; default 10)")
    plan.add_argument("--all", action="store_true", help="also list every rejected strategy with its reason")
    plan.add_argument("--gbs", type=int, default=None, help="only consider this global batch size")
    plan.add_argument("--measured", metavar="RUN_DIR",
                      help="say where cona would start from the step times a `cona profile` run measured")  # fmt: skip
    plan.add_argument(
        "--json", action="store_true",
        help="print a JSON list of {dp, tp, pp, mbs, gbs, feasible, reason, iter_time_s, samples_per_s, memory_gb, "
             "within_model_error_of_best}, one per row shown (--top 0: every feasible one; --all: the rejected too)",
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
    run.add_argument("--profile", metavar="PROFILE.yaml", help="cluster profile (backend, devices, network, storage; "
                     "default: the embedded local one, 4 CPU processes on this machine)")
    run.add_argument(
        "--profile-set", dest="profile_overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a profile field by its dotted path, e.g. --profile-set nodes=2 (repeatable)",
    )  # fmt: skip
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
    run.add_argument(
        "--measured", metavar="RUN_DIR",
        help="start from the step times a `cona profile` run measured (its run directory or measured.json)",
    )  # fmt: skip
    run.add_argument("--quiet", action="store_true", help="no live view; only the final summary")
    run.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    run.set_defaults(func=cmd_run)

    prof = sub.add_parser(
        "profile",
        help="measure a few strategies for some steps each on the real cluster; cona run --measured starts from them",
        description="Run the job for a few steps on each of a handful of strategies, switching in place between "
        "them (one run, the `schedule` policy): the base batch's fastest layout at each batch from half the base "
        "batch to four times it, then the base batch's other layouts once each. Prints measured against predicted step times and writes "
        "RUN_DIR/measured.json, which `cona run --measured RUN_DIR` starts its throughput model with.",
    )
    _add_config_args(prof, profile_default=True)
    prof.add_argument("--top", type=int, default=None, metavar="K", help="how many strategies to measure (default 6)")
    prof.add_argument(
        "--strategies", metavar="S;S;...",
        help="measure these instead, e.g. 'dp=4,tp=1,pp=1,mbs=8,gbs=32;dp=2,tp=1,pp=2,mbs=4,gbs=32'",
    )  # fmt: skip
    prof.add_argument("--steps", type=int, default=None, metavar="N",
                      help="steps per strategy (default: 15 heartbeats' worth)")  # fmt: skip
    prof.add_argument("--run-dir", metavar="DIR", help="run directory (default: storage.run_root/<job name>-profile-<time>)")
    prof.add_argument("--quiet", action="store_true", help="no live view; only the table")
    prof.set_defaults(func=cmd_profile)

    submit = sub.add_parser(
        "submit",
        help="start a run on Kubernetes: its ConfigMap and orchestrator Job (the run lives on the cluster's PVC)",
        description="Check the profile and job, then create the run's ConfigMap (resolved profile and job) and an "
        "orchestrator Job that drives the run next to its PVC, through the kubeconfig (or in-cluster config). "
        "Follow it with `cona status RUN`, stop it with `cona stop RUN`, fetch its report with `cona report RUN`.",
    )
    _add_config_args(submit, profile_required=False, job_required=False)
    submit.add_argument("--name", metavar="RUN", help="the run's name (default: <job name>-<time>), a DNS label")
    submit.add_argument("--resume", metavar="RUN", help="resume a stopped or failed submitted run (its own profile and "
                        "job) with a new orchestrator Job")  # fmt: skip
    submit.add_argument("-n", "--namespace", help="with --resume: the run's namespace (default: the kubeconfig's)")
    submit.add_argument("--policy", metavar="POLICY", help="as for cona run")
    submit.add_argument("--dry-run", action="store_true", help="print the objects (for kubectl apply -f -) instead")
    submit.set_defaults(func=cmd_submit)

    orchestrate = sub.add_parser(
        "orchestrate",
        help="what the orchestrator pod of a submitted run runs (not for use by hand)",
        description="Read run RUN's ConfigMap, create or resume its run directory on the PVC, hold its Lease and "
        "drive it, mirroring its status into the ConfigMap.",
    )
    orchestrate.add_argument("run", metavar="RUN", help="the run's name")
    orchestrate.add_argument("--namespace", required=True, help="the run's namespace")
    orchestrate.add_argument("--quiet", action="store_true", help="no live status lines, only events")
    orchestrate.set_defaults(func=cmd_orchestrate)

    status = sub.add_parser("status", help="show where a run stands", description="Show a run's status, strategy, "
                            "progress, noise scale, switches and the latest decision.")  # fmt: skip
    status.add_argument("run_dir", metavar="RUN", help="the run directory, or the name of a run on Kubernetes")
    status.add_argument("-n", "--namespace", help="the Kubernetes namespace of RUN (default: the kubeconfig's)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=cmd_status)

    stop = sub.add_parser("stop", help="ask a run to checkpoint and stop", description="Write a stop command to the "
                          "run's control.json: the trainer checkpoints at its next step boundary and exits; the "
                          "orchestrator marks the run stopped. Resume later with `cona run --resume RUN_DIR`.")  # fmt: skip
    stop.add_argument("run_dir", metavar="RUN", help="the run directory, or the name of a run on Kubernetes")
    stop.add_argument("-n", "--namespace", help="the Kubernetes namespace of RUN (default: the kubeconfig's)")
    stop.set_defaults(func=cmd_stop)

    report = sub.add_parser("report", help="write a PNG and a Markdown summary of a run", description="Plot "
                            "validation loss against wall time with switches marked, the noise scale against samples "
                            "and throughput per strategy (report.png), and summarize the run (report.md).")  # fmt: skip
    report.add_argument("run_dir", metavar="RUN", help="the run directory, or the name of a run on Kubernetes")
    report.add_argument("-n", "--namespace", help="the Kubernetes namespace of RUN (default: the kubeconfig's)")
    report.add_argument("--out", metavar="DIR", help="where to write (default: the run directory)")
    report.set_defaults(func=cmd_report)

    render = sub.add_parser("render", help="print what cona would run or submit (the Slurm batch script, the local "
                            "command, the Kubernetes manifests)",
                            description="Render the sbatch script `cona run` submits for a Slurm profile, with "
                            "every profile value shell-quoted, the local command, or the Kubernetes objects of a run's "
                            "first attempt (kubernetes.workload: a headless Service and an Indexed Job, a JobSet or a "
                            "TrainJob).")  # fmt: skip
    render.add_argument("target", choices=sorted(BACKENDS),
                        help="the backend (slurm: the batch script; local: the command; kubernetes: the manifests)")  # fmt: skip
    _add_config_args(render)
    render.add_argument("--run-dir", metavar="DIR", help="run directory to render for (default: a placeholder)")
    render.add_argument("--policy", metavar="POLICY", help="as for cona run (it decides the first strategy)")
    render.set_defaults(func=cmd_render)

    # Listed here for `cona --help`; `main` hands their arguments to the data plane's own program.
    sub.add_parser("export", add_help=False, help="write a run's checkpoint as a Hugging Face model directory "
                   "(cona export RUN_DIR [--step K] --format hf --out DIR; needs torch and safetensors)")  # fmt: skip
    sub.add_parser("data", add_help=False, help="tokenize text into the token files the trainer reads "
                   "(cona data prepare --tokenizer tokenizer.json --input TEXT --out DIR; needs tokenizers)")  # fmt: skip
    return parser


DATA_PLANE_COMMANDS = {"export": "cona.trainer.export", "data": "cona.trainer.prepare"}
"""Subcommands that are the data plane's programs: the control plane never imports the trainer or torch
(docs/architecture.md, "Import rules"), so `cona` runs them as `python -m MODULE ARGS` and returns their status
(they print their own one-line errors and exit 2 on bad input)."""


def run_data_plane(command: str, args: Sequence[str]) -> int:
    """Run the program in its own process; a SIGTERM sent to `cona` reaches it too (it went on alone, orphaned,
    writing its partial files), and Ctrl-C reaches it as the terminal's process group does."""
    import signal
    import subprocess
    import threading

    proc = subprocess.Popen([sys.executable, "-m", DATA_PLANE_COMMANDS[command], *args])
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the child has its Ctrl-C too: let it remove its partial files before the prompt
            proc.wait()
            raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _one_line(message: str) -> str:
    """`message` on one line: a value quoted in it (a path, a `--set` pair) may hold a newline or another control
    character of its own, shown escaped as Python would."""
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in message)


def main(argv: Sequence[str] | None = None) -> int:
    from cona.protocol.rundir import restrict_umask

    restrict_umask()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DATA_PLANE_COMMANDS:
        try:
            return run_data_plane(argv[0], argv[1:])
        except KeyboardInterrupt:
            print("cona: interrupted", file=sys.stderr)
            return 130
        except OSError as e:  # the interpreter cannot be started (permissions, a venv moved away)
            print(f"cona: error: cannot start {sys.executable} for `cona {argv[0]}`: {e.strerror or e}; check that "
                  "this user can run cona's Python", file=sys.stderr)  # fmt: skip
            return 2
    from cona.protocol.rundir import NotRegularFile

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UserError, ValueError, NotRegularFile) as e:
        print(f"cona: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except BackendError as e:
        print(f"cona: error: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cona: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:  # a path the command reads or writes (a file where a directory belongs, no permission)
        where = f"{e.filename}: " if e.filename else ""
        print(f"cona: error: {_one_line(where + (e.strerror or str(e)))}; check the path", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
