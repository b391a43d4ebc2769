"""Unit tests of the trainer's pieces (no torchrun): data order, LR, samples audit, control, models, bad input."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import numpy as np
import pytest
from cona.protocol.job import PRESETS, JobSpec, ModelSpec, job_from_dict, load_job
from cona.protocol.lr import learning_rate, lr_scale_factor
from cona.protocol.rundir import ControlRecord, ExitCode, RunDir
from cona.protocol.samples_log import SamplesAuditError, audit_samples, log_resume, log_step
from cona.protocol.strategy import Strategy
from cona.trainer.control import Action, ControlState, decide
from cona.trainer.data import IGNORE_INDEX, Batcher, SampleOrder, load_corpus

try:
    from tests.trainer_helpers import REPO, corpus_path, trainer_env, write_job
except ImportError:  # tests/ is not a package here
    from trainer_helpers import REPO, corpus_path, trainer_env, write_job


def _job(preset: str = "tiny-gpt", **data) -> JobSpec:
    return job_from_dict({"model": {"preset": preset}, "data": {"path": str(corpus_path()), **data}})


# Data ---------------------------------------------------------------------------------------------------------


def test_sample_order_is_a_function_of_seed_and_index():
    order = SampleOrder(num_tokens=10_000, seq_len=64, window_len=65, seed=3)
    again = SampleOrder(num_tokens=10_000, seq_len=64, window_len=65, seed=3)
    indices = [0, 1, 150, 151, 152, 400, 7, 0]
    assert [order.start(i) for i in indices] == [again.start(i) for i in reversed(indices)][::-1]
    w = order.num_windows_per_epoch
    starts = [order.start(i) for i in range(w)]
    assert len(set(starts)) == w, "one epoch visits every window once"
    assert all(s >= 0 and s + 65 <= 10_000 for s in starts)
    assert [order.start(i) for i in range(w, 2 * w)] != starts, "each epoch has its own permutation"
    other = SampleOrder(num_tokens=10_000, seq_len=64, window_len=65, seed=4)
    assert [other.start(i) for i in range(20)] != starts[:20]


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-bert"])
def test_batches_do_not_depend_on_how_they_are_split(preset):
    job = _job(preset)
    batcher = Batcher(job, load_corpus(job))
    whole = batcher.samples(32, 64)
    # dp=4 replicas of 8 samples, each in micro-batches of 2, requested in a scrambled order
    pieces = {}
    for start in reversed(range(32, 64, 2)):
        pieces[start] = Batcher(job, load_corpus(job)).samples(start, start + 2)
    joined_inputs = np.concatenate([pieces[s].inputs for s in sorted(pieces)])
    joined_labels = np.concatenate([pieces[s].labels for s in sorted(pieces)])
    assert np.array_equal(whole.inputs, joined_inputs)
    assert np.array_equal(whole.labels, joined_labels)
    assert whole.inputs.shape == (32, job.model.seq_len)
    if preset == "tiny-gpt":  # next-token targets
        assert np.array_equal(whole.inputs[:, 1:], whole.labels[:, :-1])
        assert batcher.num_targets(32, 64) == 32 * 64
    else:  # masked positions only; mask ids where masked 80% of the time
        masked = whole.labels != IGNORE_INDEX
        assert 0.10 < masked.mean() < 0.20
        assert (whole.inputs[masked] == job.model.vocab_size - 1).mean() > 0.6
        assert np.array_equal(whole.inputs[~masked], batcher.samples(32, 64).inputs[~masked])
        assert batcher.num_targets(32, 64) == int(masked.sum())


def test_resume_position_continues_the_same_stream():
    """A run with gbs 16 for 3 steps then gbs 32 consumes exactly the samples of one stream [0, 80)."""
    job = _job()
    batcher = Batcher(job, load_corpus(job))
    consumed = [batcher.samples(s, s + 16) for s in (0, 16, 32)] + [batcher.samples(48, 80)]
    assert np.array_equal(np.concatenate([b.inputs for b in consumed]), batcher.samples(0, 80).inputs)


def test_validation_split_is_held_out(tmp_path):
    text = tmp_path / "c.txt"
    text.write_bytes(bytes(range(32, 127)) * 200)
    # 1,900 held-out bytes hold 29 windows of 65 (`eval.num_windows` may not ask for more)
    job = job_from_dict({"model": {"preset": "tiny-gpt"}, "data": {"path": str(text), "val_fraction": 0.1},
                         "eval": {"num_windows": 16}})  # fmt: skip
    corpus = load_corpus(job)
    assert len(corpus.train) + len(corpus.val) == 95 * 200
    assert len(corpus.val) == int(95 * 200 * 0.1)
    windows = Batcher(job, corpus).eval_windows()
    assert windows.inputs.shape == (job.eval.num_windows, 64)


def test_token_files_and_directories(tmp_path):
    tokens = (np.arange(20_000) % 1000).astype(np.uint16)
    tokens.tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", tokens.astype(np.uint32))
    for name in ("a.bin", "b.npy"):
        job = job_from_dict({"model": {"preset": "tiny-gpt", "vocab_size": 1000}, "data": {"path": str(tmp_path / name)},
                             "eval": {"num_windows": 8}})  # fmt: skip
        corpus = load_corpus(job)
        assert len(corpus.train) + len(corpus.val) == 20_000
        batch = Batcher(job, corpus).samples(0, 4)
        assert batch.inputs.max() < 1000 and np.array_equal(batch.inputs[:, 1:], batch.labels[:, :-1])
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "one.txt").write_text("a" * 5000)
    (texts / "two.txt").write_text("b" * 5000)
    job = job_from_dict({"model": {"preset": "tiny-gpt"}, "data": {"path": str(texts)}, "eval": {"num_windows": 4}})
    corpus = load_corpus(job)
    assert len(corpus.train) + len(corpus.val) == 10_000
    assert corpus.train.slice(4990, 5010).tolist() == [97] * 10 + [98] * 10


def test_bad_token_files_are_config_errors_naming_the_file(tmp_path):
    from cona.protocol.yamlconfig import ConfigError

    def job(name: str, vocab: int = 1000):
        return job_from_dict({"model": {"preset": "tiny-gpt", "vocab_size": vocab}, "data": {"path": str(tmp_path / name)},
                              "eval": {"num_windows": 8}})  # fmt: skip

    (tmp_path / "empty.bin").write_bytes(b"")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object))
    (np.arange(20_000) % 1200).astype(np.uint16).tofile(tmp_path / "wide.bin")
    with pytest.raises(ConfigError, match=r"empty.bin'?: 0 tokens are too few"):
        load_corpus(job("empty.bin"))
    with pytest.raises(ConfigError, match=r"objects.npy: not a NumPy array of token ids"):
        load_corpus(job("objects.npy"))
    # Ids beyond the vocabulary are found in the batch that holds them (no pass over the corpus at start-up).
    batcher = Batcher(job("wide.bin"), load_corpus(job("wide.bin")))
    with pytest.raises(ConfigError, match=r"wide.bin' holds token id 1\d{3}, beyond model.vocab_size=1000"):
        for start in range(0, 64, 8):
            batcher.samples(start, start + 8)


# Learning rate ------------------------------------------------------------------------------------------------


def test_lr_scaling_rules_and_caps():
    assert lr_scale_factor(gbs=64, base_gbs=16, rule="sqrt", cap=10) == pytest.approx(2.0)
    assert lr_scale_factor(gbs=64, base_gbs=16, rule="linear", cap=10) == pytest.approx(4.0)
    assert lr_scale_factor(gbs=64, base_gbs=16, rule="none", cap=10) == 1.0
    assert lr_scale_factor(gbs=256, base_gbs=16, rule="linear", cap=2.0) == 2.0
    assert lr_scale_factor(gbs=1, base_gbs=16, rule="linear", cap=2.0) == 0.5
    assert lr_scale_factor(gbs=16, base_gbs=16, rule="sqrt", cap=2.0) == 1.0


def test_lr_schedule_over_samples():
    job = job_from_dict(
        {
            "model": {"preset": "tiny-gpt"},
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_samples": 100, "decay_samples": 1100},
            "batch": {"base_gbs": 16, "min_gbs": 8},
        }
    )
    opt = job.optimizer

    def lr(samples, gbs=16):
        return learning_rate(opt, samples=samples, gbs=gbs, base_gbs=16, decay_samples=1100)

    assert lr(0) == pytest.approx(1e-3 * 16 / 100)
    assert lr(48) == pytest.approx(1e-3 * 64 / 100)
    assert lr(100) == pytest.approx(1e-3)
    assert lr(600) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr(1100) == pytest.approx(1e-4)
    assert lr(5000) == pytest.approx(1e-4)
    assert lr(100, gbs=64) == pytest.approx(2e-3)  # sqrt(64/16), under the default cap 2
    assert lr(1100, gbs=64) == pytest.approx(1e-4)
    # the shape depends on the sample position only; a larger batch scales the peak (the floor stays)
    assert lr(600, gbs=32) == pytest.approx(1e-4 + (math.sqrt(2) * 1e-3 - 1e-4) * 0.5)
    constant = opt.model_copy(update={"schedule": "constant"})
    assert learning_rate(constant, samples=5000, gbs=16, base_gbs=16, decay_samples=1100) == pytest.approx(1e-3)


# Samples audit ------------------------------------------------------------------------------------------------


def test_audit_accepts_truncated_attempts(tmp_path):
    run = RunDir(tmp_path)
    log_resume(run, attempt=0, step=0, samples=0)
    for k in range(1, 6):  # steps 1..5 of 16 samples; the checkpoint of step 4 is the last one written
        log_step(run, attempt=0, step=k, start=16 * (k - 1), end=16 * k)
    log_resume(run, attempt=1, step=4, samples=64)  # relaunch after a crash: step 5 is trained again
    log_step(run, attempt=1, step=5, start=64, end=80)
    log_step(run, attempt=1, step=6, start=80, end=112)  # gbs 32 from here on
    log_resume(run, attempt=1, step=6, samples=112)  # a torchrun restart in place, same attempt
    log_step(run, attempt=1, step=7, start=112, end=144)
    log_resume(run, attempt=3, step=7, samples=144)  # attempt 2 died before logging anything
    assert audit_samples(tmp_path) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80), (80, 112), (112, 144)]


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([("step", 1, 0, 16), ("step", 2, 20, 36)], "gap"),
        ([("step", 1, 0, 16), ("step", 2, 10, 26)], "overlap"),
        ([("step", 1, 0, 16), ("step", 3, 16, 32)], "expected 2"),
        ([("step", 1, 0, 16), ("resume", 2, 32)], "missing"),
        ([("step", 1, 0, 16), ("resume", 1, 20)], "resumes at sample 20"),
    ],
)
def test_audit_reports_lost_or_repeated_samples(tmp_path, records, message):
    run = RunDir(tmp_path)
    for record in records:
        if record[0] == "step":
            log_step(run, attempt=0, step=record[1], start=record[2], end=record[3])
        else:
            log_resume(run, attempt=0, step=record[1], samples=record[2])
    with pytest.raises(SamplesAuditError, match=message):
        audit_samples(run)


def test_audit_ignores_a_torn_last_line(tmp_path):
    run = RunDir(tmp_path)
    log_step(run, attempt=0, step=1, start=0, end=16)
    with open(run.samples_log / "0.jsonl", "a") as f:
        f.write('{"step": 2, "sta')
    assert audit_samples(run) == [(0, 16)]


# Control ------------------------------------------------------------------------------------------------------


def test_control_records_are_acted_on_once(tmp_path):
    run = RunDir(tmp_path)
    state = ControlState()
    assert state.poll(run) == Action.NONE
    run.write_control(ControlRecord(seq=1, command="checkpoint"))
    assert state.poll(run) == Action.CHECKPOINT
    assert state.poll(run) == Action.CHECKPOINT, "still pending until handled"
    assert state.mark_handled().seq == 1
    assert state.poll(run) == Action.NONE
    run.write_control(ControlRecord(seq=2, command="switch"))
    assert state.poll(run) == Action.SWITCH
    state.mark_handled()
    relaunched = ControlState(last_seq=state.last_seq)  # the seq travels in trainer_state.json
    assert relaunched.poll(run) == Action.NONE
    run.write_control(ControlRecord(seq=3, command="stop"))
    assert relaunched.poll(run) == Action.STOP
    (tmp_path / "control.json").write_text("{not json")
    assert relaunched.poll(run) == Action.NONE


def test_a_record_for_an_attempt_these_processes_went_on_from_in_place_is_theirs(tmp_path):
    """`cona stop` of a run whose orchestrator was gone names the attempt it saw the trainer run as; the processes
    may have switched in place since (attempt 1 went on as 2): the stop is theirs. A relaunch (other processes) never
    acts on a record for an attempt before it, nor anyone on one for a later attempt."""
    run = RunDir(tmp_path)
    state = ControlState()
    assert state.poll(run, 1) == Action.NONE  # launched as attempt 1
    run.write_control(ControlRecord(seq=1, command="stop", attempt=1))
    assert state.poll(run, 2) == Action.STOP  # gone on in place as attempt 2
    assert ControlState(last_seq=0).poll(run, 2) == Action.NONE  # a relaunch as attempt 2
    run.write_control(ControlRecord(seq=2, command="stop", attempt=3))
    assert state.poll(run, 2) == Action.NONE


def test_decide_combines_command_and_signals():
    assert decide(command_code=0, signal_count=0) == Action.NONE
    assert decide(command_code=2, signal_count=0) == Action.SWITCH
    assert decide(command_code=1, signal_count=1) == Action.STOP
    assert decide(command_code=2, signal_count=3) == Action.STOP


def test_signal_handler_only_sets_a_flag():
    state = ControlState()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        state.install_signal_handlers()
        signal.raise_signal(signal.SIGUSR1)
        assert state.signalled and state.signal_name == "SIGUSR1"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# Models -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", list(PRESETS))
def test_num_params_matches_the_built_model(preset):
    from cona.trainer.model import build_model

    spec = ModelSpec(preset=preset)
    model = build_model(spec, device="meta")  # the large presets allocate nothing
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_init_does_not_depend_on_the_pipeline_split():
    import torch
    from cona.trainer.model import build_model, materialize, prune_to_stage

    spec = ModelSpec(preset="tiny-llama")
    full = dict(materialize(build_model(spec), device="cpu", seed=7).named_parameters())
    for stage in range(4):
        part = materialize(prune_to_stage(build_model(spec), stage=stage, num_stages=4), device="cpu", seed=7)
        names = [n for n, _ in part.named_parameters()]
        assert names and all(n in full for n in names)
        for name, param in part.named_parameters():
            assert torch.equal(param, full[name]), name
    other = dict(materialize(build_model(spec), device="cpu", seed=8).named_parameters())
    assert not torch.equal(other["layers.0.attn.wq.weight"], full["layers.0.attn.wq.weight"])


def test_the_optimizer_updates_bit_identically_to_the_per_tensor_loop():
    """`build_optimizer` runs AdamW's foreach kernels (faster on the CPU); it must not change the weights by a bit
    against torch's per-tensor loop, so runs keep their losses under a fixed seed."""
    import torch
    from cona.protocol.job import OptimizerSpec
    from cona.trainer.model import build_model, materialize
    from cona.trainer.optim import build_optimizer

    spec = ModelSpec(preset="tiny-llama")
    opt_spec = OptimizerSpec(lr=3e-3, weight_decay=0.1)
    fast, slow = (materialize(build_model(spec), device="cpu", seed=3) for _ in range(2))
    optimizer = build_optimizer(fast, opt_spec)
    assert all(g["foreach"] for g in optimizer.param_groups)
    reference = torch.optim.AdamW(
        [{"params": [p for p in slow.parameters() if p.ndim >= 2], "weight_decay": opt_spec.weight_decay},
         {"params": [p for p in slow.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=opt_spec.lr, betas=(opt_spec.beta1, opt_spec.beta2), eps=opt_spec.eps, foreach=False)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len), generator=generator)
        for model, opt in ((fast, optimizer), (slow, reference)):
            opt.zero_grad()
            model(tokens).float().logsumexp(-1).mean().backward()
            opt.step()
    for (name, a), b in zip(fast.named_parameters(), slow.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama", "tiny-bert"])
def test_pipeline_stages_compose_to_the_full_model(preset):
    import torch
    from cona.trainer.model import build_model, materialize, prune_to_stage

    spec = ModelSpec(preset=preset)
    tokens = torch.randint(0, 255, (2, spec.seq_len))
    full = materialize(build_model(spec), device="cpu", seed=1)
    x = tokens
    for stage in range(2):
        x = materialize(prune_to_stage(build_model(spec), stage=stage, num_stages=2), device="cpu", seed=1)(x)
    torch.testing.assert_close(x, full(tokens))
    assert x.shape == (2, spec.seq_len, spec.vocab_size)


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama", "tiny-bert"])
def test_the_tp_plan_names_every_linear_layer_of_a_block(preset):
    # A renamed or added projection must show up in the plan next to it, or tp would silently replicate it.
    from cona.trainer.model import build_model, tp_plan
    from torch import nn

    for block in build_model(ModelSpec(preset=preset), device="meta").layers.values():
        linears = {name for name, module in block.named_modules() if isinstance(module, nn.Linear)}
        assert set(tp_plan(block)) == linears
        assert set(tp_plan(block).values()) == {"colwise", "rowwise"}
        # Sequence parallelism adds the two norms (split along the sequence) and the two modules whose input it
        # gathers whole; the linear layers keep their split.
        sequence = tp_plan(block, sequence_parallel=True)
        assert {k: v for k, v in sequence.items() if k in linears} == tp_plan(block)
        assert {k: v for k, v in sequence.items() if k not in linears} == {
            "attn_norm": "sequence", "mlp_norm": "sequence", "attn": "gather", "mlp": "gather"}


def test_gpt_is_causal_and_bert_is_not():
    import torch
    from cona.trainer.model import build_model, materialize

    tokens = torch.randint(0, 255, (1, 64))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 255
    for preset, causal in (("tiny-gpt", True), ("tiny-llama", True), ("tiny-bert", False)):
        model = materialize(build_model(ModelSpec(preset=preset)), device="cpu", seed=0)
        same = torch.allclose(model(tokens)[0, 0], model(changed)[0, 0])
        assert same == causal, preset


# Command line and bad input -----------------------------------------------------------------------------------


def test_no_flag_is_a_prefix_of_a_torchrun_flag():
    from cona.trainer.main import FLAGS
    from torch.distributed.run import get_args_parser

    torchrun_flags = [opt for action in get_args_parser()._actions for opt in action.option_strings]
    for flag in FLAGS:
        clashes = [t for t in torchrun_flags if t.startswith(flag) or (flag.startswith(t) and t.startswith("--"))]
        assert not clashes, f"{flag} clashes with torchrun's {clashes}"


def _main(capsys, *argv: str) -> tuple[int, str]:
    from cona.trainer.main import main

    with pytest.raises(SystemExit) as info:
        main(list(argv))
    err = capsys.readouterr().err.strip()
    return info.value.code, err


@pytest.mark.parametrize(
    ("overrides", "strategy", "code", "expected"),
    [
        (["optimizer.lrr=1"], "dp=1,mbs=2,gbs=16", ExitCode.CONFIG, "'optimizer.lrr'"),
        ([], "dp=1,tp=3,mbs=2,gbs=16", ExitCode.CONFIG, "tp=3 does not divide model.num_heads=4"),
        ([], "dp=1,pp=8,mbs=2,gbs=16", ExitCode.CONFIG, "model.num_layers=4"),
        (["parallel.pipeline_schedule=interleaved"], "dp=1,pp=2,mbs=2,gbs=10", ExitCode.CONFIG,
         "needs a multiple of its 2 rounds; choose gbs so that gbs/(dp·mbs) is a multiple of pp=2 or below 2·pp=4"),
        (["parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=3"], "dp=1,pp=2,mbs=8,gbs=16",
         ExitCode.CONFIG, "6 pipeline stages need at least 6 layers but model.num_layers=4; choose a smaller pp or "
         "parallel.virtual_stages"),
        ([], "dp=1,pp=2,mbs=8,gbs=8", ExitCode.BAD_WORLD, "needs dp·tp·pp = 2 processes"),  # 1F1B, 1 micro-batch
        ([], "dp=2,mbs=2,gbs=16", ExitCode.BAD_WORLD, "needs dp·tp·pp = 2 processes but the world has 1"),
        ([], "dp=1,mbs=3,gbs=16", ExitCode.CONFIG, "gbs=16 is not a multiple of dp·mbs=3"),
        ([], "dp=1,mbz=2,gbs=16", ExitCode.CONFIG, "did you mean 'mbs'"),
        (["data.path=/nonexistent/corpus.txt"], "dp=1,mbs=2,gbs=16", ExitCode.CONFIG, "/nonexistent/corpus.txt"),
    ],
)
def test_bad_input_is_one_line_and_an_exit_code(tmp_path, capsys, monkeypatch, overrides, strategy, code, expected):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    job = write_job(tmp_path)
    argv = ["--run-dir", str(tmp_path / "run"), "--job", str(job), "--strategy", strategy]
    for item in overrides:
        argv += ["--set", item]
    got, err = _main(capsys, *argv)
    assert got == code, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert expected in err, err


def test_missing_job_and_strategy_are_explained(tmp_path, capsys):
    got, err = _main(capsys, "--run-dir", str(tmp_path))
    assert got == ExitCode.CONFIG and "run.yaml" in err and len(err.splitlines()) == 1
    (tmp_path / "run.yaml").write_text(json.dumps({"job": load_job(write_job(tmp_path)).model_dump(mode="json")}))
    got, err = _main(capsys, "--run-dir", str(tmp_path))
    assert got == ExitCode.CONFIG and "--strategy" in err and "launch.json" in err
    got, err = _main(capsys, "--run-dir", str(tmp_path), "--bogus")
    assert got == ExitCode.CONFIG and "--bogus" in err and len(err.splitlines()) == 1


def test_unloadable_checkpoints_stop_with_a_clear_message(tmp_path):
    """Checkpoints whose COMPLETE marker lies (truncated files) are skipped; when none is left: exit CONFIG."""
    job = write_job(tmp_path)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "cona.trainer", "--run-dir", str(run), "--job", str(job), "--strategy", "dp=1,mbs=8,gbs=16"]
    first = subprocess.run([*cmd, "--max-steps", "2"], cwd=REPO, env=trainer_env(), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr  # --max-steps: a normal end; the exit record says STOPPED
    assert json.loads((run / "attempts" / "0" / "exit.json").read_text())["name"] == "STOPPED"
    (shard,) = (run / "checkpoints" / "step-00000002").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    second = subprocess.run([*cmd, "--max-steps", "3", "--attempt", "1"], cwd=REPO, env=trainer_env(), capture_output=True, text=True)
    assert second.returncode == ExitCode.CONFIG, second.stderr
    lines = [line for line in second.stderr.splitlines() if line.startswith("cona trainer")]
    assert any("skipping checkpoint" in line and "step-00000002" in line and "truncated" in line for line in lines)
    assert "Traceback" not in second.stderr
    assert json.loads((run / "attempts" / "1" / "exit.json").read_text())["exit_code"] == ExitCode.CONFIG


def test_strategy_parse_round_trip():
    assert str(Strategy.parse("dp=2,tp=2,pp=1,mbs=2,gbs=16")) == "dp=2,tp=2,pp=1,mbs=2,gbs=16"



@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama", "tiny-bert"])
def test_recompute_modes_give_the_same_loss_and_gradients(preset):
    import torch
    from cona.trainer.model import build_model, lm_loss_sum, materialize

    spec = ModelSpec(preset=preset)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec.vocab_size, (2, spec.seq_len), generator=generator)
    y = torch.randint(0, spec.vocab_size, (2, spec.seq_len), generator=generator)
    results = {}
    for mode in ("none", "selective", "full"):
        model = materialize(build_model(spec), device="cpu", seed=0)
        for block in model.layers.values():
            block.recompute = mode
        loss = lm_loss_sum(model(x), y)
        loss.backward()
        results[mode] = (loss.detach(), [p.grad for p in model.parameters()])
    reference_loss, reference_grads = results["none"]
    for mode in ("selective", "full"):
        loss, grads = results[mode]
        # the same ops on the same values: bit-identical on CPU (a GPU kernel may differ within float tolerance)
        torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
        for grad, reference in zip(grads, reference_grads, strict=True):
            torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-7)


def test_a_rank_that_dies_of_an_exception_records_it_for_the_crash_line(tmp_path, monkeypatch):
    """torchrun's summary gives a raising rank's exit code only (`exitcode 1`): the rank writes what ended it,
    `attempts/<n>/crash-<rank>.json`, for the orchestrator's crash line; a traceback follows as before."""
    from cona.protocol.rundir import describe_crashes
    from cona.trainer.main import main

    import tests.trainer_helpers as helpers

    def step(self):
        raise ValueError("a bug in step 1\nthe message's last line")

    run, argv = helpers.one_rank_main(tmp_path, monkeypatch, step=step, attempt=3)
    with pytest.raises(ValueError, match="a bug in step 1"):
        main(argv)
    assert run.read_exit(3) is None  # no protocol exit: a crash
    assert describe_crashes(run.read_crashes(3)) == "rank 0: ValueError: the message's last line"
