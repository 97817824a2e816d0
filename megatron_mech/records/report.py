"""Post-hoc report of a run from its JSONL log (``RUN_DIR/mech.jsonl``, written by
:class:`~megatron_mech.records.sinks.JsonlSink`).

The log is streamed (:func:`~megatron_mech.records.sinks.iter_jsonl`) into a bounded reduction
(:func:`reduce_run`, :mod:`~megatron_mech.records.series_reduction`): memory grows with the number of series, not
with the number of records. Each series is drawn from at most ``MAX_BUCKETS`` step buckets keeping their minimum,
maximum, first and last points (exact while a series has no more steps than that); the summary's numbers are
computed exactly while streaming.

* :func:`plot_run` — one PNG, stacked panels on a shared step axis (only those with data): loss; grad norm (log
  scale when it spans more than a decade); attention ΔW spectral entropy per layer (Q solid, K dashed, other
  matrices dotted); Δ2 entropy, min over heads, per layer; router entropy mean, expert-load entropy and mean
  expert-row cosine per layer. Layers have the same colour in every panel (one legend, or a colour bar beyond
  16 layers, on the right). Every alert is a vertical line coloured and dashed by family (attention / router /
  symptom; legend at the bottom) in every panel, with a triangle at its value in the panel that shows its series
  (a per-head Δ2 alert in the min-over-heads panel); the first alert of each family is labelled in the top
  panel. Non-finite values (NaN/inf) are marked with an ``x`` at the bottom of their panel. With more than 4
  layers, the layers named by alerts are drawn bold and the others faded. The detector's view, from its default
  rules (:mod:`~megatron_mech.records.report_guides`): a dash-dot line at a rule's absolute alert level (ΔW,
  Δ2 panels), its legend naming the series it covers; the baseline band, median ± threshold × scale of a series'
  frozen baseline from the step it froze, outlined (overlapping bands stay readable), for the alerting series of a
  panel (else for each series of a panel of at most four); the detectors' warm-up shaded from step 0 to the
  armed-from step (the run's ``summary.json`` when present, else derived from the rules and the log's interval;
  the legend says which), or to the run's last step when it ends before (the x axis is the run's steps).
* :func:`summarize_run` — markdown: steps covered, final loss, alert counts, first alert per family with its
  attribution (:meth:`Alert.describe`) and its lead over the first symptom alert.
* ``megatron-mech report RUN_DIR [--out PNG] [--metrics GLOB ...]`` (:func:`add_report_arguments` /
  :func:`run_report`) writes both (``report.png`` and ``report.md`` next to the JSONL by default), from one pass
  over the log.

matplotlib is imported lazily and only through :class:`matplotlib.figure.Figure` (the Agg canvas, no pyplot and
no display), so importing this module is cheap and the global backend of an interactive session is untouched.
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from megatron_mech.core.detect import FAMILIES, Alert, DetectorRegistry, family_order, family_rank, layer_of
from megatron_mech.records.report_guides import (
    Arming,
    RunSettings,
    panel_bands,
    panel_levels,
    resolve_arming,
    run_settings,
)
from megatron_mech.records.run_summary import run_verdict
from megatron_mech.records.safe_files import open_regular, write_file_atomically
from megatron_mech.records.series_reduction import RunReduction, record_values, reduce_records
from megatron_mech.records.sinks import JSONL_NAME, iter_jsonl, record_alerts

__all__ = ["REPORT_PNG", "REPORT_MD", "REPORT_FILES", "FAMILY_COLORS", "resolve_jsonl", "run_name", "collect_series",
           "collect_alerts", "reduce_run", "build_figure", "plot_run", "summarize_run", "run_verdict",
           "add_report_arguments", "missing_plot_package", "run_report"]

REPORT_PNG = "report.png"
REPORT_MD = "report.md"
#: The files the report writes beside the log (and the temporary files they are written through): a training
#: command refuses a link or a FIFO at any of them before it trains.
REPORT_FILES = (REPORT_PNG, f".{REPORT_PNG}.tmp", REPORT_MD, f".{REPORT_MD}.tmp")
#: Alert-line colours; the layer colormap (viridis, cut before yellow) contains none of these hues.
FAMILY_COLORS = {"attention": "#d62728", "router": "#ff7f0e", "symptom": "#222222"}
_FAMILY_STYLE = {"attention": "--", "router": "-.", "symptom": ":"}
_OTHER_FAMILY_COLOR, _OTHER_FAMILY_STYLE = "#9467bd", "-"  # a user monitor's alerts


def _family_color(family: str) -> str:
    return FAMILY_COLORS.get(family, _OTHER_FAMILY_COLOR)


def _family_style(family: str) -> str:
    return _FAMILY_STYLE.get(family, _OTHER_FAMILY_STYLE)


MAX_GENERIC_PANELS = 8
#: A file none of whose first lines is a record is refused as not a log (a wrong path), not warned line by line.
REFUSE_AFTER_LINES = 5

Series = tuple[list[int], list[float]]


# ------------------------------------------------------------------------------------------------ loading
def resolve_jsonl(run_dir_or_jsonl: str | Path) -> Path:
    """``RUN_DIR/mech.jsonl`` for a directory, the path itself for a file; FileNotFoundError if missing."""
    p = Path(run_dir_or_jsonl)
    path = p / JSONL_NAME if p.is_dir() else p
    if path.exists() and not path.is_file():  # a FIFO would block the reader: refused by name (ValueError)
        open_regular(path).close()
    if not path.is_file():
        hint = f" (expected {JSONL_NAME} inside the run directory)" if p.is_dir() else ""
        raise FileNotFoundError(f"no monitor log at {path}{hint}")
    return path


def run_name(jsonl: Path) -> str:
    """The run directory's name for ``.../RUN/mech.jsonl``, else the file's stem."""
    jsonl = Path(jsonl)
    return jsonl.resolve().parent.name if jsonl.name == JSONL_NAME else jsonl.stem


def collect_series(records: Iterable[Mapping[str, Any]]) -> dict[str, Series]:
    """Every value of every series, ``{metric name: (steps, values)}`` sorted by step, held in memory (the report
    itself draws from the bounded :func:`reduce_run`). The series of a record are
    :func:`~megatron_mech.records.series_reduction.record_values` (``loss``/``grad_norm`` as
    ``symptom/loss``/``symptom/grad_norm``); for a step logged twice (a resume without truncation) the last value
    wins."""
    table: dict[str, dict[int, float]] = {}
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        for name, v in record_values(rec).items():
            table.setdefault(name, {})[step] = v
    out = {}
    for name, by_step in table.items():
        steps = sorted(by_step)
        out[name] = (steps, [by_step[s] for s in steps])
    return out


def collect_alerts(records: Iterable[Mapping[str, Any]]) -> list[Alert]:
    """All alerts, sorted by step, de-duplicated on (metric, step) (a resumed run may repeat records)."""
    seen: dict[tuple[str, int], Alert] = {}
    for rec in records:
        for a in record_alerts(rec):
            seen[(a.metric, a.step)] = a
    return sorted(seen.values(), key=lambda a: (a.step, family_rank(a.family), a.metric))


# ------------------------------------------------------------------------------------------------ panels
_LAYER = re.compile(r"layer(\d+)")
_DW = re.compile(r"^attn/layer(\d+)/dw(\w*?)_entropy$")
_D2_MIN = re.compile(r"^attn/layer(\d+)/delta2_entropy_min$")
_D2_HEAD = re.compile(r"^attn/layer(\d+)/head(\d+)/delta2_entropy$")


def _router(stat: str) -> re.Pattern:
    return re.compile(rf"^router/layer(\d+)/{stat}$")


@dataclass
class _Line:
    name: str                      # metric name it shows (alerts on that name get a marker on it)
    steps: list[int]
    values: list[float]
    layer: int | None = None
    style: str = "-"
    label: str | None = None       # panel-legend label (None: covered by the figure's layer legend)


@dataclass
class _Panel:
    key: str
    ylabel: str
    lines: list[_Line] = field(default_factory=list)
    logy: bool = False
    names: set[str] = field(default_factory=set)  # every metric name shown (directly or via an aggregate)
    style_legend: list[tuple[str, str]] = field(default_factory=list)  # (line style, label) panel legend


def _layer_panel(key: str, ylabel: str, series: Mapping[str, Series], pattern: re.Pattern,
                 keep: Callable[[str], bool]) -> _Panel:
    panel = _Panel(key, ylabel)
    for name in sorted(series, key=_natural):
        m = pattern.match(name)
        if m and keep(name):
            panel.lines.append(_Line(name, *series[name], layer=int(m.group(1))))
            panel.names.add(name)
    return panel


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _keeper(metrics: Sequence[str] | None) -> Callable[[str], bool]:
    def keep(name: str) -> bool:
        return metrics is None or any(fnmatch.fnmatchcase(name, g) for g in metrics)
    return keep


_FIXED_PANELS = (re.compile(r"^symptom/(loss|grad_norm)$"), _DW, _D2_MIN, _router("entropy_mean"),
                 _router("load_entropy"), _router("mean_cosine"))


def _drawable(metrics: Sequence[str] | None) -> Callable[[str], bool]:
    """Which series the plot may draw (the ones a reduction keeps buckets of): the fixed panels' series, or with
    ``metrics`` globs the loss and whatever they select."""
    if metrics is None:
        return lambda name: any(p.match(name) for p in _FIXED_PANELS)
    keep = _keeper(metrics)
    return lambda name: name == "symptom/loss" or keep(name)


def reduce_run(records: Iterable[Mapping[str, Any]], metrics: Sequence[str] | None = None,
               registry: DetectorRegistry | None = None) -> RunReduction:
    """The bounded reduction (:class:`~megatron_mech.records.series_reduction.RunReduction`) the plot and the
    summary are drawn from, of the series the plot may show with these ``metrics`` globs; ``records`` may be a
    stream (:func:`~megatron_mech.records.sinks.iter_jsonl`), consumed once. ``registry``: the run's detector
    rules, whose baselines the plot draws (default: the default rules; see
    :func:`~megatron_mech.records.report_guides.run_settings`)."""
    return reduce_records(records, _drawable(metrics), min_over_heads=_keeper(metrics), registry=registry)


def _reduction(records: Iterable[Mapping[str, Any]] | RunReduction, metrics: Sequence[str] | None) -> RunReduction:
    return records if isinstance(records, RunReduction) else reduce_run(records, metrics)


def _build_panels(reduction: RunReduction, metrics: Sequence[str] | None) -> list[_Panel]:
    keep = _keeper(metrics)
    series = {name: buckets.points() for name, buckets in reduction.series.items()}

    panels: list[_Panel] = []
    if "symptom/loss" in series:  # always shown: the reference every lead time is measured against
        panels.append(_Panel("loss", "loss", [_Line("symptom/loss", *series["symptom/loss"])], names={"symptom/loss"}))
    if "symptom/grad_norm" in series and keep("symptom/grad_norm"):
        steps, values = series["symptom/grad_norm"]
        finite = [v for v in values if math.isfinite(v)]
        # Log scale only when spikes span more than about a decade (otherwise the log ticks are just clutter).
        logy = bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 20
        panels.append(_Panel("grad_norm", "grad norm", [_Line("symptom/grad_norm", steps, values)], logy=logy,
                             names={"symptom/grad_norm"}))

    # Attention ΔW spectra: one line per (layer, matrix), matrix by line style.
    dw = _Panel("attn_dw", "ΔW spectral entropy\n(normalised)")
    matrices = sorted({m.group(2) for n in series if (m := _DW.match(n)) and keep(n)},
                      key=lambda mat: ({"q": 0, "k": 1}.get(mat, 2), mat))
    styles = {"q": "-", "k": "--"}
    for name in sorted(series, key=_natural):
        m = _DW.match(name)
        if m and keep(name):
            mat = m.group(2)
            dw.lines.append(_Line(name, *series[name], layer=int(m.group(1)), style=styles.get(mat, ":"),
                                  label=None))
            dw.names.add(name)
    if len(matrices) > 1 or (matrices and matrices[0] not in ("q", "")):
        # Style legend: which line style is which matrix (colours are in the layer legend).
        dw.style_legend = [(styles.get(mat, ":"), f"ΔW{mat.upper()}") for mat in matrices]
    panels.append(dw)

    # Δ2 entropy, min over heads: the logged _min series, else computed from the per-head series.
    d2 = _Panel("attn_delta2", "Δ2 entropy\n(min over heads)")
    heads: dict[int, list[str]] = {}
    for name in reduction.names:
        if (m := _D2_HEAD.match(name)) and keep(name):
            heads.setdefault(int(m.group(1)), []).append(name)
    logged = {int(m.group(1)): n for n in series if (m := _D2_MIN.match(n)) and keep(n)}
    for layer in sorted(set(logged) | (set(heads) & set(reduction.derived_min))):
        if layer in logged:
            d2.lines.append(_Line(logged[layer], *series[logged[layer]], layer=layer))
            d2.names.add(logged[layer])
        else:
            d2.lines.append(_Line(f"attn/layer{layer}/delta2_entropy_min",
                                  *reduction.derived_min[layer].points(), layer=layer))
        d2.names.update(heads.get(layer, ()))
    panels.append(d2)

    panels.append(_layer_panel("router_entropy", "routing entropy\n(mean over tokens, nats)", series,
                               _router("entropy_mean"), keep))
    panels.append(_layer_panel("router_load", "expert-load entropy\n(normalised, 1 = balanced)", series,
                               _router("load_entropy"), keep))
    panels.append(_layer_panel("router_cosine", "mean cosine of\nexpert rows", series, _router("mean_cosine"),
                               keep))

    # With explicit globs: anything else they select, grouped by name with the layer (and head) numbers blanked.
    if metrics is not None:
        shown = set().union(*(p.names for p in panels))
        groups: dict[str, list[str]] = {}
        for name in sorted(series, key=_natural):
            if name not in shown and keep(name):
                tmpl = re.sub(r"head\d+", "head*", _LAYER.sub("layer*", name))
                groups.setdefault(tmpl, []).append(name)
        if len(groups) > MAX_GENERIC_PANELS:
            warnings.warn(f"--metrics selects {len(groups)} more series groups; drawing the first "
                          f"{MAX_GENERIC_PANELS}: {', '.join(list(groups)[MAX_GENERIC_PANELS:])} left out",
                          RuntimeWarning, stacklevel=3)
        for tmpl, names in list(groups.items())[:MAX_GENERIC_PANELS]:
            p = _Panel(f"metric:{tmpl}", tmpl.replace("/", "/\n", 1) if len(tmpl) > 24 else tmpl)
            for name in names:
                m = _LAYER.search(name)
                p.lines.append(_Line(name, *series[name], layer=int(m.group(1)) if m else None,
                                     label=None if m else name))
                p.names.add(name)
            panels.append(p)
    return [p for p in panels if p.lines]


# ------------------------------------------------------------------------------------------------ figure
def _alert_layer(a: Alert) -> int | None:
    layer = a.detail.get("layer")
    if isinstance(layer, int) and not isinstance(layer, bool):
        return layer
    m = _LAYER.search(a.metric)
    return int(m.group(1)) if m else None


def _layer_colors(layers: Sequence[int]):
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    layers = sorted(set(layers))
    n = len(layers)
    # 0 .. 0.8: dark purple to green, stopping before yellow (poor contrast on white, close to the alert orange).
    return {layer: cmap(0.8 * i / max(n - 1, 1)) for i, layer in enumerate(layers)}


GUIDE_COLOR = "#1f77b4"  # alert levels (blue: not a layer colour, not an alert family's)


def _matched_series(pattern: str, panel: _Panel) -> str:
    """The series a rule's glob ``pattern`` covers in ``panel``, by their last name part (``dwq_entropy, dwk_entropy``
    for ``attn/*/dw?_entropy``): a legend names series, not globs."""
    import fnmatch

    names = dict.fromkeys(n.split("/")[-1] for n in [ln.name for ln in panel.lines] if fnmatch.fnmatchcase(n, pattern))
    return ", ".join(names) if names else pattern.split("/")[-1]


def _draw_guides(ax, panel: _Panel, reduction: RunReduction, alerts: Sequence[Alert], colors: Mapping[int, Any],
                 arming: Arming | None) -> list:
    """The detector's view in one panel (:mod:`~megatron_mech.records.report_guides`): the rules' alert levels,
    the baseline bands, the warm-up span. Returns the panel-legend handles of the levels and bands."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = []
    # The y range is the series' own, widened to the edges that can alert (the bad side of a band, a level), not
    # to the harmless side of a band (a grad-norm band would reach far below zero).
    y0, y1 = ylo, yhi = ax.get_ylim()
    last = reduction.last_step
    if arming is not None:  # up to the run's end at most: an unreached arming step must not stretch the x axis
        end = arming.step if last is None else min(arming.step, last)
        ax.axvspan(0, end, color="0.6", alpha=0.15, lw=0, zorder=0.2, gid="warmup")
    for baseline in panel_bands(panel.names, [ln.name for ln in panel.lines], alerts, reduction):
        if last is None or last < baseline.frozen_step:
            continue
        lo, hi = baseline.band
        color = colors.get(layer_of(baseline.metric), "0.4")
        # outlined, not filled: the bands of several series overlap, and translucent fills stack into dark blocks
        ax.fill_between([baseline.frozen_step, last], [lo, lo], [hi, hi], facecolor="none", edgecolor=color,
                        lw=0.9, ls=(0, (3, 2)), zorder=1, gid=f"band:{baseline.metric}")
        series = baseline.metric.split("/", 1)[-1]
        handles.append(Patch(facecolor="none", edgecolor=color, ls=(0, (3, 2)),
                             label=f"band {series}: median ± {baseline.threshold:g}×scale"))
        ylo = min(ylo, lo) if baseline.direction != "up" else ylo
        yhi = max(yhi, hi) if baseline.direction != "down" else yhi
    for level, pattern in panel_levels(panel.names, reduction.registry):
        style = dict(color=GUIDE_COLOR, ls=(0, (4, 2, 1, 2)), lw=1.1)
        ax.axhline(level, zorder=1.5, gid=f"level:{pattern}", **style)
        # a legend proxy: the panel's own labelled lines are its series
        handles.append(Line2D([], [], label=f"alert level {level:g} ({_matched_series(pattern, panel)})", **style))
        ylo, yhi = min(ylo, level), max(yhi, level)
    if ax.get_yscale() == "log":
        ax.set_ylim(ylo if 0 < ylo < y0 else y0, max(yhi, y1))
    else:
        pad = 0.03 * (yhi - ylo)  # the margin matplotlib would leave
        ax.set_ylim(ylo - pad if ylo < y0 else y0, yhi + pad if yhi > y1 else y1)
    return handles


def _draw_panel(ax, panel: _Panel, colors: Mapping[int, Any], alerts: Sequence[Alert], highlight: bool,
                alerted_layers: set, draw_guides: Callable[[], list]) -> None:
    """One panel: its series (NaN/inf as gaps, inf marked), the detector's guides (``draw_guides()``, after the
    series so the y range is theirs), the alert lines and markers, its legend."""
    from matplotlib.lines import Line2D

    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    labelled = False
    for ln in panel.lines:
        color = colors[ln.layer] if ln.layer is not None else None
        finite = [(s, v) for s, v in zip(ln.steps, ln.values) if math.isfinite(v)]
        # NaN breaks the line (a gap); ±inf is drawn as a gap too and marked below.
        ys = [v if math.isfinite(v) else math.nan for v in ln.values]
        lw, alpha = 1.4, 1.0
        if highlight and ln.layer is not None:
            lw, alpha = (2.4, 1.0) if ln.layer in alerted_layers else (1.0, 0.35)
        (h,) = ax.plot(ln.steps, ys, ls=ln.style, lw=lw, alpha=alpha, color=color, label=ln.label,
                       marker="." if len(finite) <= 30 else None, markersize=3,
                       zorder=3 if alpha == 1.0 else 2)
        labelled |= ln.label is not None
        bad = [s for s, v in zip(ln.steps, ln.values) if not math.isfinite(v)]
        if bad:
            ax.plot(bad, [0.04] * len(bad), ls="none", marker="x", ms=6, mew=1.5, color=h.get_color(),
                    transform=ax.get_xaxis_transform(), clip_on=False)
    if panel.logy:
        ax.set_yscale("log")
    guides = draw_guides()
    for a in alerts:
        ax.axvline(a.step, color=_family_color(a.family), ls=_family_style(a.family), lw=1.1, alpha=0.75,
                   zorder=0.5)
        if a.metric in panel.names and math.isfinite(a.value):
            ax.plot([a.step], [a.value], ls="none", marker="v", ms=8, mec="black", mew=0.6,
                    color=_family_color(a.family), zorder=5)
    handles = []
    if labelled:
        handles += ax.get_legend_handles_labels()[0]
    handles += guides
    for style, label in panel.style_legend:
        handles.append(Line2D([], [], color="0.3", ls=style, label=label))
    if handles:
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0),
                  borderaxespad=0.0, frameon=False)


def _annotate_first_alerts(top, alerts: Sequence[Alert]) -> None:
    """Label the first alert of each family in the top panel (staggered heights so labels do not collide)."""
    first_by_family: dict[str, Alert] = {}
    for a in alerts:
        first_by_family.setdefault(a.family, a)
    for i, fam in enumerate(family_order(first_by_family)):
        a = first_by_family[fam]
        where = "".join(f" {k[0].upper()}{v}" for k, v in a.detail.items() if k in ("layer", "head"))
        top.annotate(f"first {fam}: {a.metric.split('/')[-1]}{where} @ {a.step}",
                     xy=(a.step, 0.96 - 0.16 * i), xycoords=top.get_xaxis_transform(), xytext=(4, 0),
                     textcoords="offset points", va="top", fontsize=8, color=_family_color(fam),
                     bbox=dict(boxstyle="round,pad=0.2", fc="white", ec=_family_color(fam), lw=0.6, alpha=0.85))


def _figure_legends(fig, axes, alerts: Sequence[Alert], counts: Mapping[str, int], layers: Sequence[int],
                    colors: Mapping[int, Any], arming: Arming | None) -> None:
    """Alert families and the warm-up span (bottom) and layers (right; the same colour in every panel; a colour
    bar when many)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fam_handles = []
    for fam in family_order(a.family for a in alerts):
        fa = [a for a in alerts if a.family == fam]
        if fa:
            fam_handles.append(Line2D([], [], color=_family_color(fam), ls=_family_style(fam), lw=1.5,
                                      label=f"{fam} alert ×{counts[fam]} (first @ step {fa[0].step})"))
    if arming is not None:
        fam_handles.append(Patch(color="0.6", alpha=0.3, label=arming.label))
    if fam_handles:
        fig.legend(handles=fam_handles, loc="outside lower center", ncols=min(len(fam_handles), 3), fontsize=9,
                   frameon=False)
    if not layers:
        return
    if len(layers) <= 16:
        lay_handles = [Line2D([], [], color=colors[L], lw=2, label=f"layer {L}") for L in layers]
        fig.legend(handles=lay_handles, loc="outside right upper", fontsize=8, frameon=False,
                   title="layer colour", title_fontsize=8)
        return
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm, ListedColormap

    cmap = ListedColormap([colors[L] for L in layers])
    norm = BoundaryNorm(list(range(len(layers) + 1)), cmap.N)
    cb = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), shrink=0.6, aspect=40, pad=0.01)
    idx = list(range(0, len(layers), max(1, len(layers) // 8)))
    cb.set_ticks([i + 0.5 for i in idx], labels=[str(layers[i]) for i in idx])
    cb.set_label("layer")


def build_figure(records: Iterable[Mapping[str, Any]] | RunReduction, metrics: Sequence[str] | None = None,
                 title: str | None = None, arming: Arming | None = None):
    """Build (do not save) the report figure. Returns ``(figure, panels)`` with ``panels`` an ordered dict
    ``{panel key: Axes}``; keys among ``loss``, ``grad_norm``, ``attn_dw``, ``attn_delta2``, ``router_entropy``,
    ``router_load``, ``router_cosine`` and, for ``metrics`` globs outside those, ``metric:<name template>``.

    ``records``: the records (a list or a stream), or their :func:`reduce_run` made with the same ``metrics``.
    ``metrics``: fnmatch globs on metric names restricting what is drawn (the loss panel is always drawn).
    ``arming``: the warm-up span to shade (default: derived from the default rules and the records' interval,
    :func:`~megatron_mech.records.report_guides.resolve_arming`). Raises ValueError when there is nothing to draw.
    """
    from matplotlib.figure import Figure

    reduction = _reduction(records, metrics)
    if arming is None:
        arming = resolve_arming(run_settings(None), reduction)
    alerts = reduction.alerts()
    panels = _build_panels(reduction, metrics)
    if not panels:
        what = f" matching {list(metrics)}" if metrics is not None else ""
        raise ValueError(f"nothing to plot: the records hold no series{what}")

    layers = sorted({ln.layer for p in panels for ln in p.lines if ln.layer is not None})
    colors = _layer_colors(layers)
    fig = Figure(figsize=(13, 1.2 + 2.1 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    # With many layers, the layers named by alerts are drawn bold and the others faded, so the culprit stands out.
    alerted_layers = {_alert_layer(a) for a in alerts} - {None}
    highlight = len(layers) > 4 and bool(alerted_layers)
    out: dict[str, Any] = {}
    for ax, panel in zip(axes, panels):
        out[panel.key] = ax
        _draw_panel(ax, panel, colors, alerts, highlight, alerted_layers,
                    functools.partial(_draw_guides, ax, panel, reduction, alerts, colors, arming))
    _annotate_first_alerts(axes[0], alerts)
    axes[-1].set_xlabel("step")
    _figure_legends(fig, axes, alerts, reduction.alert_counts, layers, colors, arming)

    n_alerts = reduction.n_alerts
    sub = (f"steps {reduction.first_step}–{reduction.last_step} · {reduction.n_steps} logged steps · "
           f"{n_alerts} alert{'s' if n_alerts != 1 else ''}") if reduction.n_steps else ""
    fig.suptitle(f"{title or 'megatron-mech run'}\n{sub}", fontsize=12)
    return fig, out


def plot_run(run_dir_or_jsonl: str | Path, out_png: str | Path | None = None,
             metrics: Sequence[str] | None = None) -> Path:
    """Draw the report PNG of a run (see the module docstring) and return its path.

    Args:
        run_dir_or_jsonl: run directory (reads ``RUN_DIR/mech.jsonl``) or a JSONL file.
        out_png: output path; default ``report.png`` next to the JSONL.
        metrics: fnmatch globs restricting the drawn series (loss always drawn), e.g. ``["router/*"]``.
    """
    jsonl = resolve_jsonl(run_dir_or_jsonl)
    settings = run_settings(jsonl)
    return _save_plot(jsonl, reduce_run(iter_jsonl(jsonl), metrics, settings.registry), settings, out_png, metrics)


def _save_plot(jsonl: Path, reduction: RunReduction, settings: RunSettings, out_png: str | Path | None,
               metrics: Sequence[str] | None) -> Path:
    if not reduction.n_records:
        raise ValueError(f"{jsonl} holds no records (empty log, or the run has not logged yet)")
    fig, _ = build_figure(reduction, metrics=metrics, title=run_name(jsonl),
                          arming=resolve_arming(settings, reduction))
    out = Path(out_png) if out_png is not None else jsonl.with_name(REPORT_PNG)
    out.parent.mkdir(parents=True, exist_ok=True)
    # never through a link; the format from the name, as savefig does given a path
    write_file_atomically(out, lambda f: fig.savefig(f, format=out.suffix[1:] or "png", dpi=110))
    return out


# ------------------------------------------------------------------------------------------------ summary
def _fmt(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:.4g}" if math.isfinite(x) else str(x))


def summarize_run(records: Iterable[Mapping[str, Any]] | RunReduction, title: str | None = None,
                  arming: Arming | None = None) -> str:
    """Markdown summary: steps covered, final loss, alert counts per family, the verdict (:func:`run_verdict`:
    the first alert's diagnosis, or whether the detectors were armed when none fired), the first alert of each
    family with its attribution and its lead over the first symptom alert, then the alert list. ``records``: the
    records (a list or a stream) or their :func:`reduce_run`; the numbers are exact (see
    :mod:`~megatron_mech.records.series_reduction` for a resume that rewinds further than it holds exactly).
    ``arming``: the run's armed-from step (:func:`~megatron_mech.records.report_guides.resolve_arming`); without
    it a run without alerts reads "No alerts fired." alone."""
    reduction = _reduction(records, None)
    alerts = reduction.alerts()
    lines = [f"# megatron-mech report: {title}" if title else "# megatron-mech report", ""]
    if not reduction.n_steps:
        return "\n".join(lines + ["No records.", ""])
    lines.append(f"- **Steps covered:** {reduction.first_step} – {reduction.last_step} "
                 f"({reduction.n_steps} logged steps)")
    if reduction.n_repeated:
        lines.append(f"- **Note:** {reduction.n_repeated} step(s) logged more than once (a resume without "
                     "`truncate_after_step`?); the last record of each step is used.")
    loss = reduction.loss
    if loss is not None:
        (final_step, final), last_finite = loss.final, loss.last_finite
        last_ok = "" if math.isfinite(final) or last_finite is None else (
            f"; last finite {_fmt(last_finite[1])} at step {last_finite[0]}")
        lines.append(f"- **Final loss:** {_fmt(final)} (step {final_step}{last_ok})")
        if loss.min_finite is not None:
            lines.append(f"- **Loss range:** first {_fmt(loss.first[1])}, min {_fmt(loss.min_finite)}")
        if loss.n_nonfinite:
            lines.append(f"- **Non-finite loss** at {loss.n_nonfinite} step(s), first at step {loss.first_nonfinite}")
    else:
        lines.append("- **Final loss:** not logged")
    counts = reduction.alert_counts
    lines.append(f"- **Alerts:** {reduction.n_alerts} (" + ", ".join(f"{f} {counts.get(f, 0)}"
                                                              for f in family_order((*FAMILIES, *counts))) + ")")
    if len(alerts) < reduction.n_alerts:
        lines.append(f"- **Alerts kept:** the first {reduction.max_alerts_per_family} of each family; the rest are "
                     f"only counted ({len(alerts)} listed and drawn).")
    lines.append(f"- **Verdict:** {run_verdict(alerts, reduction.last_step, arming.step if arming else None)}")
    lines.append("")

    first = {}
    for a in alerts:
        first.setdefault(a.family, a)
    if first:
        lines += ["## First alert per family", ""]
        sym = first.get("symptom")
        for fam in family_order((*FAMILIES, *first)):
            if fam not in first:
                lines.append(f"- **{fam}:** none")
                continue
            a = first[fam]
            lead = ""
            if fam != "symptom":
                lead = (f" — **{sym.step - a.step} steps before** the first symptom alert (step {sym.step})"
                        if sym is not None and sym.step >= a.step else
                        (f" — after the first symptom alert (step {sym.step})" if sym is not None
                         else " — no symptom alert yet"))
            lines.append(f"- **{fam}:** {a.describe()}{lead}")
        from megatron_mech.core.attribution import alert_lines

        lines += ["", "## Attribution (alerts grouped by cause, subsystem and layer, earliest first; later alerts "
                  "marked as following the first cause)", ""]
        lines += [f"- {line}" for line in alert_lines(alerts)]
        lines += ["", "## All alerts", "", "| step | family | metric | value | baseline | score | detail |",
                  "|---:|---|---|---:|---:|---:|---|"]
        limit = 50
        for a in alerts[:limit]:
            detail = ", ".join(f"{k}={v}" for k, v in a.detail.items())
            lines.append(f"| {a.step} | {a.family} | `{a.metric}` | {_fmt(a.value)} | {_fmt(a.baseline)} | "
                         f"{_fmt(a.score)} | {detail} |")
        if reduction.n_alerts > limit:
            lines.append(f"\n… and {reduction.n_alerts - limit} more.")
    else:
        lines.append(run_verdict(alerts, reduction.last_step, arming.step if arming else None))
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI
def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``megatron-mech report``."""
    parser.add_argument("run_dir", help=f"run directory holding {JSONL_NAME} (or the path of a JSONL log)")
    parser.add_argument("--out", default=None,
                        help=f"output PNG (default: {REPORT_PNG} in --out-dir)")
    parser.add_argument("--out-dir", default=None,
                        help=f"where {REPORT_PNG} and {REPORT_MD} go (default: next to the JSONL); for a run "
                             "directory you cannot write into")
    parser.add_argument("--metrics", nargs="+", default=None, metavar="GLOB",
                        help="only draw metrics matching these fnmatch globs, e.g. 'router/*' "
                             "'attn/layer1/*' (the loss panel is always drawn)")


def missing_plot_package() -> str | None:
    """Why no report can be drawn here, as one line with the install command (matplotlib cannot be imported), or
    None. The ``report`` and ``train`` commands check it first: a bare ImportError would end ``train`` only after
    the whole run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"the report is drawn with matplotlib, which cannot be imported ({e}): pip install 'megatron-mech[viz]'"
    return None


def run_report(args: argparse.Namespace) -> int:
    """Write the PNG and ``report.md``, print their paths. Returns 0, or 2 (message on stderr) when matplotlib is
    missing, or the log is missing, empty, not a log or has nothing to draw."""
    out_dir = getattr(args, "out_dir", None)
    missing = missing_plot_package()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    try:
        jsonl = resolve_jsonl(args.run_dir)
        metrics = getattr(args, "metrics", None)
        settings = run_settings(jsonl)
        reduction = reduce_run(iter_jsonl(jsonl, first_lines=REFUSE_AFTER_LINES), metrics, settings.registry)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_png = getattr(args, "out", None) or (Path(out_dir) / REPORT_PNG if out_dir else None)
    md_path = Path(out_dir) / REPORT_MD if out_dir else jsonl.with_name(REPORT_MD)
    try:
        png = _save_plot(jsonl, reduction, settings, out_png, metrics)
        md = summarize_run(reduction, title=run_name(jsonl), arming=resolve_arming(settings, reduction))
        try:
            rel = png.resolve().relative_to(md_path.resolve().parent)
        except ValueError:
            rel = png.resolve()
        md_path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(md_path, md + f"\n![report]({rel.as_posix()})\n")  # never through a link
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write the report ({e}); choose a writable place with --out-dir", file=sys.stderr)
        return 2
    print(f"plot:    {png}")
    print(f"summary: {md_path}")
    return 0
