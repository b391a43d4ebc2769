"""The `cona` command line. Each subcommand is a small function; user errors exit 2 with one line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from trainer.yamlconfig import ConfigError


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
    from orchestrator.planner import enumerate_candidates, rank_by_iter_time
    from orchestrator.profile import load_profile
    from trainer.job import load_job

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
    from orchestrator.tables import print_plan

    print_plan(profile=profile, job=job, shown=shown, rejected=rejected, num_feasible=len(ranked), num_total=len(candidates))
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

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UserError, ValueError) as e:
        print(f"cona: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cona: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
