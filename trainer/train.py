"""The training loop of one attempt: resume, train step by step, evaluate, checkpoint, obey commands, exit.

Per optimizer step (all ranks in lockstep):

1. build the global batch [s, s + gbs) by sample index (`trainer.data`) and take this replica's slice;
2. forward/backward over the micro-batches (`trainer.parallel`), loss scaled to the global-batch token mean;
3. one all-reduce (SUM) of a few float64 scalars: loss, local/global gradient norms and their Adam variants,
   the tied-weight correction, rank 0's control command and time-budget flag, every rank's signal flag;
4. clip to `optimizer.grad_clip` with the all-reduced global norm, set the LR (`cona.protocol.lr`), AdamW step;
5. rank 0 appends the step's sample range to the samples log, then heartbeats; evaluation every
   `eval.interval_samples` samples; checkpoint every `checkpoint.interval_steps` steps and on command.

`--max-steps N` is an absolute optimizer step of the run (not a count for this process): the trainer stops once
`step == N`, after a checkpoint, with ExitCode.STOPPED (reason `max_steps`) in its exit record and process status 0
(`cona.protocol.rundir.process_exit_status`: a stop the user asked for is a normal end); a run already at or past N
exits at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from cona.protocol.heartbeat_record import NOTICE_EVENTS, Heartbeat, HeartbeatEvent, perplexity
from cona.protocol.job import JobSpec
from cona.protocol.lr import job_learning_rate
from cona.protocol.rundir import (
    HOLD_TIMEOUT_REASON,
    MAX_STEPS_REASON,
    ExitCode,
    ExitRecord,
    RunDir,
    SwitchPoints,
    atomic_write_json,
    stop_exit_reason,
)
from cona.protocol.samples_log import log_resume, log_step
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError
from cona.trainer import checkpoint as ckpt
from cona.trainer.control import Action, ControlState, decide
from cona.trainer.data import Batcher, Corpus
from cona.trainer.distributed import DistEnv, check_layout, communication_error
from cona.trainer.heartbeat import HeartbeatWriter, StepRecord
from cona.trainer.parallel import ParallelModel
from torch.profiler import record_function

PROGRESS_INTERVAL_S = 10.0
HOLD_HEARTBEAT_S = 5.0
HOLD_ROUND_S = 1.0
"""The longest the other ranks wait in one all-reduce of a hold for rank 0's news (`Trainer._hold`): far below
`parallel.collective_timeout_s`, and the most a signal that reached only them waits to end the hold."""


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf."""


def diverged_reason(*, step: int, loss: float, grad_sqnorm: float, first_val: dict[str, float] | None) -> str:
    """Why step `step` (1-based) is not finite, and what to do. Before any update (the run's first step), or when
    the validation at step 0 was already not finite, the model's output is not finite at its initial weights: no
    learning rate is to blame, so the advice is the model's settings; later it is the learning rate."""
    what = f"step {step}: loss {loss}, gradient norm² {grad_sqnorm}"
    untrained = first_val if first_val is not None and first_val.get("step") == 0 else None
    if untrained is not None and not math.isfinite(untrained["val_loss"]):
        what += f" (validation was already {untrained['val_loss']} at step 0)"
    elif step > 1:
        return f"{what}; lower optimizer.lr"
    return (f"{what}: not finite at the initial weights, before any update, so the learning rate is not the "
            "cause; check the model settings (model.norm_eps, model.rope_theta, the initialisation) or "
            "model.init_from's weights")


@dataclasses.dataclass
class TrainerState:
    """What `trainer_state.json` holds besides the DCP shards."""

    step: int = 0
    """Optimizer steps completed over the whole run."""
    samples: int = 0
    """Samples consumed: the data position (the next step starts at this sample index)."""
    tokens: int = 0
    lr: float = 0.0
    """The LR of the last step."""
    lr_position: int = 0
    """Samples at which the LR schedule stands (equals `samples`; kept explicit for readers)."""
    strategy: dict[str, int] = dataclasses.field(default_factory=dict)
    """The strategy this checkpoint was written under."""
    attempt: int = 0
    seed: int = 0
    job_name: str = ""
    time: float = 0.0
    elapsed_s: float = 0.0
    """Training wall time over all attempts (for target.max_time_s)."""
    val_history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """[{step, samples, val_loss, val_perplexity}] of every evaluation so far."""
    last_control_seq: int = -1
    """The newest control.json seq acted on, so a relaunch does not act on it again."""
    decision_due: bool = False
    """The step that reached `samples` crossed a switch point and the trainer had not acted on the orchestrator's
    decision when this was saved (a signal or a stop ended the hold, or came with the step). A trainer that
    resumes here under the same `strategy` — the same attempt run again after a Slurm requeue — holds for that
    decision before its first step, as the saver would have; one step more would move the switch past the point."""
    rng_state: str = ""
    version: int = ckpt.TRAINER_STATE_VERSION
    """The layout of this record (`checkpoint.TRAINER_STATE_VERSION`); a newer one is refused, naming it."""
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The model section of the job (`ModelSpec`, resolved): makes the checkpoint self-describing, so `cona export`
    needs no job file."""
    data_tokens: list[int] = dataclasses.field(default_factory=list)
    """[training, validation] tokens of the data it trained on (empty in checkpoints of earlier cona): the sample
    order is a function of the training split's length, so a resume on changed data is refused
    (`checkpoint.foreign_reason`)."""
    data_crc32: list[int] = dataclasses.field(default_factory=list)
    """[training, validation] fingerprints of that data (`TokenSequence.sample_crc32`; empty in checkpoints of
    earlier cona): another corpus of the same length is refused as well."""
    run_created: float | None = None
    """The run it belongs to: its run.yaml's `created` (None for a trainer started by hand with `--job`, and in
    checkpoints of earlier cona). A checkpoint of another run of the same job, seed and data — copied in — would
    resume at its own sample count, skipping or repeating samples of this run without a word."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass
class Trainer:
    job: JobSpec
    strategy: Strategy
    run_dir: RunDir
    attempt: int
    env: DistEnv
    corpus: Corpus
    max_steps: int | None = None
    dump_loaded_state: Path | None = None
    """Tests: after resuming, save the loaded state as a DCP checkpoint here (to compare with the saved one)."""
    startup: dict[str, float | None] = dataclasses.field(default_factory=dict)
    """Start-up timestamps (time.time()) for `attempts/<n>/startup.json`; `main` fills the ones before the Trainer."""
    control: ControlState = dataclasses.field(default_factory=ControlState)
    """Control and signal state; an in-place switch hands the previous attempt's on, so a signal that arrives while
    the model is rebuilt is not lost."""
    run_created: float | None = None
    """This run's identity, run.yaml's `created` (None: started by hand with `--job`); stamped into every checkpoint
    and checked on resume (`checkpoint.foreign_reason`)."""
    written: Path | None = None
    """The checkpoint the previous attempt of these processes saved just before an in-place switch: its checksums
    were computed from those bytes moments ago, so loading it does not read them all again to check them."""

    def __post_init__(self) -> None:
        self.rank = self.env.rank
        self.is_rank0 = self.rank == 0
        self.batcher = Batcher(self.job, self.corpus)
        self.model = ParallelModel(self.job, self.strategy, self.env, init_from=self._init_from())
        self._data_crc32 = [self.corpus.train.sample_crc32(), self.corpus.val.sample_crc32()]
        self.state = TrainerState(strategy=self.strategy.to_dict(), attempt=self.attempt, seed=self.job.seed,
                                  job_name=self.job.name, model=self.job.model.model_dump(mode="json"),
                                  data_tokens=self._data_tokens(), data_crc32=self._data_crc32,
                                  run_created=self.run_created)  # fmt: skip
        self.heartbeat = HeartbeatWriter(
            run_dir=self.run_dir, attempt=self.attempt, strategy=self.strategy.to_dict(), enabled=self.is_rank0
        )
        self.loaded_step: int | None = None
        self.saved: Path | None = None
        """The checkpoint this trainer saved last (an in-place switch hands it on as the next one's `written`)."""
        self._started = time.time()
        self._elapsed_base = 0.0
        self._eval_set = self._eval_tensors()
        self._last_print = -math.inf
        self._signal_reason = "signal"
        self._signalled_now = False
        self.exit_reason = ""
        """Set by `finish`: the exit record's reason (`main` turns code and reason into the process status)."""
        self.next_strategy: Strategy | None = None
        """Set when `run` returns SWITCH for an in-place switch: the strategy to rebuild with in these processes."""
        # Only the Adam-aware noise estimator reads the preconditioned norms; they are most of the statistics' cost.
        self._wants_adam = self.job.heartbeat.adam_stats
        try:  # every rank reads it, so a corrupt file stops all of them alike, before any collective
            self.switch_points: SwitchPoints = self.run_dir.read_switch_points()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._at_switch_point = False
        """Set by `step`: the step crossed a switch point, so the trainer holds for the orchestrator's decision."""
        self._hold_timed_out = False
        """Set by `_hold`: no decision came within the switch points' `wait_s`; exit for a relaunch at the point."""
        self._checkpointed_in_hold = False
        """Set by `_hold` on every rank: it served a `checkpoint` command, so `finish` saves again (see there)."""
        self._notices: list[tuple[HeartbeatEvent, str]] = []
        """Rank 0: (event, line) for each checkpoint `resume` passed over (`checkpoint-skipped`) or put back after an
        interrupted re-save (`checkpoint-restored`), reported in heartbeats of that event."""
        self.startup["model_ready"] = time.time()

    # Start-up -------------------------------------------------------------------------------------------------

    def _data_tokens(self) -> list[int]:
        """[training, validation] tokens of the corpus: what `TrainerState.data_tokens` records."""
        return [len(self.corpus.train), len(self.corpus.val)]

    def _init_from(self) -> str | None:
        """`model.init_from` when the run has no complete checkpoint yet (rank 0 decides for all), else None: a
        resumed run continues from its own checkpoint."""
        if self.job.model.init_from is None:
            return None
        shared: list[Any] = [None]
        if self.is_rank0:
            shared = [not self.run_dir.complete_checkpoints()]
        dist.broadcast_object_list(shared, src=0)
        if not shared[0]:
            return None
        if self.is_rank0:
            print(f"cona trainer: starting from the weights in {self.job.model.init_from}", flush=True)
        return self.job.model.init_from

    def _eval_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's contiguous share of the fixed validation windows."""
        windows = self.batcher.eval_windows()
        dp, r = self.strategy.dp, self.model.dp_rank
        per = math.ceil(len(windows.inputs) / dp)
        rows = slice(r * per, min(len(windows.inputs), (r + 1) * per))
        to = self.env.device
        return torch.from_numpy(windows.inputs[rows]).to(to), torch.from_numpy(windows.labels[rows]).to(to)

    def resume(self) -> None:
        """Load the newest intact checkpoint (any layout); fall back to older ones; fresh start if none."""
        shared: list[Any] = [None]
        if self.is_rank0:
            found = ckpt.resume_candidates(self.run_dir, self._notices)
            marked = self.run_dir.complete_checkpoints()
            refusal = functools.partial(ckpt.foreign_reason, job_name=self.job.name,
                                        model=self.job.model.model_dump(mode="json"), seed=self.job.seed,
                                        data_tokens=self._data_tokens(), data_crc32=self._data_crc32,
                                        run_created=self.run_created)  # fmt: skip
            foreign = next((r for p in found if (r := refusal(p))), None)
            shared = [([str(p) for p in found], bool(marked), foreign)]
        dist.broadcast_object_list(shared, src=0)  # every rank refuses alike, before any collective load
        paths, had_marked, foreign = shared[0]
        if foreign:
            raise ConfigError(foreign)
        self.startup["load_start"] = time.time()
        for path in paths:
            failed = None
            try:
                data = ckpt.load_checkpoint(Path(path), parts=self.model.parts, optimizers=self.model.optimizers,
                                            verify=Path(path) != self.written)  # fmt: skip
            except ckpt.CheckpointLoadError as e:  # a corrupt shard: every rank must fall back together
                failed, data = str(e), None
            except Exception as e:
                # A peer lost in the load's collectives says nothing of this checkpoint: falling back to an older one
                # would start another collective on the broken group (`communication_error`).
                broken = communication_error(e)
                if broken is not None:
                    raise broken from e
                failed, data = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None
            flag = torch.tensor([1.0 if failed else 0.0], device=self.env.device)
            dist.all_reduce(flag)
            if flag.item() == 0:
                self.state = TrainerState.from_dict(data)  # type: ignore[arg-type]
                self.loaded_step = self.state.step
                self._elapsed_base = self.state.elapsed_s
                if self.state.rng_state:
                    ckpt.set_rng_state(self.state.rng_state)
                self.control.last_seq = self.state.last_control_seq
                # A relaunch under another strategy (the schedule's for this sample) has made the switch already.
                self._at_switch_point = self.state.decision_due and self.state.strategy == self.strategy.to_dict()
                self.state.attempt, self.state.strategy = self.attempt, self.strategy.to_dict()
                self.state.model = self.job.model.model_dump(mode="json")
                # The same (checked above), or those of a checkpoint from before the check.
                self.state.data_tokens, self.state.data_crc32 = self._data_tokens(), self._data_crc32
                self.state.run_created = self.run_created if self.run_created is not None else self.state.run_created
                self.startup["load_end"] = time.time()
                return
            if self.is_rank0:
                message = f"skipping checkpoint {path}: cannot load it ({failed or 'failed on another rank'})"
                ckpt.warn(message)
                self._notices.append((HeartbeatEvent.CHECKPOINT_SKIPPED, message))
        if had_marked:
            # Not "remove them to start over": the orchestrator refuses a run with checkpointed progress and no
            # checkpoint (`RunDir.progress_without_checkpoint`), and training from 0 would throw that progress away.
            raise ConfigError(
                f"{self.run_dir.checkpoints}: no checkpoint can be loaded (the warnings before this line in the "
                "attempt's log name each and why); restore them from a backup and resume, or start over with a new "
                "--run-dir"
            )

    # The loop -------------------------------------------------------------------------------------------------

    def run(self) -> ExitCode:
        self.control.install_signal_handlers()
        self.resume()
        if self.dump_loaded_state is not None and self.loaded_step is not None:
            import torch.distributed.checkpoint as dcp

            state, _ = ckpt._state(self.model.parts, self.model.optimizers)
            dcp.save(state, checkpoint_id=str(self.dump_loaded_state))
        s = self.state
        if self.is_rank0:
            log_resume(self.run_dir, attempt=self.attempt, step=s.step, samples=s.samples)
            self.startup.setdefault("load_end", None)  # a fresh start loads nothing
            atomic_write_json(self.run_dir.attempt_dir(self.attempt) / "startup.json",
                              {**self.startup, "resumed_step": self.loaded_step})  # fmt: skip
            for event, message in self._notices:
                self._heartbeat(event=event, reason=message)
            self._heartbeat(event=HeartbeatEvent.RESUME if self.loaded_step is not None else HeartbeatEvent.START)
        if s.step == 0 and not s.val_history:
            self.evaluate()
        if self._at_switch_point and self._budget_reached() is None:  # resumed where the decision is due
            done = self._act(self._hold())
            if done is not None:
                return done
        while True:
            stop = self._budget_reached()
            if stop is not None:
                return self.finish(*stop)
            action, budget = self.step()
            evaluated = None
            if s.samples // self.job.eval.interval_samples > (s.samples - self.strategy.gbs) // self.job.eval.interval_samples:
                evaluated = self.evaluate()
            if s.step % self.job.heartbeat.interval_steps == 0 or evaluated is not None:
                self._heartbeat(event=HeartbeatEvent.EVAL if evaluated is not None else None, evaluated=evaluated)
            target = self.job.target.val_perplexity
            if evaluated is not None and target is not None and evaluated["val_perplexity"] <= target:
                return self.finish(ExitCode.DONE, f"target val_perplexity {target} reached")
            if budget:
                return self.finish(ExitCode.DONE, "target max_time_s reached")
            # At the run's last step there is nothing left to switch for.
            if self._at_switch_point and action not in (Action.SWITCH, Action.STOP) and self._budget_reached() is None:
                action = max(action, self._hold())
            done = self._act(action, periodic=s.step % self.job.checkpoint.interval_steps == 0)
            if done is not None:
                return done

    def _act(self, action: Action, *, periodic: bool = False) -> ExitCode | None:
        """Carry out the agreed action after a step or a hold: the exit code when the trainer ends (a switch, a stop),
        None when it trains on (after a checkpoint, when one is asked for or `periodic`)."""
        # A decision still due (a stop or a signal ended the hold) is saved as such; any other outcome settled it.
        self._at_switch_point = self._at_switch_point and action in (Action.SWITCH, Action.STOP)
        if action in (Action.SWITCH, Action.STOP):
            record = self.control.mark_handled() if self.is_rank0 else None
            if action == Action.SWITCH and self._hold_timed_out:
                wait = self.switch_points.wait_s
                return self.finish(ExitCode.SWITCH, f"{HOLD_TIMEOUT_REASON}: no decision {wait:g}s after samples "
                                                    f"{self.state.samples}; relaunch there under the schedule's strategy")  # fmt: skip
            if action == Action.SWITCH:
                self.next_strategy = self._in_place_target(record)
                how = f" in place to {self.next_strategy.short()}" if self.next_strategy else ""
                return self.finish(ExitCode.SWITCH, f"switch{how} (control seq {record.seq if record else '?'})")
            reason = self._signal_reason if self._signalled_now or record is None else stop_exit_reason(record.seq)
            return self.finish(ExitCode.STOPPED, reason)
        if action == Action.CHECKPOINT or periodic:
            self._checkpoint(requested=action == Action.CHECKPOINT)
        return None

    def _checkpoint(self, *, requested: bool) -> None:
        """Save and say so: for a `checkpoint` command (marked handled, its seq in the reason) or a periodic save."""
        reason = "periodic"
        if requested:
            record = self.control.mark_handled() if self.is_rank0 else None
            reason = f"checkpoint (control seq {record.seq if record else '?'})"
        self.save()
        self._heartbeat(event=HeartbeatEvent.CHECKPOINT, reason=reason)

    def _hold(self) -> Action:
        """Wait after a step that crossed a switch point until the orchestrator's decision arrives (`SwitchPoints`).

        Rank 0 says where it stands (a `hold` heartbeat: the orchestrator decides from heartbeats) and polls
        control.json; the others wait in the all-reduce that then shares the command, the signal flags and whether
        the wait timed out, as a step's does, once a command comes and at least every HOLD_ROUND_S (a round with
        none goes on holding). A signal ends the wait at once on rank 0, within a round on the others (a preemption
        must not wait for a decision). A `hold` heartbeat every HOLD_HEARTBEAT_S shows a restarted orchestrator a
        live trainer, not a hung one. A `checkpoint` command (a user's `cona checkpoint`) is served here and the hold goes on: it is no
        decision, and training on would move the switch off its step. No decision within `wait_s` returns SWITCH
        with `self._hold_timed_out` set: the trainer checkpoints at the point and exits for a relaunch there
        (`HOLD_TIMEOUT_REASON`), never training past it under the old strategy."""
        reason = f"switch point reached at samples {self.state.samples}"
        started = time.monotonic()
        beat = -math.inf
        while True:
            command, timed_out = Action.NONE, False
            if self.is_rank0:
                # In rounds of HOLD_ROUND_S: the others wait in the all-reduce below meanwhile, and no collective may
                # wait longer than `parallel.collective_timeout_s` (a decision may take minutes).
                round_end = time.monotonic() + HOLD_ROUND_S
                while not self.control.signalled:
                    if time.monotonic() - beat >= HOLD_HEARTBEAT_S:
                        self._heartbeat(event=HeartbeatEvent.HOLD, reason=reason)
                        beat = time.monotonic()
                    command = self.control.poll(self.run_dir, self.attempt)
                    if command is not Action.NONE:
                        break
                    if time.monotonic() - started > self.switch_points.wait_s:
                        timed_out = True
                        break
                    if time.monotonic() >= round_end:
                        break
                    time.sleep(0.05)
            vector = torch.tensor([float(command), *self._signal_flags(), 1.0 if timed_out else 0.0],
                                  dtype=torch.float64, device=self.env.device)  # fmt: skip
            dist.all_reduce(vector)
            command_v, sigterm, sigusr1, timed_out_v = vector.tolist()
            self._note_signals(sigterm, sigusr1)
            action = decide(command_code=command_v, signal_count=sigterm + sigusr1)
            if action == Action.CHECKPOINT:  # served without ending the hold (`_act` would settle the decision)
                self._checkpoint(requested=True)
                self._checkpointed_in_hold = True
                beat = -math.inf  # the checkpoint's heartbeat came last: say at once that the hold goes on
                continue
            if action == Action.NONE and timed_out_v > 0:
                self._hold_timed_out = True
                return Action.SWITCH
            if action == Action.NONE:  # a round without a decision
                continue
            return action

    def _signal_flags(self) -> tuple[float, float]:
        """This rank's SIGTERM and SIGUSR1 flags, for the all-reduce (a step's or a hold's) that sums them."""
        return (1.0 if self.control.signal_name == "SIGTERM" else 0.0,
                1.0 if self.control.signal_name == "SIGUSR1" else 0.0)  # fmt: skip

    def _note_signals(self, sigterm: float, sigusr1: float) -> None:
        """Keep the summed signal flags as the same reason text on every rank (`signal SIGTERM (2 ranks)`)."""
        signalled = {name: int(n) for name, n in (("SIGTERM", sigterm), ("SIGUSR1", sigusr1)) if n}
        self._signalled_now = bool(signalled)
        if signalled:
            self._signal_reason = "signal " + ", ".join(f"{name} ({n} rank{'s' * (n > 1)})" for name, n in signalled.items())

    def _in_place_target(self, record: Any) -> Strategy | None:
        """The strategy to continue with in these processes, agreed by all ranks; None to exit for a relaunch.

        Only rank 0 reads the run directory. In place needs the orchestrator's consent (`in_place`, given when its
        backend can keep watching the same processes), the next attempt's launch record (where the strategy comes
        from, as for every attempt) and a strategy that fits this world.
        """
        shared: list[Any] = [None]
        launch = self.run_dir.read_launch(self.attempt + 1) if self.is_rank0 and record is not None and record.in_place else None
        if launch is not None and launch.in_place:
            try:
                target = launch.strategy
                check_layout(self.job, target, world_size=self.env.world_size)
                shared = [target.to_dict()]
            except (ValueError, TypeError) as e:  # LayoutError is a ValueError: fall back to exit and relaunch
                print(f"cona trainer: switching by relaunch, not in place: {e}", flush=True)
        dist.broadcast_object_list(shared, src=0)
        return Strategy.from_dict(shared[0]) if shared[0] else None

    def _budget_reached(self) -> tuple[ExitCode, str] | None:
        s = self.state
        if self.max_steps is not None and s.step >= self.max_steps:
            return ExitCode.STOPPED, MAX_STEPS_REASON
        if s.samples >= self.job.target.max_samples:
            return ExitCode.DONE, "target max_samples reached"
        return None

    def step(self) -> tuple[Action, bool]:
        """One optimizer step over samples [s, s + gbs). Returns the agreed control action and budget flag."""
        s, strategy, model = self.state, self.strategy, self.model
        started = time.perf_counter()
        start, end = s.samples, s.samples + strategy.gbs
        # The named ranges show up in `torch.profiler` traces (benchmarks.gpu profiles a step); they cost nothing
        # otherwise.
        with record_function("cona.batch"):
            batch = self.batcher.samples(start, end)
            count = batch.num_targets
            rows = slice(model.dp_rank * strategy.local_batch, (model.dp_rank + 1) * strategy.local_batch)
            inputs = torch.from_numpy(np.ascontiguousarray(batch.inputs[rows])).to(self.env.device)
            labels = torch.from_numpy(np.ascontiguousarray(batch.labels[rows])).to(self.env.device)
        lr = job_learning_rate(self.job, samples=start, gbs=strategy.gbs)

        model.zero_grad()
        model.stats.begin_step(use_adam=s.step > 0 and self._wants_adam)
        with record_function("cona.forward_backward"):
            loss_sum = model.forward_backward(inputs, labels, scale=strategy.dp / max(1, count))
        with record_function("cona.statistics"):
            # The global terms count a tied head's two partial gradients as two parameters (`trainer.pipeline`), so
            # they are taken before the partials are summed; `tied_post - tied_pre` then turns them into the true
            # norm for clipping.
            global_sq, global_adam = model.stats.global_terms(model.parameters())
            tied_pre, tied_post = model.sync_tied()
            local_sq, local_adam = model.stats.local_terms()
        command, budget = Action.NONE, 0.0
        if self.is_rank0:
            command = self.control.poll(self.run_dir, self.attempt)
            max_time = self.job.target.max_time_s
            budget = 1.0 if max_time is not None and self._elapsed() >= max_time else 0.0
        weight = 1.0 / strategy.tp if model.computes_loss else 0.0
        vector = torch.stack([
            loss_sum * weight / max(1, count), local_sq, local_adam, global_sq, global_adam,
            tied_post - tied_pre,
            torch.tensor(float(command), dtype=torch.float64, device=self.env.device),
            *(torch.tensor(flag, dtype=torch.float64, device=self.env.device) for flag in self._signal_flags()),
            torch.tensor(budget, dtype=torch.float64, device=self.env.device),
            # Rank 0 alone decides whether this step crossed a switch point, so every rank holds after the same step.
            torch.tensor(1.0 if self.is_rank0 and self.switch_points.crossed(start, end) else 0.0,
                         dtype=torch.float64, device=self.env.device),
        ]).to(torch.float64)  # fmt: skip
        with record_function("cona.all_reduce"):
            dist.all_reduce(vector)
            values = vector.tolist()
        (loss, local_sq_v, local_adam_v, global_sq_v, global_adam_v, tied_fix, command_v, sigterm, sigusr1, budget_v,
         hold_v) = values  # fmt: skip
        self._at_switch_point = hold_v > 0
        self._note_signals(sigterm, sigusr1)
        clip_sq = global_sq_v + tied_fix
        if not (math.isfinite(loss) and math.isfinite(clip_sq)):
            raise TrainingDiverged(diverged_reason(step=s.step + 1, loss=loss, grad_sqnorm=clip_sq,
                                                   first_val=s.val_history[0] if s.val_history else None))  # fmt: skip
        with record_function("cona.optimizer"):
            model.clip_and_step(grad_sqnorm=clip_sq, max_norm=self.job.optimizer.grad_clip, lr=lr)
        step_time = time.perf_counter() - started

        s.step += 1
        s.samples = s.lr_position = end
        s.tokens += strategy.gbs * self.job.model.seq_len
        s.lr = lr
        if self.is_rank0:  # only after the optimizer update succeeded
            log_step(self.run_dir, attempt=self.attempt, step=s.step, start=start, end=end)
        has_local = model.stats.has_local
        use_adam = s.step > 1 and model.stats.enabled and self._wants_adam
        self.heartbeat.add_step(
            StepRecord(
                loss=loss,
                step_time_s=step_time,
                local_sqnorm=local_sq_v if has_local else None,
                local_batch=model.stats.local_batch(gbs=strategy.gbs, mbs=strategy.mbs) if has_local else None,
                global_sqnorm=global_sq_v,
                global_batch=strategy.gbs,
                adam_local_sqnorm=local_adam_v if has_local and use_adam else None,
                adam_global_sqnorm=global_adam_v if use_adam else None,
            )
        )
        return decide(command_code=command_v, signal_count=sigterm + sigusr1), budget_v > 0

    def _elapsed(self) -> float:
        return self._elapsed_base + (time.time() - self._started)

    # Evaluation, checkpoints, heartbeats, exit ------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        inputs, labels = self._eval_set
        loss_sum, count = self.model.eval_sums(inputs, labels)
        weight = 1.0 / self.strategy.tp
        vector = torch.tensor([loss_sum * weight, count * weight], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(vector)
        total, targets = vector.tolist()
        val_loss = total / max(1.0, targets)
        result = {
            "step": self.state.step,
            "samples": self.state.samples,
            "val_loss": val_loss,
            "val_perplexity": perplexity(val_loss),
        }
        self.state.val_history.append(result)
        if self.is_rank0 and self.state.step == 0:
            self._heartbeat(event=HeartbeatEvent.EVAL, evaluated=result)
        return result

    def save(self) -> None:
        s = self.state
        s.time = time.time()
        s.elapsed_s = self._elapsed()
        s.last_control_seq = self.control.last_seq
        s.decision_due = self._at_switch_point
        s.rng_state = ckpt.rng_state()
        payload = dataclasses.asdict(s)
        self.saved = ckpt.save_checkpoint(
            self.run_dir, step=s.step, parts=self.model.parts, optimizers=self.model.optimizers,
            trainer_state=payload, keep=self.job.checkpoint.keep,
        )  # fmt: skip
        self.loaded_step = s.step  # what is on storage now equals the live state

    def _heartbeat(
        self,
        *,
        event: HeartbeatEvent | None = None,
        evaluated: dict[str, float] | None = None,
        exit_code: int | None = None,
        reason: str | None = None,
    ) -> None:
        if not self.is_rank0:
            return
        s = self.state
        heartbeat = self.heartbeat.write(
            step=s.step,
            samples=s.samples,
            tokens=s.tokens,
            lr=s.lr,
            event=event,
            val_loss=evaluated["val_loss"] if evaluated else None,
            val_perplexity=evaluated["val_perplexity"] if evaluated else None,
            peak_memory_gb=_peak_memory_gb(self.env.device),
            exit_code=exit_code,
            reason=reason,
        )
        now = time.monotonic()
        # A notice (a checkpoint skipped or restored at resume) was said on stderr when it happened, also before a
        # resume that then fails (`ckpt.warn`); its heartbeat is the record in the run directory, not a second line.
        shown = event not in NOTICE_EVENTS
        if heartbeat is not None and shown and (event is not None or now - self._last_print >= PROGRESS_INTERVAL_S):
            self._last_print = now
            print(_progress_line(heartbeat), flush=True)

    def finish(self, code: ExitCode, reason: str) -> ExitCode:
        """Checkpoint (unless the state on storage is already this one), record the exit, return the code.

        After an in-place switch (`self.next_strategy`) the exit record says so: the checkpoint is complete before
        the record appears, and the orchestrator then watches the same processes as the next attempt.
        """
        self.exit_reason = reason
        # Also at step 0 (`--max-steps 0`): a checkpoint of the initial weights, e.g. of model.init_from. Again at
        # the same step after a `checkpoint` served during a hold: the decision that ended the hold came later, and
        # the checkpoint must hold its seq, or a resumed run would obey that `stop` again. (`_checkpointed_in_hold`
        # is known to every rank; only rank 0 knows the seq, and the save is collective.)
        if self.state.step != self.loaded_step or self._checkpointed_in_hold:
            self.save()
        if self.is_rank0:
            self._heartbeat(event=HeartbeatEvent.EXIT, exit_code=int(code), reason=reason)
            write_exit(self.run_dir, self.attempt, code=code, reason=reason, step=self.state.step,
                       next_strategy=self.next_strategy)  # fmt: skip
        dist.barrier()
        # Past the last collective: a peer may end now, and this rank with it (an in-place switch goes on instead).
        self.control.ending = self.next_strategy is None
        return code


def write_exit(
    run_dir: RunDir, attempt: int, *, code: ExitCode | int, reason: str, step: int | None,
    next_strategy: Strategy | None = None,
) -> None:  # fmt: skip
    """`attempts/<n>/exit.json` (see `RunDir.exit_file`); a plain int code is a crash (name CRASH).

    `next_strategy`: the processes go on in place as attempt n + 1 under it (`next_attempt`, `next_strategy`)."""
    name = code.name if isinstance(code, ExitCode) else "CRASH"
    run_dir.write_exit(attempt, ExitRecord(
        exit_code=int(code), name=name, reason=reason, step=step, time=time.time(),
        next_attempt=attempt + 1 if next_strategy is not None else None, next_strategy=next_strategy,
    ))  # fmt: skip


def _progress_line(hb: Heartbeat) -> str:
    """One human line per event and at most every PROGRESS_INTERVAL_S seconds on rank 0's stdout."""
    parts = [f"step {hb.step}", f"samples {hb.samples}"]
    if hb.train_loss is not None:
        parts.append(f"loss {hb.train_loss:.4f}")
    if hb.val_loss is not None:
        parts.append(f"val {hb.val_loss:.4f} (ppl {hb.val_perplexity:.2f})")
    parts.append(f"lr {hb.lr:.2e}")
    if hb.samples_per_s:
        parts.append(f"{hb.samples_per_s:.1f} samples/s")
    if hb.event:
        parts.append(f"[{hb.event}{': ' + hb.reason if hb.reason else ''}]")
    return "cona trainer: " + " | ".join(parts)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # CPU: the process's peak resident set (Linux reports KiB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
