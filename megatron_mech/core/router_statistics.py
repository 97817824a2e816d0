"""MoE router statistics: weight geometry, per-token routing entropy, and mergeable routing summaries.

Why these signals: a mixture-of-experts router can fall into a "stable winner" feedback loop in
which one expert's logit margin grows coherently and routing diversity collapses. The full-softmax entropy
per token and the top-1/top-2 margin react to that before discrete top-k assignments or capacity overflow
change; the router weight geometry says whether the router can discriminate at all.

Shapes
------
* Router weight: ``[E, d]`` -- one row per expert, as megatron-core (``TopKRouter.weight``) and DeepSpeed
  (``TopKGate.wg.weight``, an ``nn.Linear(d, E)``) store it. Replicated across tensor-parallel ranks.
* Router logits: ``[tokens..., E]`` -- any leading shape (e.g. ``[seq, batch, E]`` or ``[tokens, E]``); the
  last dim is the expert dim. Statistics flatten the leading dims into tokens.

Formulas
--------
* Mean pairwise cosine of expert rows, without the E x E matrix. With unit rows u_i = w_i / ||w_i||,
  ``sum_{i != j} u_i . u_j = ||sum_i u_i||^2 - sum_i ||u_i||^2``, so the mean over the E(E-1) ordered pairs is
  ``(E^2 ||mean_i u_i||^2 - sum_i ||u_i||^2) / (E (E - 1))``, which is ``(E ||mean_i u_i||^2 - 1) / (E - 1)``
  when no row is zero. A zero row has no direction: its unit vector is taken as the zero vector, so every
  pair involving it counts as cosine 0 (the convention of ``torch.nn.functional.cosine_similarity``).
* Conditioning ratio ``eps = max_i ||w_i - w_bar|| / ||w_bar||`` and ``mean_deviation = mean_i ||w_i -
  w_bar|| / ||w_bar||`` with ``w_bar`` the mean row. Small eps <=> rows nearly identical <=> a redundant,
  non-discriminative router. ``||w_bar|| = 0`` gives ``inf`` for both (also for an all-zero weight).
* Routing entropy (nats) of p = softmax(z) over all E experts, from ONE softmax pass. With the shifted
  logits y = z - max_e z (all <= 0, so nothing overflows) and S = sum_e exp(y_e): ``log p_e = y_e - log S``,
  hence ``H = -sum_e p_e log p_e = log S - sum_e p_e y_e``, and ``log S = -log p_max`` because the top expert
  has y = 0, p_max = 1/S. So H needs p (one fused ``softmax``), one dot product p.y per token and one log;
  no ``exp`` of underflowing values (an explicit exp of very negative logits, and a second exp pass inside
  ``log_softmax``, are several times slower on CPU on peaked routing, the case we monitor for). Both terms
  are >= 0 (p.y <= 0 <= log S), so there is no cancellation even for logits of +-1e4; the relative error is a
  few eps. y is clamped from below at ``y_floor = log(tiny) + log E + 1`` (-82.1 for float32 and 64 experts),
  so every p_e stays a normal float: denormal operands make x86 arithmetic tens of times slower (measured on
  peaked routing: ``docs/results/calibration.md``). An expert at the floor has
  p_e <= exp(y_floor) and contributes -p_e·y_e <= exp(y_floor)·|y_floor|, so the clamp moves H by at most
  ``E·exp(y_floor)·|y_floor|`` (~1e-32 in float32); results below that bound are set to exactly 0 (a one-hot
  row is exactly 0). Masked experts (logit -inf) land on the floor too, and 0 * (-inf) is never formed.
  Normalised entropy is ``H / log E`` in [0, 1].
* Margin: top-1 logit minus top-2 logit, per token. Load: how many times each expert is in a token's top-k.
  Load entropy: entropy of the load fractions divided by log E (1 = perfectly balanced).

Dtype policy
------------
Geometry is computed in float64. Entropy is computed in float32, or float64 when the logits are float64
(bf16/fp16 are upcast: their exponent sums and softmax tails are too coarse). ``RoutingStats`` accumulates
everything (counts, sums, histogram, load) in one float64 buffer: counts stay exact up to 2**53 and the
buffer all-reduces in a single collective.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["RouterGeometry", "router_weight_geometry", "routing_entropy", "RoutingStats", "all_reduce_many"]


# --------------------------------------------------------------------------------------------------------
# Router weight geometry
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RouterGeometry:
    """Geometry of a router weight [E, d]. All fields are NaN when the weight has a non-finite entry."""

    mean_cosine: float      # mean cosine similarity over pairs of distinct expert rows, in [-1/(E-1), 1]
    conditioning: float     # eps = max_i ||w_i - w_bar|| / ||w_bar||; inf when ||w_bar|| = 0
    mean_deviation: float   # mean_i ||w_i - w_bar|| / ||w_bar||; inf when ||w_bar|| = 0


def router_weight_geometry(weight: torch.Tensor) -> RouterGeometry:
    """Mean pairwise cosine, conditioning ratio and mean relative deviation of the expert rows of ``weight``.

    ``weight`` has shape [E, d] (one row per expert) and any real dtype; computation is float64 and O(E d).
    Raises ``ValueError`` if ``weight`` is not 2-D, has fewer than 2 experts, or has no columns.
    Returns NaN in every field (no exception) if ``weight`` holds NaN or inf, so a monitor can log the
    breakage instead of crashing the training step. See the module docstring for zero-row conventions.
    """
    if weight.ndim != 2:
        raise ValueError(f"router weight must be 2-D [num_experts, hidden], got shape {tuple(weight.shape)}")
    num_experts, hidden = weight.shape
    if num_experts < 2:
        raise ValueError(f"router weight needs at least 2 experts (rows) for pairwise geometry, got {num_experts}")
    if hidden < 1:
        raise ValueError(f"router weight has no columns (hidden size 0), shape {tuple(weight.shape)}")

    w = weight.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        nan = float("nan")
        return RouterGeometry(nan, nan, nan)

    row_norms = torch.linalg.vector_norm(w, dim=1)
    # Dividing a zero row by 1 keeps it zero: its "unit vector" is 0, so its pairs count as cosine 0.
    unit_rows = w / torch.where(row_norms > 0, row_norms, torch.ones_like(row_norms)).unsqueeze(1)
    sum_of_units = unit_rows.sum(dim=0)
    self_similarity = (unit_rows * unit_rows).sum()  # = number of non-zero rows, up to rounding
    num_pairs = num_experts * (num_experts - 1)
    mean_cosine = (sum_of_units.dot(sum_of_units) - self_similarity) / num_pairs

    mean_row = w.mean(dim=0)
    mean_row_norm = float(torch.linalg.vector_norm(mean_row))
    deviations = torch.linalg.vector_norm(w - mean_row, dim=1)
    if mean_row_norm == 0.0:
        conditioning = mean_deviation = math.inf
    else:
        conditioning = float(deviations.max()) / mean_row_norm
        mean_deviation = float(deviations.mean()) / mean_row_norm
    # Clamp rounding (identical rows give 1 + 2e-16); the exact value always lies in [-1/(E-1), 1].
    return RouterGeometry(min(max(float(mean_cosine), -1.0), 1.0), conditioning, mean_deviation)


# --------------------------------------------------------------------------------------------------------
# Per-token routing entropy
# --------------------------------------------------------------------------------------------------------

def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def routing_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of ``softmax(logits, dim=-1)`` per token; output shape is ``logits.shape[:-1]``.

    Stable for any finite logits (computed on max-shifted logits, see the module docstring). Experts masked
    with ``-inf`` are allowed and contribute nothing. A row containing NaN or ``+inf``, or whose logits are
    all ``-inf`` (no distribution), gives NaN. The result is float32, or float64 for float64 input, and is
    clamped at 0 from below (rounding can otherwise produce -1e-7 for one-hot rows; values within the
    floor's bound of 0 are exactly 0). Differentiable.
    """
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty last (expert) dim, got shape {tuple(logits.shape)}")
    z = logits.to(_compute_dtype(logits))
    experts = z.shape[-1]
    # y = z - max <= 0. A NaN or +inf logit, or an all -inf row, makes the row's y NaN and hence H NaN.
    # The floor keeps every p a normal float and lifts -inf entries (masked experts) off -inf, so 0 * (-inf) is
    # never formed (see the module docstring); in place on our own temporary.
    y = z - z.amax(dim=-1, keepdim=True)
    y_floor = math.log(torch.finfo(z.dtype).tiny) + math.log(experts) + 1.0
    y.clamp_min_(y_floor)
    probs = torch.softmax(y, dim=-1)
    # sum_e p_e y_e. On CPU as a batched [1, E] x [E, 1] product: one kernel (mul + sum is two passes, slower
    # there); elsewhere mul + sum, which is fast on an accelerator and never goes through a TF32 matmul.
    if z.device.type == "cpu":
        p_dot_y = torch.matmul(probs.reshape(-1, 1, experts), y.reshape(-1, experts, 1)).reshape(z.shape[:-1])
    else:
        p_dot_y = (probs * y).sum(dim=-1)
    entropy = -torch.log(probs.amax(dim=-1)) - p_dot_y     # log S - sum p y, with log S = -log p_max
    floor_bound = experts * math.exp(y_floor) * -y_floor    # what the floor can have added; also clamps < 0
    return entropy.masked_fill(entropy <= floor_bound, 0.0)  # NaN rows stay NaN


# --------------------------------------------------------------------------------------------------------
# Mergeable routing statistics
# --------------------------------------------------------------------------------------------------------

# Layout of the float64 accumulation buffer: these scalars, then the entropy histogram, then expert load.
_SCALARS = (
    "tokens",             # tokens with usable logits (counted in every statistic below)
    "nonfinite_tokens",   # tokens skipped: a NaN or +inf logit, or every logit -inf
    "entropy_sum",        # sum of H (nats)
    "entropy_sq_sum",     # sum of H^2
    "margin_tokens",      # tokens with a finite top-1 - top-2 margin (top-2 not masked with -inf)
    "margin_sum",
    "margin_sq_sum",
)
_IDX = {name: i for i, name in enumerate(_SCALARS)}
_NUM_SCALARS = len(_SCALARS)


class RoutingStats:
    """Mergeable summary of router behaviour over tokens, accumulated every micro-batch, reduced over ranks.

    State (all sums, so merging and all-reducing are exact for counts and associative for floats): token
    count, sum and sum of squares of entropy H (nats), min H, a ``num_bins`` histogram of normalised entropy
    ``H / log E`` on [0, 1] (bins ``[k/B, (k+1)/B)``, the last one closed), sum and sum of squares of the
    top-1 - top-2 logit margin, and per-expert top-k load counts.

    Tokens whose logits contain NaN or ``+inf``, or are all ``-inf``, are excluded from every statistic and
    counted in ``nonfinite_tokens``. ``-inf`` entries (masked experts) are otherwise fine; a token whose
    top-2 logit is ``-inf`` has an infinite margin and is left out of the margin statistics only
    (``margin_tokens`` counts the rest). ``update`` does no host-device synchronisation; the state lives on
    the device of the logits it last saw. Summaries of an empty state are NaN.

    Typical use: ``update`` on every micro-batch, then at log time ``all_reduce(group)``, ``summary()``,
    ``reset()``. ``all_reduce`` replaces the local state by the global one, so reset before accumulating
    again or the next reduction counts these tokens twice.
    """

    def __init__(self, num_experts: int, num_bins: int = 20, *, low_entropy_threshold: float = 0.5):
        num_experts, num_bins = operator.index(num_experts), operator.index(num_bins)
        if num_experts < 2:
            raise ValueError(f"num_experts must be >= 2 (entropy is normalised by log E), got {num_experts}")
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        if not 0.0 <= low_entropy_threshold <= 1.0:
            raise ValueError(f"low_entropy_threshold is a normalised entropy in [0, 1], got {low_entropy_threshold}")
        self.num_experts = num_experts
        self.num_bins = num_bins
        self.low_entropy_threshold = float(low_entropy_threshold)
        self._buffer = torch.zeros(_NUM_SCALARS + num_bins + num_experts, dtype=torch.float64)
        self._entropy_min = torch.tensor(math.inf, dtype=torch.float64)  # +inf: the identity of MIN

    # ---- views into the packed buffer ------------------------------------------------------------------
    def _scalar(self, name: str) -> float:
        return float(self._buffer[_IDX[name]])

    def _histogram_view(self) -> torch.Tensor:  # a live view: writing to it updates the state
        return self._buffer[_NUM_SCALARS:_NUM_SCALARS + self.num_bins]

    def _load_view(self) -> torch.Tensor:
        return self._buffer[_NUM_SCALARS + self.num_bins:]

    @property
    def histogram(self) -> torch.Tensor:
        """Token counts per normalised-entropy bin (CPU float64 copy holding integers), shape [num_bins]."""
        return self._histogram_view().cpu().clone()

    @property
    def load_counts(self) -> torch.Tensor:
        """Times each expert was in a token's top-k (CPU float64 copy holding integers), shape [num_experts]."""
        return self._load_view().cpu().clone()

    @property
    def bin_edges(self) -> torch.Tensor:
        """The num_bins + 1 histogram edges in normalised-entropy units."""
        return torch.linspace(0.0, 1.0, self.num_bins + 1, dtype=torch.float64)

    # ---- accumulation ----------------------------------------------------------------------------------
    def reset(self) -> None:
        self._buffer.zero_()
        self._entropy_min.fill_(math.inf)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, topk: int) -> None:
        """Add the tokens of ``logits`` [tokens..., E] routed to their ``topk`` best experts."""
        topk = operator.index(topk)
        if logits.ndim < 1 or logits.shape[-1] != self.num_experts:
            raise ValueError(f"logits must have shape [..., {self.num_experts}], got {tuple(logits.shape)}")
        if not 1 <= topk <= self.num_experts:
            raise ValueError(f"topk must be in [1, {self.num_experts}], got {topk}")
        z = logits.detach().reshape(-1, self.num_experts).to(_compute_dtype(logits))
        if z.shape[0] == 0:
            return  # known from the shape, no sync; min over zero tokens would raise
        if self._buffer.device != z.device:
            self._buffer = self._buffer.to(z.device)
            self._entropy_min = self._entropy_min.to(z.device)
        f64 = torch.float64

        # amax propagates NaN, so one test covers NaN, +inf and all -inf.
        usable = torch.isfinite(z.amax(dim=-1))
        usable_weight = usable.to(f64)
        entropy = torch.where(usable, routing_entropy(z).to(f64), torch.zeros((), dtype=f64, device=z.device))

        # top-max(k, 2): the first two give the margin, the first k give the load.
        top_values, top_experts = torch.topk(z, k=max(topk, 2), dim=-1)
        margin = top_values[:, 0].to(f64) - top_values[:, 1].to(f64)
        has_margin = usable & torch.isfinite(margin)
        margin = torch.where(has_margin, margin, torch.zeros((), dtype=f64, device=z.device))

        scalars = torch.stack([
            usable_weight.sum(),
            (~usable).to(f64).sum(),
            entropy.sum(),
            (entropy * entropy).sum(),
            has_margin.to(f64).sum(),
            margin.sum(),
            (margin * margin).sum(),
        ])
        self._buffer[:_NUM_SCALARS] += scalars

        normalized = entropy / math.log(self.num_experts)
        bins = (normalized * self.num_bins).floor().long().clamp_(0, self.num_bins - 1)
        self._histogram_view().index_add_(0, bins, usable_weight)  # unusable tokens add weight 0
        chosen = top_experts[:, :topk].reshape(-1)
        self._load_view().index_add_(0, chosen, usable_weight.repeat_interleave(topk))

        batch_min = torch.where(usable, entropy, torch.full((), math.inf, dtype=f64, device=z.device)).amin()
        torch.minimum(self._entropy_min, batch_min, out=self._entropy_min)

    def _check_compatible(self, other: RoutingStats) -> None:
        if not isinstance(other, RoutingStats):
            raise ValueError(f"can only merge RoutingStats, got {type(other).__name__}")
        if (other.num_experts, other.num_bins) != (self.num_experts, self.num_bins):
            raise ValueError(
                f"incompatible RoutingStats: (num_experts, num_bins) = {(self.num_experts, self.num_bins)} "
                f"vs {(other.num_experts, other.num_bins)}")

    def merge(self, other: RoutingStats) -> RoutingStats:
        """Add ``other``'s tokens into ``self`` (in place) and return ``self``."""
        self._check_compatible(other)
        self._buffer += other._buffer.to(self._buffer.device)
        torch.minimum(self._entropy_min, other._entropy_min.to(self._buffer.device), out=self._entropy_min)
        return self

    def all_reduce(self, group=None) -> RoutingStats:
        """Replace the local state by the sum (min for the min entropy) over the ranks of ``group``.

        Two collectives: one SUM of the packed float64 buffer and one MIN of the min entropy, issued in that
        order on every rank. Every rank of ``group`` must call this, including ranks that saw no tokens
        (their empty state is the identity: zeros and +inf). Tensors travel on the device the backend needs
        (nccl: the current CUDA device; gloo: CPU) and come back to where the state lives. A no-op when
        torch.distributed is unavailable or not initialised, or the group has one rank. Returns ``self``.
        """
        all_reduce_many([self], group)
        return self

    # ---- summaries (each one synchronises with the device; call at log time) --------------------------
    @property
    def count(self) -> int:
        return int(self._scalar("tokens"))

    @property
    def nonfinite_tokens(self) -> int:
        return int(self._scalar("nonfinite_tokens"))

    @property
    def mean(self) -> float:
        """Mean entropy in nats (NaN when empty)."""
        n = self._scalar("tokens")
        return self._scalar("entropy_sum") / n if n > 0 else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation of entropy in nats (NaN when empty)."""
        n = self._scalar("tokens")
        if n == 0:
            return math.nan
        mean = self._scalar("entropy_sum") / n
        return math.sqrt(max(self._scalar("entropy_sq_sum") / n - mean * mean, 0.0))  # clamp rounding

    @property
    def min(self) -> float:
        """Minimum entropy in nats (NaN when empty)."""
        return float(self._entropy_min) if self.count > 0 else math.nan

    @property
    def margin_mean(self) -> float:
        m = self._scalar("margin_tokens")
        return self._scalar("margin_sum") / m if m > 0 else math.nan

    @property
    def margin_var(self) -> float:
        """Population variance of the top-1 - top-2 logit margin (NaN when no token has a margin)."""
        m = self._scalar("margin_tokens")
        if m == 0:
            return math.nan
        mean = self._scalar("margin_sum") / m
        return max(self._scalar("margin_sq_sum") / m - mean * mean, 0.0)

    @property
    def load_fraction(self) -> torch.Tensor:
        """Share of all top-k assignments that went to each expert, shape [E], sums to 1 (NaN when empty)."""
        load = self.load_counts
        return load / load.sum()

    @property
    def load_entropy(self) -> float:
        """Entropy of ``load_fraction`` / log E: 1 = perfectly balanced, 0 = one expert takes everything."""
        fraction = self.load_fraction
        entropy = -torch.special.xlogy(fraction, fraction).sum()  # xlogy: 0 log 0 = 0
        return float(entropy) / math.log(self.num_experts)

    @property
    def effective_experts(self) -> float:
        """``exp(H)`` of the load fractions (H in nats): the number of equally loaded experts with the same
        entropy — E when balanced, 1 when one expert takes everything. NaN when empty."""
        fraction = self.load_fraction
        if not bool(torch.isfinite(fraction).all()) or float(fraction.sum()) <= 0:
            return math.nan
        return math.exp(float(-torch.special.xlogy(fraction, fraction).sum()))

    @property
    def load_cv(self) -> float:
        """Coefficient of variation of the per-expert load counts, std / mean (population std): 0 when
        balanced, sqrt(E − 1) when one expert takes everything. NaN when empty."""
        load = self.load_counts
        mean = float(load.mean())
        return float(load.std(correction=0)) / mean if mean > 0 else math.nan

    def quantile(self, q: float) -> float:
        """Approximate q-quantile of the *normalised* entropy H / log E, from the histogram.

        Finds the bin where the cumulative count reaches q * count and interpolates linearly inside it
        (tokens assumed uniform within a bin), then clamps to the exact normalised minimum. The error is at
        most about one bin width (1 / num_bins) when the data are not very sparse. NaN when empty.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q must be in [0, 1], got {q}")
        hist = self.histogram
        total = float(hist.sum())
        if total == 0:
            return math.nan
        cumulative = hist.cumsum(0)
        target = q * total
        # First bin whose cumulative count reaches the target; for target 0, the first non-empty bin.
        side = "right" if target == 0 else "left"
        b = min(int(torch.searchsorted(cumulative, torch.tensor(target, dtype=torch.float64), side=side)),
                self.num_bins - 1)
        before = float(cumulative[b] - hist[b])
        inside = (target - before) / float(hist[b]) if hist[b] > 0 else 0.0
        estimate = (b + min(max(inside, 0.0), 1.0)) / self.num_bins
        return max(estimate, self.min / math.log(self.num_experts))

    def fraction_below(self, threshold: float) -> float:
        """Approximate fraction of tokens with normalised entropy H / log E below ``threshold``.

        Exact (counts of whole bins) when ``threshold`` is an interior bin edge k / num_bins; in between, the
        partial bin is interpolated linearly. Thresholds <= 0 give 0, >= 1 give 1. NaN when empty.
        """
        hist = self.histogram
        total = float(hist.sum())
        if total == 0:
            return math.nan
        position = min(max(float(threshold), 0.0), 1.0) * self.num_bins
        whole_bins = int(math.floor(position))
        below = float(hist[:whole_bins].sum())
        if whole_bins < self.num_bins:
            below += (position - whole_bins) * float(hist[whole_bins])
        return below / total

    def summary(self) -> dict[str, float]:
        """All scalar summaries with stable keys. ``entropy_*`` values are in nats except ``entropy_norm_*``
        (H / log E); ``low_entropy_frac`` uses ``low_entropy_threshold`` in normalised units."""
        stats = self._to_cpu()  # one device->host copy, then every property reads host memory
        log_e = math.log(self.num_experts)
        return {
            "tokens": float(stats.count),
            "nonfinite_tokens": float(stats.nonfinite_tokens),
            "entropy_mean": stats.mean,
            "entropy_std": stats.std,
            "entropy_min": stats.min,
            "entropy_p05": stats.quantile(0.05) * log_e,
            "entropy_p50": stats.quantile(0.5) * log_e,
            "entropy_norm_mean": stats.mean / log_e,
            "low_entropy_frac": stats.fraction_below(self.low_entropy_threshold),
            "margin_mean": stats.margin_mean,
            "margin_std": math.sqrt(stats.margin_var),
            "load_entropy": stats.load_entropy,
            "effective_experts": stats.effective_experts,
            "load_cv": stats.load_cv,
        }

    def taken(self) -> RoutingStats:
        """A copy of the state (same device), and this one reset: what was accumulated so far, handed over while
        accumulation goes on in ``self``."""
        copy = RoutingStats(self.num_experts, self.num_bins, low_entropy_threshold=self.low_entropy_threshold)
        copy._buffer, copy._entropy_min = self._buffer.clone(), self._entropy_min.clone()
        self.reset()
        return copy

    def _to_cpu(self) -> RoutingStats:
        copy = RoutingStats(self.num_experts, self.num_bins, low_entropy_threshold=self.low_entropy_threshold)
        copy._buffer = self._buffer.cpu()
        copy._entropy_min = self._entropy_min.cpu()
        return copy

    # ---- checkpointing ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        buffer = self._buffer.cpu().clone()
        state = {"num_experts": self.num_experts, "num_bins": self.num_bins,
                 "low_entropy_threshold": self.low_entropy_threshold}
        state.update({name: float(buffer[i]) for i, name in enumerate(_SCALARS)})
        state["entropy_min"] = float(self._entropy_min)
        state["entropy_hist"] = buffer[_NUM_SCALARS:_NUM_SCALARS + self.num_bins].clone()
        state["expert_load"] = buffer[_NUM_SCALARS + self.num_bins:].clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        if (state["num_experts"], state["num_bins"]) != (self.num_experts, self.num_bins):
            raise ValueError(
                f"state is for (num_experts, num_bins) = {(state['num_experts'], state['num_bins'])}, "
                f"this RoutingStats has {(self.num_experts, self.num_bins)}")
        device = self._buffer.device
        scalars = torch.tensor([float(state[name]) for name in _SCALARS], dtype=torch.float64)
        self._buffer = torch.cat([scalars, torch.as_tensor(state["entropy_hist"], dtype=torch.float64),
                                  torch.as_tensor(state["expert_load"], dtype=torch.float64)]).to(device)
        self._entropy_min = torch.tensor(float(state["entropy_min"]), dtype=torch.float64, device=device)
        self.low_entropy_threshold = float(state.get("low_entropy_threshold", self.low_entropy_threshold))

    def __repr__(self) -> str:
        return (f"RoutingStats(num_experts={self.num_experts}, num_bins={self.num_bins}, tokens={self.count}, "
                f"nonfinite_tokens={self.nonfinite_tokens})")


def all_reduce_many(stats: Sequence[RoutingStats], group=None) -> None:
    """:meth:`RoutingStats.all_reduce` for many summaries (e.g. one per MoE layer) in two collectives total.

    The packed buffers are concatenated into one SUM and the minima into one MIN, in the order of ``stats``
    — which must be the same list (same lengths, same order) on every rank of ``group``.
    """
    if not stats or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    elif backend == "gloo":
        device = torch.device("cpu")
    else:  # multi-backend groups ("cpu:gloo,cuda:nccl") and others take tensors where they are
        device = stats[0]._buffer.device
    sizes = [s._buffer.numel() for s in stats]
    buffer = torch.cat([s._buffer.to(device) for s in stats])
    minima = torch.stack([s._entropy_min.to(device) for s in stats])
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(minima, op=dist.ReduceOp.MIN, group=group)
    for s, chunk, minimum in zip(stats, buffer.split(sizes), minima):
        s._buffer = chunk.to(s._buffer.device).clone()
        s._entropy_min = minimum.to(s._entropy_min.device).clone()
