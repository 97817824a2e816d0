"""The metrics reference: every series name a run records, what it means, its unit, what produces it, and the
detector rule that alerts on it — one table, rendered as ``docs/metrics.md``.

The names come from the monitors' own templates (:mod:`megatron_mech.monitors.metric_names`: the attention
monitor's :mod:`~megatron_mech.monitors.attention.names`, ``ROUTER_NAME``, ``EXPERT_NAME``, ...) and MoLS's
(:mod:`megatron_mech.core.mols_names`), filled here with each quantity; the meanings, units and producers are
written here (:data:`METRICS`, :data:`RECORD_FIELDS`); the alert columns are never written by hand:
:func:`alert_rule` finds, like :class:`~megatron_mech.core.detect.DetectorRegistry` does, the first of
:func:`~megatron_mech.monitors.registry.default_rules` whose ``fnmatch`` pattern matches the name, so the page
follows the rules. ``tests/unit/records/test_metrics_reference.py`` checks the table against the names a real
run records and the committed page against :func:`render_markdown`.

Name syntax: ``{X}`` is a placeholder (:data:`PLACEHOLDERS`: its values and examples), ``[...]`` a part present
only under a flag (the TP qualifier ``/tp{r}`` of ``--mech-dw-scope slice``).

Regenerate the page: ``megatron-mech metrics --output docs/metrics.md`` (or ``python -m
megatron_mech.records.metrics_reference > docs/metrics.md``).
"""
from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_mech.core import mols_names
from megatron_mech.core.detect import DetectorConfig, SeriesRule
from megatron_mech.core.mols import MEASURED_KEYS
from megatron_mech.core.taxonomy import MODULE_CLASSES
from megatron_mech.monitors.attention.names import AGGREGATE_NAME, DW_NAME, HEAD_NAME, LINEAR_NAME
from megatron_mech.monitors.experts import EXPERT_LAYER_NAME, EXPERT_NAME
from megatron_mech.monitors.max_logit import MAX_LOGIT_LAYER_NAME, MAX_LOGIT_METRIC
from megatron_mech.monitors.metric_names import (
    SYMPTOM_GRAD_NORM,
    SYMPTOM_LOSS,
    SYMPTOM_SKIPPED_STEPS,
    SYMPTOM_STEP_SKIPPED,
    fill,
)
from megatron_mech.monitors.registry import default_rules
from megatron_mech.monitors.router import ROUTER_NAME

__all__ = ["METRICS", "PLACEHOLDERS", "RECORD_FIELDS", "SLICE_SCOPE_FLAG", "MetricEntry", "RecordField", "alert_rule",
           "entry_for", "render_markdown"]

SLICE_SCOPE_FLAG = "--mech-dw-scope slice"


@dataclass(frozen=True)
class Placeholder:
    """A ``{X}`` in a name: the regular expression of its values and a few examples (to find the alert rule)."""

    regex: str
    examples: tuple
    meaning: str


PLACEHOLDERS = {
    "L": Placeholder(r"[0-9]+", ("0", "1", "13"), "global layer index, from 0 (over all pipeline stages)"),
    "H": Placeholder(r"[0-9]+", ("0", "3", "31"), "global query-head index, from 0 (over all TP ranks)"),
    "E": Placeholder(r"[0-9]+", ("0", "5"), "global expert index, from 0 (over all expert-parallel ranks)"),
    "r": Placeholder(r"[0-9]+", ("0", "1"), "tensor-parallel rank (only with `--mech-dw-scope slice`)"),
    "m": Placeholder(r"[qk]", ("q", "k"), "`q` or `k`: the Q or the K rows of the fused `linear_qkv` weight"),
    "term": Placeholder(r"delta[123]", ("delta1", "delta2", "delta3"), "a QK-increment term of `--mech-qk-terms`"),
    "module": Placeholder(r"[^/]+", ("linear_proj", "linear_fc1", "linear_fc2"),
                          "a dense linear of the layer: `linear_proj` (attention output), `linear_fc1`, `linear_fc2` "
                          "(MLP; dense layers only)"),
    "key": Placeholder("(?:" + "|".join(MEASURED_KEYS) + ")", MEASURED_KEYS,
                       "a measured MoLS key: a module class or a fused-QKV row block (`qkv_q`, `qkv_k`, `qkv_v`)"),
    "class": Placeholder("(?:" + "|".join(MODULE_CLASSES) + ")", MODULE_CLASSES,
                         "a module class: " + ", ".join(f"`{c}`" for c in MODULE_CLASSES)),
}
_TOKEN = re.compile(r"\{(\w+)\}|\[|\]|[^{\[\]]+")


@dataclass(frozen=True)
class MetricEntry:
    """One documented series-name pattern.

    Attributes:
        name: the name in the ``{X}`` / ``[...]`` syntax of the module docstring.
        meaning: what the value is.
        unit: unit and range.
        producer: what writes it (monitor, hook part) and when.
        flags: flags (beyond the defaults) without which the name is never recorded; a ``[...]`` part of the
            name adds :data:`SLICE_SCOPE_FLAG` for that variant only.
        section: where a ``mech.jsonl`` record holds it: ``"metrics"`` (the detectors' input) or ``"mols"``.
    """

    name: str
    meaning: str
    unit: str
    producer: str
    flags: tuple = ()
    section: str = "metrics"

    def regex(self, optional: Optional[bool] = None) -> re.Pattern:
        """The names this entry covers; ``optional`` True/False: only the variant with/without the ``[...]`` part."""
        name = self.name
        if optional is False:
            name = re.sub(r"\[[^\]]*\]", "", name)
        elif optional:
            name = name.replace("[", "").replace("]", "")
        out = []
        for token in _TOKEN.finditer(name):
            text, placeholder = token.group(0), token.group(1)
            if placeholder is not None:
                out.append(f"(?:{PLACEHOLDERS[placeholder].regex})")
            elif text in "[]":
                out.append("(?:" if text == "[" else ")?")
            else:
                out.append(re.escape(text))
        return re.compile("".join(out))

    @property
    def has_optional_part(self) -> bool:
        return "[" in self.name

    def variants(self) -> list[tuple[Optional[bool], tuple]]:
        """``(optional, flags)`` per variant: without and (if any) with the ``[...]`` part, and their flags."""
        if not self.has_optional_part:
            return [(None, self.flags)]
        return [(False, self.flags), (True, (*self.flags, SLICE_SCOPE_FLAG))]

    def examples(self) -> list[str]:
        """Concrete names of every variant, with every combination of the placeholders' examples."""
        names = [re.sub(r"\[[^\]]*\]", "", self.name), self.name.replace("[", "").replace("]", "")]
        out = []
        for name in dict.fromkeys(names):
            keys = re.findall(r"\{(\w+)\}", name)
            for values in itertools.product(*(PLACEHOLDERS[k].examples for k in keys)):
                concrete = name
                for k, v in zip(keys, values):
                    concrete = concrete.replace("{" + k + "}", v, 1)
                out.append(concrete)
        return out


def _attention_dw(matrix_name: str, template: str, subject: str, flags: tuple = ()) -> list[MetricEntry]:
    """The six ΔW series of one matrix kind (attention Q/K rows, or a dense linear), named by the monitor's
    ``template`` (its ``{quantity}`` filled)."""
    producer = "attention monitor, every evaluation"
    name = lambda quantity: fill(template, quantity=quantity)  # noqa: E731
    return [
        MetricEntry(name("entropy"), f"Normalised spectral entropy of ΔW of {subject} (p_i ∝ σ_i², divided by "
                    f"log min(rows, cols)): 1 = a flat update spectrum, 0 = a single mode. Null "
                    f"(not measured) while `{matrix_name}_frozen` is 1.", "dimensionless, [0, 1]", producer, flags),
        MetricEntry(name("effective_rank"), "Effective rank exp(H) of that ΔW (H: the unnormalised entropy, "
                    "nats). Null while frozen.", "count, [1, min(rows, cols)]", producer, flags),
        MetricEntry(name("stable_rank"), "Stable rank ‖ΔW‖_F² / ‖ΔW‖₂² of that ΔW. Null while frozen.",
                    "count, [1, rank ΔW]", producer, flags),
        MetricEntry(name("fro"), "Frobenius norm ‖ΔW‖_F of that ΔW.", "weight units, ≥ 0", producer, flags),
        MetricEntry(name("update_ratio"), "‖ΔW‖_F / ‖W_(t−δ)‖_F: the update relative to the weights (NaN "
                    "when W_(t−δ) = 0).", "dimensionless, ≥ 0", producer, flags),
        MetricEntry(name("frozen"), "1 when that ΔW is exactly zero (a frozen matrix, or lr 0): its entropy and "
                    "ranks are then null instead of NaN, so it never looks like a fault; else 0.", "flag, 0 or 1",
                    producer, flags),
    ]


_QKV = "the {m} rows of layer L's fused `linear_qkv`"
_TERM = {"delta1": "Δ1 = W_q′W_k′ᵀ − W_qW_kᵀ (the full increment; spectrum length 2·d_head)",
         "delta2": "Δ2 = ΔW_q W_kᵀ + W_q ΔW_kᵀ (first order, the early-warning term; spectrum length 2·d_head)",
         "delta3": "Δ3 = ΔW_q ΔW_kᵀ (second order; spectrum length d_head)"}
_HEAD = ("Normalised spectral entropy of head H's QK-product increment {what} over the last δ steps (p_i ∝ σ_i², "
         "divided by log of the spectrum length). Null when the increment vanishes with a frozen ΔW_q/ΔW_k.")
_QK_PRODUCER = "attention monitor, every evaluation, for each term of `--mech-qk-terms` (default: all three)"
_ROUTER = "router monitor (MoE models), every evaluation"
_EXPERT = "expert monitor (megatron-core MoE layers), every evaluation"
_MOLS = "MoLS, every record"


def _router(statistic: str) -> str:
    return fill(ROUTER_NAME, statistic=statistic)


def _expert(quantity: str) -> str:
    return fill(EXPERT_NAME, quantity=quantity)


def _expert_layer(summary: str) -> str:
    return fill(EXPERT_LAYER_NAME, summary=summary)


METRICS: tuple = (
    # ------------------------------------------------------------------ attention: ΔW of the Q and K rows
    *_attention_dw("dw{m}", DW_NAME, _QKV),
    # ------------------------------------------------------------------ attention: per-head QK increments
    *(MetricEntry(fill(HEAD_NAME, term=term), _HEAD.format(what=what), "dimensionless, [0, 1]",
                  _QK_PRODUCER) for term, what in _TERM.items()),
    MetricEntry(fill(AGGREGATE_NAME, aggregate="mean"), "Mean over layer L's heads of "
                "`attn/layer{L}/head{H}/{term}_entropy` (NaN if any head is NaN: a NaN is a fault flag).",
                "dimensionless, [0, 1]", _QK_PRODUCER),
    MetricEntry(fill(AGGREGATE_NAME, aggregate="min"), "Minimum over layer L's heads of "
                "`attn/layer{L}/head{H}/{term}_entropy` (NaN if any head is NaN).", "dimensionless, [0, 1]",
                _QK_PRODUCER),
    # ------------------------------------------------------------------ dense linears
    *_attention_dw("dw", fill(LINEAR_NAME, linear="layer{L}/{module}"),
                   "the dense linear {module} of layer L",
                   flags=("--mech-all-linears",)),
    # ------------------------------------------------------------------ router
    MetricEntry(_router("tokens"), "Tokens in this evaluation's routing statistics: every token of the "
                "evaluation step over all ranks, counted once (every n-th of each micro-batch with "
                "`--mech-router-token-stride n`); non-finite ones excluded (see `nonfinite_tokens`).",
                "count, ≥ 0", _ROUTER),
    MetricEntry(_router("nonfinite_tokens"), "Tokens skipped because a router logit was NaN or +inf (or "
                "every logit −inf).", "count, ≥ 0", _ROUTER),
    MetricEntry(_router("entropy_mean"), "Mean per-token routing entropy H = −Σ_e p_e log p_e of "
                "p = softmax(router logits) over all E experts, over the step's tokens.", "nats, [0, log E]", _ROUTER),
    MetricEntry(_router("entropy_norm_mean"), "`entropy_mean` / log E.", "dimensionless, [0, 1]", _ROUTER),
    MetricEntry(_router("entropy_std"), "Population standard deviation of the per-token routing entropy.",
                "nats, ≥ 0", _ROUTER),
    MetricEntry(_router("entropy_min"), "Smallest per-token routing entropy (one extreme token).",
                "nats, [0, log E]", _ROUTER),
    MetricEntry(_router("entropy_p05"), "5th percentile of the per-token routing entropy, from a 20-bin "
                "histogram of H / log E (error about one bin, log E / 20).", "nats, [0, log E]", _ROUTER),
    MetricEntry(_router("entropy_p50"), "Median per-token routing entropy (same histogram).",
                "nats, [0, log E]", _ROUTER),
    MetricEntry(_router("low_entropy_frac"), "Fraction of tokens whose normalised routing entropy H / log E "
                "is below 0.5 (sharply routed tokens).", "fraction, [0, 1]", _ROUTER),
    MetricEntry(_router("margin_mean"), "Mean top-1 minus top-2 router logit per token.",
                "logit units, ≥ 0", _ROUTER),
    MetricEntry(_router("margin_std"), "Population standard deviation of that margin.", "logit units, ≥ 0",
                _ROUTER),
    MetricEntry(_router("load_entropy"), "Entropy of the experts' shares of all top-k assignments, / log E: "
                "1 = perfectly balanced, 0 = one expert takes everything.", "dimensionless, [0, 1]", _ROUTER),
    MetricEntry(_router("effective_experts"), "exp(entropy of the load shares): the number of equally "
                "loaded experts with the same entropy.", "count, [1, E]", _ROUTER),
    MetricEntry(_router("load_cv"), "Coefficient of variation (std / mean) of the per-expert top-k counts.",
                "dimensionless, [0, √(E − 1)]", _ROUTER),
    MetricEntry(_router("expert_share_excess"), "The busiest expert's share s of all top-k assignments, from "
                "balanced to the most a top-k router allows: (s − 1/E) / (1/k − 1/E), 0 = every expert 1/E, 1 = the "
                "expert in every token's top-k (that expert is in the alert's detail). Absent when k = E.",
                "dimensionless, [0, 1]", _ROUTER),
    MetricEntry(_router("mean_cosine"), "Mean cosine similarity over pairs of distinct expert rows of the "
                "router weight [E, d] (rows becoming alike: a router that cannot discriminate).",
                "dimensionless, [−1/(E − 1), 1]", _ROUTER),
    MetricEntry(_router("conditioning"), "max_i ‖w_i − w̄‖ / ‖w̄‖ over the router weight's expert rows w_i "
                "(w̄: the mean row); small = rows nearly identical. inf when ‖w̄‖ = 0.", "dimensionless, ≥ 0",
                _ROUTER),
    MetricEntry(_router("mean_deviation"), "mean_i ‖w_i − w̄‖ / ‖w̄‖ (as `conditioning`, the mean instead of "
                "the max).", "dimensionless, ≥ 0", _ROUTER),
    # ------------------------------------------------------------------ experts
    MetricEntry(_expert("update_ratio"), "‖ΔW‖_F / ‖W_(t−δ)‖_F of expert E over all its matrices "
                "(fc1 and fc2), ΔW over the last δ steps.", "dimensionless, ≥ 0", _EXPERT, ("--mech-experts",)),
    MetricEntry(_expert("stable_rank"), "Stable rank ‖ΔW‖_F² / ‖ΔW‖₂² of expert E's fc1 update "
                "(‖ΔW‖₂ from 8 power iterations: an upper bound, tight for a dominant direction; NaN when ΔW = 0).",
                "count, [1, rank ΔW]", _EXPERT, ("--mech-experts",)),
    MetricEntry(_expert_layer("update_ratio_mean"), "Mean of `e{E}/update_ratio` over the layer's experts.",
                "dimensionless, ≥ 0", _EXPERT, ("--mech-experts",)),
    MetricEntry(_expert_layer("update_ratio_spread"), "Standard deviation / mean of `e{E}/update_ratio` across "
                "the layer's experts.", "dimensionless, ≥ 0", _EXPERT, ("--mech-experts",)),
    MetricEntry(_expert_layer("update_ratio_zmax"), "Largest |z-score| of `e{E}/update_ratio` across the layer's "
                "experts (its expert is in the alert details).", "dimensionless, [0, √(E − 1)]", _EXPERT,
                ("--mech-experts",)),
    MetricEntry(_expert_layer("stable_rank_min"), "Smallest `e{E}/stable_rank` of the layer.",
                "count, ≥ 1", _EXPERT, ("--mech-experts",)),
    MetricEntry(_expert_layer("stable_rank_mean"), "Mean `e{E}/stable_rank` of the layer.", "count, ≥ 1",
                _EXPERT, ("--mech-experts",)),
    # ------------------------------------------------------------------ symptoms
    MetricEntry(SYMPTOM_LOSS, "The training loss the trainer reports for the step (LM cross-entropy averaged over "
                "micro-batches and data-parallel ranks). Also judged on any step where it is non-finite: at once, or "
                "at the next evaluation when the trainer hands it over on the device (DeepSpeed), with its own step.",
                "nats per token", "hook, every evaluation"),
    MetricEntry(SYMPTOM_GRAD_NORM, "The optimizer's global gradient L2 norm for the step, as the trainer reports "
                "it. Also judged on any step where it is non-finite: at once, or at the next evaluation when the "
                "trainer hands it over on the device (DeepSpeed), with its own step.", "gradient units, ≥ 0",
                "hook, every evaluation where the trainer reports a grad norm"),
    MetricEntry(SYMPTOM_SKIPPED_STEPS, "Optimizer steps the optimizer skipped since the previous evaluation "
                "(non-finite gradients under DeepSpeed's bf16/ZeRO optimizers, a loss-scale overflow), as the "
                "trainer reports them: the weights stayed as they were on those steps. An evaluation where at least "
                "half of the steps since the previous one were skipped (sustained skipping; skips before any step "
                "went through, a loss scaler's start-up search, are counted but never alerted) raises one alert "
                "naming the count (`optimizer steps skipped: 10 of the last 10; weights unchanged while the LR was "
                "> 0`); the run's total is `summary.json`'s `optimizer_steps_skipped`.", "count, ≥ 0",
                "hook, on the evaluations after a skipped step, where the trainer reports them (megatron-core "
                "entry point, DeepSpeed)"),
    MetricEntry(SYMPTOM_STEP_SKIPPED, "1 on a step whose optimizer step the trainer reported skipped (absent "
                "otherwise). No rule judges it; the diagnosis reads it: a non-finite grad norm on such a step, with a "
                "finite loss, is why the optimizer refused the step (the weights kept their values), and is "
                "diagnosed as skipped optimizer steps, not as a blow-up.", "1",
                "hook, on the records of skipped steps, where the trainer reports them (megatron-core entry point, "
                "DeepSpeed)"),
    MetricEntry(MAX_LOGIT_METRIC, "Largest pre-softmax attention logit scale·q·k over every layer, head, "
                "unmasked query/key pair, micro-batch and rank of the evaluation step.", "logit units",
                "hook (max-logit recorder), every evaluation, where the adapter captures attention inputs "
                "(megatron-core entry point, Megatron-LM forks, DeepSpeed's HF attention)"),
    MetricEntry(MAX_LOGIT_LAYER_NAME, "As `symptom/max_attn_logit`, over layer L only; the query head holding it "
                "(global index, over all TP ranks) is in the alert's detail.", "logit units",
                "hook (max-logit recorder), every evaluation, where the adapter captures attention inputs "
                "(megatron-core entry point, Megatron-LM forks, DeepSpeed's HF attention)"),
    # ------------------------------------------------------------------ MoLS (the record's "mols" section)
    MetricEntry(mols_names.SNR, "Gradient SNR S = ‖G‖² / tr(Σ) of the key's parameters: the running window "
                "estimate during the window, the final one after (0 when ‖G‖² < 0, inf when tr(Σ) ≤ 0).",
                "dimensionless, ≥ 0", _MOLS, ("--mech-mols",), "mols"),
    MetricEntry(mols_names.GRAD_SQ, "Unbiased estimate of the squared norm ‖G‖² of the mean gradient (may be "
                "slightly negative from noise).", "gradient units²", _MOLS, ("--mech-mols",), "mols"),
    MetricEntry(mols_names.TRACE_COV, "Unbiased estimate of the per-example gradient noise tr(Σ) (may be ≤ 0 "
                "from noise).", "gradient units²", _MOLS, ("--mech-mols",), "mols"),
    MetricEntry(mols_names.ALPHA, "Multiplier α = √(S_base / S_class) clamped to `--mech-mols-clamp` (1 for a "
                "degenerate SNR; the hand-set value with `--mech-mols-fixed`); after the window.",
                "multiplier, within the clamp", _MOLS, ("--mech-mols",), "mols"),
    MetricEntry(mols_names.ALPHA_RAW, "α before the clamp (absent for a degenerate SNR); after the window.",
                "multiplier, > 0", _MOLS, ("--mech-mols",), "mols"),
    MetricEntry(mols_names.ALPHA_MEASURED, "The clamped α measured from the SNRs, reported beside the "
                "hand-set multipliers.", "multiplier", _MOLS,
                ("--mech-mols", "--mech-mols-fixed"), "mols"),
    MetricEntry(mols_names.TARGET, "The param-group multiplier the ramp goes to (α, or for the fused-QKV `qk` "
                "group the `--mech-mols-fused-qkv-rule` mix of α_qk and α_vo; 1 for unscaled classes).",
                "multiplier", _MOLS, ("--mech-mols",), "mols"),
    MetricEntry(mols_names.MULT, "The lr multiplier in force at this step (1 before the window end, ramped "
                "to the target).", "multiplier", _MOLS, ("--mech-mols",), "mols"),
    MetricEntry(mols_names.DIAG_SNR, "SNR of the latest post-window diagnostic block (report only; the "
                "multipliers do not change).", "dimensionless, ≥ 0", _MOLS,
                ("--mech-mols", "--mech-mols-diagnostic-interval"), "mols"),
    MetricEntry(mols_names.DIAG_ALPHA, "Unclamped α that block's SNRs would give (NaN when degenerate).",
                "multiplier", _MOLS,
                ("--mech-mols", "--mech-mols-diagnostic-interval"), "mols"),
    MetricEntry(mols_names.DIAG_END, "Step at which the latest diagnostic block ended.", "step",
                _MOLS, ("--mech-mols", "--mech-mols-diagnostic-interval"), "mols"),
    MetricEntry(mols_names.WINDOW_OBSERVED, "Steps the estimation window has observed so far.", "count, ≥ 0",
                _MOLS, ("--mech-mols",), "mols"),
    MetricEntry(mols_names.DONE, "1 once the window has closed and α is known, else 0.", "flag, 0 or 1", _MOLS,
                ("--mech-mols",), "mols"),
    MetricEntry(mols_names.STATUS, "Where the estimate stands: `window` (open), `estimated` (α from the SNRs), "
                "`not_estimated` (no α could be formed, every multiplier stays 1; the hook also logs a warning) or "
                "`fixed` (hand-set multipliers).", "string (not a series: no scalar tag)", _MOLS, ("--mech-mols",),
                "mols"),
    MetricEntry(mols_names.STATUS_REASON, "Why no α could be formed (the base class, its estimate and what to change: "
                "a longer `--mech-mols-window`, or another base); only with `not_estimated`.",
                "string (not a series: no scalar tag)", _MOLS, ("--mech-mols",), "mols"),
)


@dataclass(frozen=True)
class RecordField:
    """A top-level key of a ``mech.jsonl`` record."""

    key: str
    meaning: str
    producer: str
    tensorboard: str


RECORD_FIELDS: tuple = (
    RecordField("step", "the optimizer step the record describes, from 1", "every record", "(the x axis)"),
    RecordField("loss", "the step's training loss (as `symptom/loss`)", "every record",
                "`mech/symptom/loss` (unless the metrics hold it)"),
    RecordField("lr", "the base learning rate of the step", "every record", "`mech/train/lr`"),
    RecordField("grad_norm", "the global gradient norm (null when the trainer reports none)", "every record",
                "`mech/symptom/grad_norm` (unless the metrics hold it)"),
    RecordField("metrics", "the monitor series of the tables above; null = not measured this step", "every record",
                "`mech/<name>`"),
    RecordField("alerts", "the alerts fired at this step (metric, family, step, value, baseline, score, detail)",
                "every record", "text `mech/alerts`; scalars `mech/alerts/<family>` = the family's alerts at this "
                "step (only at steps where one fired)"),
    RecordField("mols", "the `mols/...` series above", "`--mech-mols`", "`mech/<name>` (e.g. "
                "`mech/mols/snr/qk`)"),
    RecordField("tokens", "training tokens consumed up to this step", "megatron-core entry point",
                "`mech/train/tokens`"),
    RecordField("update_successful", "false when the optimizer skipped the step (loss-scale overflow)",
                "Megatron-LM forks", "—"),
    RecordField("mols_group_lr", "the distinct lrs of each MoLS param group this step", "Megatron-LM forks with "
                "`--mech-mols`", "`mech/mols_group_lr/<class>/<i>`"),
)


def entry_for(name: str, entries: Sequence[MetricEntry] = METRICS) -> list[MetricEntry]:
    """The entries whose pattern covers ``name`` (exactly one for every name a run records)."""
    return [e for e in entries if e.regex().fullmatch(name)]


def alert_rule(entry: MetricEntry, rules: Optional[Sequence[SeriesRule]] = None) -> Optional[SeriesRule]:
    """The detector rule that judges ``entry``'s series: the first rule (``fnmatch``, as the registry matches) for
    every example name of the entry, ``None`` when none matches or the entry is not a detector input (the ``mols``
    section). Raises ``ValueError`` when the examples of one entry reach different rules: the entry would have to
    be split to be documented."""
    if entry.section != "metrics":
        return None
    rules = list(default_rules() if rules is None else rules)
    found = {}
    for name in entry.examples():
        found[name] = next((i for i, r in enumerate(rules) if r.matches(name)), None)
    if len(set(found.values())) != 1:
        raise ValueError(f"metrics reference: {entry.name!r} spans several detector rules "
                         f"({ {n: rules[i].pattern if i is not None else None for n, i in found.items()} }); "
                         f"split the entry")
    index = next(iter(found.values()))
    return None if index is None else rules[index]


def _number(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _rule_cells(entry: MetricEntry) -> list[str]:
    rule = alert_rule(entry)
    if rule is None:
        return ["logged only", "", "", "", "", ""]
    c: DetectorConfig = rule.config(DetectorConfig())
    if rule.kind == "level":  # no score, no baseline: the level alone, armed from the first evaluation
        return [f"`{rule.pattern}` ({rule.family}, level rule)", c.direction, "—",
                ("< " if c.direction == "down" else "> ") + _number(c.level), str(c.persistence),
                "none: from the first evaluation"]
    level = "—" if c.level is None else ("≤ " if c.direction == "down" else "≥ ") + _number(c.level)
    if c.collapse is not None:
        level += f", or its layer ≤ {_number(c.collapse)} × baseline"
    baseline = (f"{c.warmup} + {c.baseline}, "
                + ("frozen" if not c.track else f"tracking (lag {c.track})"))
    return [f"`{rule.pattern}` ({rule.family})", c.direction, _number(c.threshold), level, str(c.persistence),
            baseline]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _flags(entry: MetricEntry) -> str:
    parts = [f"`{f}`" for f in entry.flags]
    if entry.has_optional_part:
        parts.append(f"`[...]`: `{SLICE_SCOPE_FLAG}`")
    return ", ".join(parts) or "default"


_GROUPS = (("Attention (ΔW of the Q/K rows and per-head QK increments)", "attn/"),
           ("Dense linears", "linear/"), ("Router", "router/"), ("Experts", "expert/"), ("Symptoms", "symptom/"),
           ("MoLS (the record's `mols` section)", "mols/"))


def render_markdown() -> str:
    """The page ``docs/metrics.md`` (generated; do not edit the page by hand)."""
    head = ["name", "meaning", "unit / range", "producer", "needs", "alert rule (family)", "direction",
            "threshold", "level", "persistence", "warm-up + baseline (evaluations)"]
    lines = [
        "# Metrics reference",
        "",
        "<!-- generated by megatron_mech/records/metrics_reference.py: `megatron-mech metrics --output "
        "docs/metrics.md`; do not edit by hand -->",
        "",
        "Every series megatron-mech records, by name as it appears in a run's `mech.jsonl` (each record's `metrics` "
        "object, and its `mols` object for MoLS). TensorBoard, W&B and DeepSpeed's monitor get the same values as "
        "`mech/<name>`; the record fields table below gives the other tags. Under `--mech-writer-level summary` (and "
        "`auto`, the default, once an evaluation records more series than it allows) they get each per-head or "
        "per-expert series only at the steps its head or expert alerts, and otherwise its per-layer min and mean, "
        "`mech/<family>/layer{L}/<unit>_min/<metric>` and `..._mean/...` (`mech/attn/layer3/head_min/delta2_entropy`); "
        "`mech.jsonl` always holds every series.",
        "",
        "**Alert columns** come from the detector's default rules (`megatron_mech.monitors.registry.default_rules`: "
        "each built-in family brings its own), the "
        "first rule whose pattern matches the name (`fnmatch`, `*` also matches `/`) — \"logged only\" where none "
        "does. Series in the `mols` section never reach the detectors. A score is the distance from the series' "
        "own baseline median in robust units, positive in the bad direction; an evaluation is out of band when "
        "the score reaches the threshold *and* the value is beyond the level (when there is one) — for the attention "
        "entropies, or its layer has collapsed: the median over the layer's series of the same rule of value / "
        "baseline median is at most the given fraction; `persistence` "
        "out-of-band evaluations in a row fire one alert. The baseline is the median/MAD of `baseline` evaluations "
        "after `warm-up` ignored ones, frozen or tracking (following slow drift with the given lag). "
        "`--mech-detector-warmup`, `-baseline`, `-threshold` and `-persistence` override these for every rule. A "
        "non-finite value alerts at once, in every phase. A *level rule* has no score and no baseline: an "
        "evaluation beyond its level (strict) is out, from the first evaluation on (`--mech-max-logit-level`, "
        "`--mech-expert-share-level`; 0 switches one off). The per-head Δ2 rule also carries a *layer trend*: once "
        "its own warm-up is over (`--mech-layer-trend-warmup`, 30 evaluations), the median over a layer's heads of "
        "each head's fitted log fall over the last `--mech-layer-trend-window` evaluations (10) reaching "
        "`--mech-layer-trend-threshold` (1.5 log units; 0 switches it off) fires one alert for the layer, on the "
        "head that fell most, before any head reaches the level.",
        "",
        "**Name syntax**: `{X}` is a placeholder, `[...]` a part present only under `" + SLICE_SCOPE_FLAG + "` "
        "(per-shard ΔW spectra: the names gain the TP rank; per-head names never change). An evaluation happens "
        "every δ = `--mech-interval` steps; ΔW = W_t − W_(t−δ) always spans δ optimizer steps and is the whole "
        "matrix across tensor-parallel ranks (one shard with `[/tp{r}]`). Null in a record means not measured.",
        "",
        "| placeholder | values |",
        "|---|---|",
        *(f"| `{{{k}}}` | {_cell(p.meaning)} |" for k, p in PLACEHOLDERS.items()),
        "",
    ]
    for title, prefix in _GROUPS:
        entries = [e for e in METRICS if e.name.startswith(prefix)]
        lines += [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for e in entries:
            cells = [f"`{e.name}`", e.meaning, e.unit, e.producer, _flags(e), *_rule_cells(e)]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    lines += ["## Record fields", "",
              "The top-level keys of a `mech.jsonl` record (one record per evaluation step, plus any step with a "
              "non-finite loss or grad norm).", "",
              "| key | meaning | present | TensorBoard / W&B tag |", "|---|---|---|---|"]
    lines += [f"| `{f.key}` | {_cell(f.meaning)} | {_cell(f.producer)} | {_cell(f.tensorboard)} |"
              for f in RECORD_FIELDS]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Write the page to stdout (``python -m megatron_mech.records.metrics_reference > docs/metrics.md``)."""
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
