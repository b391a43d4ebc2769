"""Calibrate the cost model's accelerator fields from a GPU check (`python -m benchmarks.gpu --fit JSON`).

Fits `accelerator.matmul_efficiency`, `matmul_half_tokens`, `host_layer_ms` and `step_overhead_ms` to the measured step times
of `python -m benchmarks.gpu` (least squares on log(measured/predicted), a coordinate search over a log grid), once
on every family and once per held-out family (fitted on the others, scored on it): a calibration that only fits
the strategies it saw would say nothing about the ones cona has not run yet. Prints measured/predicted before (the
profile's values: the defaults) and after, and writes `<json stem>-fit.json` beside the input.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.common import print_table

FIELDS = {  # field: (lower, upper) bounds of the search
    "matmul_efficiency": (0.05, 1.0),
    "matmul_half_tokens": (0.0, 8192.0),
    "host_layer_ms": (0.0, 50.0),
    "step_overhead_ms": (0.0, 1000.0),
}


def _with_values(profile: Any, values: dict[str, float]) -> Any:
    data = profile.model_dump(mode="json")
    data["accelerator"].update(values)
    return type(profile).model_validate(data)


def _predict(profile: Any, row: dict[str, Any]) -> float:
    from cona.orchestrator.costmodel import predict

    s = row["strategy"]
    return predict(profile=profile, job=row["job_spec"], dp=s["dp"], tp=s["tp"], pp=s["pp"], mbs=s["mbs"],
                   gbs=s["gbs"]).iter_time_s  # fmt: skip


def ratios(profile: Any, rows: list[dict[str, Any]], values: dict[str, float]) -> list[float]:
    """measured/predicted of every row with the accelerator fields set to `values`."""
    fitted = _with_values(profile, values)
    return [r["step_s"] / _predict(fitted, r) for r in rows]


def rms_log_error(profile: Any, rows: list[dict[str, Any]], values: dict[str, float]) -> float:
    errors = [math.log(x) for x in ratios(profile, rows, values)]
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else math.nan


def fit(profile: Any, rows: list[dict[str, Any]]) -> dict[str, float]:
    """The best of a coordinate search (each field in turn over a shrinking multiplicative grid, until nothing
    improves) from a few starts: the host and device terms trade off against each other, with local minima."""
    best_values, best = None, math.inf
    for host, step_ms in ((1.0, 1.0), (3.0, 30.0), (2.0, 80.0)):
        start = {"matmul_efficiency": profile.accelerator.matmul_efficiency,
                 "matmul_half_tokens": max(1.0, profile.accelerator.matmul_half_tokens),
                 "host_layer_ms": host, "step_overhead_ms": step_ms}  # fmt: skip
        values = _search(profile, rows, start)
        error = rms_log_error(profile, rows, values)
        if error < best:
            best_values, best = values, error
    assert best_values is not None
    return best_values


def _search(profile: Any, rows: list[dict[str, Any]], values: dict[str, float]) -> dict[str, float]:
    best = rms_log_error(profile, rows, values)
    step = 2.0
    while step > 1.01:
        improved = False
        for name, (lo, hi) in FIELDS.items():
            for factor in (step, 1 / step):
                trial = dict(values)
                trial[name] = min(hi, max(lo, values[name] * factor))
                error = rms_log_error(profile, rows, trial)
                if error < best - 1e-9:
                    values, best, improved = trial, error, True
        if not improved:
            step = math.sqrt(step)
    return values


# The full-size presets as they were before they followed the published models (issue 17): untied GPT and Llama
# heads, no Llama 3 RoPE scaling, BERT without token types and with eps 1e-5. A measured row whose parameter count
# is that layout's ran that model, and is re-predicted for it.
_LAYOUT_BEFORE_PUBLISHED_PRESETS: dict[str, list[str]] = {
    "gpt3-1.3b": ["model.tie_embeddings=false"],
    "llama-3.2-1b": ["model.tie_embeddings=false", "model.rope_scaling=null"],
    "bert-large": ["model.type_vocab_size=0", "model.norm_eps=1e-5"],
}


def _with_jobs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured rows, each with the job it ran (rebuilt from the preset and recompute mode, in the layout whose
    parameter count the row recorded), as data (`job`) and parsed (`job_spec`)."""
    from cona.orchestrator.job import job_to_dict

    from benchmarks.gpu import _job

    rows = []
    for row in data["steps"]:
        if "step_s" not in row:
            continue
        job = _job(row["preset"], data=Path("unused.bin"), recompute=row["recompute"])
        if "num_params" in row and job.model.num_params != row["num_params"]:
            overrides = _LAYOUT_BEFORE_PUBLISHED_PRESETS.get(row["preset"], [])
            job = _job(row["preset"], data=Path("unused.bin"), recompute=row["recompute"], overrides=overrides)
            if job.model.num_params != row["num_params"]:
                raise ValueError(
                    f"{row['preset']}: the row measured a model of {row['num_params']:,} parameters, which no known "
                    f"layout of the preset has ({job.model.num_params:,} now); rerun python -m benchmarks.gpu"
                )
        rows.append({**row, "job": job_to_dict(job), "job_spec": job})
    return rows


def report_fit(path: Path) -> int:
    from cona.orchestrator.profile import ClusterProfile

    data = json.loads(path.read_text())
    profile = ClusterProfile.model_validate(data["device"]["profile"])
    rows = _with_jobs(data)
    defaults = {name: float(getattr(profile.accelerator, name)) for name in FIELDS}
    everything = fit(profile, rows)
    held_out: dict[str, dict[str, Any]] = {}
    for family in sorted({r["preset"] for r in rows}):
        train = [r for r in rows if r["preset"] != family]
        test = [r for r in rows if r["preset"] == family]
        values = fit(profile, train)
        held_out[family] = {"values": values, "train_rms_log_error": rms_log_error(profile, train, values),
                            "held_out_rms_log_error": rms_log_error(profile, test, values),
                            "held_out_ratios": ratios(profile, test, values)}  # fmt: skip
    table = []
    out_rows = []
    columns = zip(ratios(profile, rows, defaults), ratios(profile, rows, everything), strict=True)
    for r, (before, after) in zip(rows, columns, strict=True):
        s = r["strategy"]
        unseen = ratios(profile, [r], held_out[r["preset"]]["values"])[0]
        out_rows.append({"preset": r["preset"], "strategy": s, "recompute": r["recompute"], "step_s": r["step_s"],
                         "ratio_defaults": before, "ratio_fitted": after, "ratio_fitted_without_family": unseen})  # fmt: skip
        table.append([f"{r['preset']} mbs={s['mbs']} gbs={s['gbs']} {r['recompute']}", f"{r['step_s'] * 1e3:.0f} ms",
                      f"{before:.2f}", f"{after:.2f}", f"{unseen:.2f}"])  # fmt: skip
    print_table("measured/predicted step time: profile defaults, fitted on all families, fitted without the row's family",
                ["strategy", "measured", "defaults", "fitted", "family held out"], table)  # fmt: skip
    fmt = ", ".join(f"{k}={v:.3g}" for k, v in everything.items())
    print(f"fitted on all: {fmt}; RMS log error {rms_log_error(profile, rows, defaults):.3f} (defaults) → "
          f"{rms_log_error(profile, rows, everything):.3f}")  # fmt: skip
    for family, h in held_out.items():
        print(f"without {family}: fitted {', '.join(f'{k}={v:.3g}' for k, v in h['values'].items())}; "
              f"RMS log error on the others {h['train_rms_log_error']:.3f}, on {family} {h['held_out_rms_log_error']:.3f}")
    out = path.with_name(path.stem + "-fit.json")
    out.write_text(json.dumps({"input": path.name, "defaults": defaults, "fitted": everything,
                               "rms_log_error": {"defaults": rms_log_error(profile, rows, defaults),
                                                 "fitted": rms_log_error(profile, rows, everything)},
                               "held_out": held_out, "rows": out_rows}, indent=1) + "\n")  # fmt: skip
    print(f"JSON {out}")
    return 0
