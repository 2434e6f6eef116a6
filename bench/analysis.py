"""Aggregate cells over rounds, check loss agreement with eager, evaluate the targets.

Pure functions over the cell dicts of :mod:`bench.cell` (no torch), so they are tested
without running anything.
"""

from __future__ import annotations

import math
import statistics

LOSS_RTOL = 1e-3  # first-step loss of every system vs eager's, relative
# The first-step loss says nothing of the gradients. A system that applies the same update as
# another (the same optimizer formula from the same weights and data) must also follow that
# system's losses over the first steps: a wrong gradient shows there (onnxruntime's racy
# ScatterND had BERT-mini's ORTModule losses 1.7e-3 off eager's by step 2).
SAME_UPDATE = {"eager_fused": "eager", "compile": "eager", "ortmodule": "eager", "ortmodule_recompute": "eager",
               "ondevice": "upstream"}
TRAJECTORY_RTOL = 1e-3
TRAJECTORY_STEPS = 5  # steps 0-4: later, rounding differences have had time to grow

# status of an aggregated (model, system) entry
OK, FAILED, ERROR, NO_REF, REFERENCE = "OK", "FAILED", "ERROR", "NO REF", "reference"


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def loss_agreement(loss: float | None, reference: float | None, rtol: float = LOSS_RTOL) -> tuple[bool, float]:
    """(agrees, relative difference) of a first-step loss against eager's."""
    if loss is None or reference is None:
        return False, float("nan")
    if loss != loss or reference != reference:  # NaN never agrees
        return False, float("nan")
    rel = abs(loss - reference) / max(abs(reference), 1e-12)
    return rel <= rtol, rel


# a cell whose slower load probe ran below this fraction of the run's typical calm rate was measured
# while outside work slowed the shared machine (bench.probe.load_probe). The probe itself varies by
# ~15% between calm processes; a core taken away halves it.
STEADY_FRACTION = 0.7


def mark_disturbed(cells: list[dict]) -> float | None:
    """Set ``disturbed`` on every cell: True when its slower load probe (before or after its steps)
    ran below ``STEADY_FRACTION`` of the reference rate, the upper quartile of all ``cells``'
    slower probes (the machine's calm rate, as long as it was calm for more than a quarter of the
    run). Returns the reference (None, and nothing disturbed, when no cell carries probes)."""
    slower = {id(c): min(probes) for c in cells if (probes := [r for r in c.get("load_probe_gflops") or [] if r])}
    rates = sorted(slower.values())
    reference = None
    if rates:
        reference = statistics.quantiles(rates, n=4, method="inclusive")[2] if len(rates) > 1 else rates[0]
    for c in cells:
        c["disturbed"] = id(c) in slower and slower[id(c)] < STEADY_FRACTION * reference
    return reference


def unsteady_models(cells: list[dict], wanted: int) -> list[str]:
    """Models with a system that has a successful cell but fewer than ``wanted`` undisturbed ones
    (after :func:`mark_disturbed`): the ones another round would help."""
    counts: dict[tuple, list[int]] = {}
    for c in cells:
        ok = c["status"] == "ok"
        tally = counts.setdefault((c["model"], c["system"]), [0, 0])
        tally[0] += ok
        tally[1] += ok and not c.get("disturbed")
    return list(dict.fromkeys(model for (model, _), (ok, steady) in counts.items() if ok and steady < wanted))


def trajectory_agreement(losses: list | None, reference: list | None,
                         rtol: float = TRAJECTORY_RTOL) -> tuple[bool, float] | None:
    """(agrees, largest relative difference) of the losses of steps 1 to ``TRAJECTORY_STEPS - 1``
    against the reference system's; None when either has no losses after step 0."""
    pairs = list(zip(losses or [], reference or []))[1:TRAJECTORY_STEPS]
    if not pairs:
        return None
    rels = [loss_agreement(loss, ref, rtol)[1] for loss, ref in pairs]
    worst = float("nan") if any(math.isnan(r) for r in rels) else max(rels)
    return worst <= rtol, worst


def aggregate(cells: list[dict], rtol: float = LOSS_RTOL) -> dict:
    """``{model: {system: entry}}`` over all rounds.

    An entry has the medians over the rounds whose cell succeeded (``median_step_ms``,
    ``first_step_s``, ``peak_rss_mb``, ``peak_increase_mb``) and was not ``disturbed`` (see
    :func:`mark_disturbed`; all successful rounds when every one was), ``steady_rounds`` (how many
    that is), ``disturbed_by_round``, ``ratio_vs_eager``
    (eager's median step / this system's, both from this run: > 1 is faster), the per-round
    ratios, the first-step loss check against eager's cell *of the same round*
    (``max_loss_rel``), the first ``losses`` of its first successful round, and ``status``:
    ``reference`` (eager), ``OK``, ``FAILED`` (a first-step loss differs from eager's by
    more than ``rtol``, or the losses of the first steps from those of the system with the same
    update, ``SAME_UPDATE``, in the same round by more than ``TRAJECTORY_RTOL``:
    ``max_trajectory_rel`` and ``trajectory_reference``), ``ERROR`` (no cell succeeded;
    ``error`` says why) or ``NO REF`` (no eager cell to compare with).
    """
    by_key: dict[tuple, list[dict]] = {}
    for cell in cells:
        by_key.setdefault((cell["model"], cell["system"]), []).append(cell)
    models = list(dict.fromkeys(c["model"] for c in cells))
    out: dict[str, dict] = {}
    for model in models:
        eager_by_round = {c.get("round"): c for c in by_key.get((model, "eager"), []) if c["status"] == "ok"}
        systems = list(dict.fromkeys(c["system"] for c in cells if c["model"] == model))
        out[model] = {}
        for system in systems:
            group = sorted(by_key[(model, system)], key=lambda c: c.get("round", 0))
            good = [c for c in group if c["status"] == "ok"]
            steady = [c for c in good if not c.get("disturbed")]
            used = steady or good
            entry = {
                "rounds": len(group), "ok_rounds": len(good), "steady_rounds": len(steady),
                "median_step_ms": None if not used else _median([c["median_step_s"] * 1e3 for c in used]),
                "step_ms_by_round": [None if c["status"] != "ok" else c["median_step_s"] * 1e3 for c in group],
                "disturbed_by_round": [bool(c.get("disturbed")) for c in group],
                "first_step_s": _median([c.get("first_step_s") for c in used]),
                "peak_rss_mb": _median([c.get("peak_rss_mb") for c in used]),
                "peak_increase_mb": _median([c.get("peak_increase_mb") for c in used]),
                "rss_before_mb": _median([c.get("rss_before_mb") for c in used]),
                "losses": good[0].get("losses") if good else None,
                "first_loss": good[0].get("first_loss") if good else None,
                "errors": [c["error"] for c in group if c["status"] != "ok"],
                "notes": list(dict.fromkeys(n for c in group for n in c.get("notes", []))),
            }
            if not good:
                entry.update(status=ERROR, error=entry["errors"][0] if entry["errors"] else "no cell")
            elif system == "eager":
                entry.update(status=REFERENCE, max_loss_rel=0.0)
            else:
                rels, agree = [], True
                for c in good:
                    ref = eager_by_round.get(c.get("round")) or next(iter(eager_by_round.values()), None)
                    if ref is None:
                        continue
                    ok, rel = loss_agreement(c.get("first_loss"), ref.get("first_loss"), rtol)
                    rels.append(rel)
                    agree = agree and ok
                if not rels:
                    entry.update(status=NO_REF, max_loss_rel=None)
                else:
                    finite = [r for r in rels if r == r]
                    entry.update(status=OK if agree else FAILED,
                                 max_loss_rel=max(finite) if len(finite) == len(rels) else float("nan"))
                _check_trajectory(entry, good, SAME_UPDATE.get(system), by_key.get((model, SAME_UPDATE.get(system)), []))
            out[model][system] = entry
        eager = out[model].get("eager")
        for system, entry in out[model].items():
            entry["ratio_vs_eager"] = None
            entry["ratio_by_round"] = []
            if eager and eager.get("median_step_ms") and entry.get("median_step_ms"):
                entry["ratio_vs_eager"] = eager["median_step_ms"] / entry["median_step_ms"]
                entry["ratio_by_round"] = [e / s if e and s else None
                                           for e, s in zip(eager["step_ms_by_round"], entry["step_ms_by_round"])]
    return out


def _check_trajectory(entry: dict, good: list[dict], reference: str | None, reference_cells: list[dict]) -> None:
    """Compare ``good`` cells' first losses with ``reference``'s cell of the same round (see
    ``SAME_UPDATE``); a mismatch makes the entry ``FAILED``."""
    by_round = {c.get("round"): c for c in reference_cells if c["status"] == "ok"}
    checks = [trajectory_agreement(c.get("losses"), by_round[c.get("round")].get("losses"))
              for c in good if c.get("round") in by_round]
    checks = [c for c in checks if c is not None]
    if not checks:
        return
    rels = [rel for _, rel in checks]
    entry["trajectory_reference"] = reference
    entry["max_trajectory_rel"] = float("nan") if any(math.isnan(r) for r in rels) else max(rels)
    if not all(ok for ok, _ in checks) and entry["status"] == OK:
        entry["status"] = FAILED


def add_matmul_bound(summary: dict, flops: dict, peak_gflops: float | None) -> None:
    """Per model: ``bound_ms`` = training-step FLOPs / peak matmul rate; per system ``x_bound``."""
    for model, systems in summary.items():
        f = flops.get(model)
        bound = f / (peak_gflops * 1e9) * 1e3 if f and peak_gflops else None
        for entry in systems.values():
            entry["flops_per_step"] = f
            entry["bound_ms"] = bound
            entry["x_bound"] = entry["median_step_ms"] / bound if bound and entry.get("median_step_ms") else None


# -- targets -----------------------------------------------------------------------------------

SPEEDUP_TARGETS = {"mlp": 2.0, "cnn": 1.3, "gpt": 1.2, "bert-mini": 1.2, "minilm": 1.2}
ONDEVICE_VS_UPSTREAM = {"mlp": 2.0, "gpt": 1.4}
FIRST_STEP_FRACTION = 1 / 5
GPT_BOUND = 1.2


def _usable(entry: dict | None) -> bool:
    return bool(entry) and entry.get("status") in (OK, REFERENCE) and entry.get("median_step_ms") is not None


def _why_not(entry: dict | None, name: str) -> str:
    if not entry:
        return f"{name} not run"
    if entry.get("status") == FAILED:
        return f"{name} loss check FAILED"
    if entry.get("status") == ERROR:
        return f"{name} ERROR"
    return f"{name} has no figure"


def _target(name, measured, threshold, met, detail="") -> dict:
    status = "N/A" if met is None else ("MET" if met else "MISSED")
    return {"target": name, "measured": measured, "threshold": threshold, "status": status, "detail": detail}


def targets(summary: dict) -> list[dict]:
    """The suite's targets, each with the measured value and MET / MISSED / N/A."""
    out = []
    for model, need in SPEEDUP_TARGETS.items():
        s = summary.get(model, {})
        name = f"ORTModule vs eager on {model} >= {need:g}x"
        e = s.get("ortmodule")
        if model not in summary:
            out.append(_target(name, None, need, None, "model not run"))
        elif _usable(e) and _usable(s.get("eager")):
            out.append(_target(name, f"{e['ratio_vs_eager']:.2f}x", need, e["ratio_vs_eager"] >= need))
        else:
            out.append(_target(name, None, need, False if e else None, _why_not(e, "ortmodule")))
    for model, s in summary.items():
        if model not in SPEEDUP_TARGETS:
            continue
        name = f"ORTModule not slower than torch.compile on {model}"
        e, c = s.get("ortmodule"), s.get("compile")
        if not c or not e:
            out.append(_target(name, None, 1.0, None, "compile or ortmodule not run"))
        elif not _usable(c):
            out.append(_target(name, None, 1.0, None, _why_not(c, "compile")))
        elif not _usable(e):
            out.append(_target(name, None, 1.0, False, _why_not(e, "ortmodule")))
        else:
            r = c["median_step_ms"] / e["median_step_ms"]
            out.append(_target(name, f"{r:.2f}x of compile's speed", 1.0, r >= 1.0,
                               f"{e['median_step_ms']:.1f} ms vs {c['median_step_ms']:.1f} ms"))
    for model, need in ONDEVICE_VS_UPSTREAM.items():
        s = summary.get(model, {})
        name = f"on-device vs upstream on {model} >= {need:g}x"
        o, u = s.get("ondevice"), s.get("upstream")
        if not o or not u:
            out.append(_target(name, None, need, None, "ondevice or upstream not run"))
        elif not _usable(u):
            out.append(_target(name, None, need, None, _why_not(u, "upstream")))
        elif not _usable(o):
            out.append(_target(name, None, need, False, _why_not(o, "ondevice")))
        else:
            r = u["median_step_ms"] / o["median_step_ms"]
            out.append(_target(name, f"{r:.2f}x", need, r >= need,
                               f"{o['median_step_ms']:.2f} ms vs {u['median_step_ms']:.2f} ms"))
    for model, s in summary.items():
        if model not in SPEEDUP_TARGETS:
            continue
        name = f"ORTModule first-step latency <= 1/5 of torch.compile's on {model}"
        e, c = s.get("ortmodule"), s.get("compile")
        if not e or not c or c.get("first_step_s") is None:
            out.append(_target(name, None, FIRST_STEP_FRACTION, None, "compile or ortmodule not run"))
        elif e.get("first_step_s") is None or e.get("status") not in (OK,):
            out.append(_target(name, None, FIRST_STEP_FRACTION, False, _why_not(e, "ortmodule")))
        else:
            frac = e["first_step_s"] / c["first_step_s"]
            out.append(_target(name, f"{frac:.2f} ({e['first_step_s']:.1f} s vs {c['first_step_s']:.1f} s)",
                               FIRST_STEP_FRACTION, frac <= FIRST_STEP_FRACTION))
    for model, s in summary.items():
        if model not in SPEEDUP_TARGETS:
            continue
        name = f"ORTModule peak memory <= eager's on {model}"
        e, g = s.get("ortmodule"), s.get("eager")
        if not e or not g or g.get("peak_rss_mb") is None:
            out.append(_target(name, None, 1.0, None, "eager or ortmodule not run"))
        elif e.get("peak_rss_mb") is None or e.get("status") != OK:
            out.append(_target(name, None, 1.0, False, _why_not(e, "ortmodule")))
        else:
            out.append(_target(name, f"{e['peak_rss_mb']:.0f} MB vs {g['peak_rss_mb']:.0f} MB (peak RSS)", 1.0,
                               e["peak_rss_mb"] <= g["peak_rss_mb"],
                               f"increase over the RSS before step 0: {e['peak_increase_mb']:.0f} MB vs "
                               f"{g['peak_increase_mb']:.0f} MB"))
    gpt = summary.get("gpt", {})
    name = f"GPT step within {GPT_BOUND:g}x of the matmul bound (ORTModule)"
    e = gpt.get("ortmodule")
    if not e:
        out.append(_target(name, None, GPT_BOUND, None, "gpt/ortmodule not run"))
    elif not _usable(e) or not e.get("x_bound"):
        out.append(_target(name, None, GPT_BOUND, False, _why_not(e, "ortmodule")))
    else:
        out.append(_target(name, f"{e['x_bound']:.2f}x ({e['median_step_ms']:.1f} ms vs bound "
                                 f"{e['bound_ms']:.1f} ms)", GPT_BOUND, e["x_bound"] <= GPT_BOUND))
    return out
