"""Code outside the product that follows a run's lifecycle: :class:`Extension`.

**Extension or monitor.** Two concepts, kept apart on purpose. A :class:`~megatron_mech.monitors.protocol.Monitor`
only *observes*: on evaluation steps it produces metrics, which the hook's detectors judge and its sinks record;
it never changes training, and the hook decides its schedule (the interval), checkpoints it and times it. An
extension *acts on* the run: it may change the model (``layer_spec``, ``prepare_model``), the data
(``global_batch``) or the optimizer's lr (``before_optimizer_step``), on any step; it produces no judged metrics
(its ``summary`` is a plain entry of the run's summary). The studies' fault injection is one. Keeping them apart
means a monitor can be trusted to leave training bit-for-bit unchanged, and an extension is visibly the place where
training is altered.

The hook calls, in registration order: ``setup(hook, view, optimizer)`` at the end of
:meth:`MechHook.setup <megatron_mech.hook.MechHook.setup>`; ``before_step(step)`` at the end of ``before_step``,
then ``before_optimizer_step(optimizer, step)`` there when the hook knows the optimizer; ``after_optimizer_step
(step, loss=, grad_norm=, lr=)`` at the start of ``after_optimizer_step``; ``state_dict()`` / ``load_state_dict
(state)`` inside the hook's state (under ``"extensions"``, keyed by :attr:`Extension.name`, only when non-empty);
``close()`` from ``close``. The model-building points are the adapters' to call.
"""
from __future__ import annotations

from typing import Optional

from megatron_mech.model_view import ModelView

__all__ = ["Extension"]


class Extension:
    """Code outside the product that follows the hook's lifecycle (see the module docstring, "Extensions").

    Subclass it and override what you need; every method here does nothing. The hook calls the lifecycle
    methods on every rank at the same points, so an extension may issue collectives there as long as it issues
    the same ones on every rank.
    """

    name: str = "extension"
    """The key of this extension's state in :meth:`MechHook.state_dict` and of its entry in a run's summary."""

    # -------------------------------------------------------------------------------- entry points
    @classmethod
    def add_arguments(cls, parser) -> None:
        """Add this extension's flags to an entry point's ``argparse`` parser."""

    @classmethod
    def from_args(cls, args) -> Optional[Extension]:
        """The extension the parsed flags ask for, or ``None`` when they ask for none."""
        return None

    # -------------------------------------------------------------------------------- model building
    def global_batch(self, global_batch: int, micro_batch_size: Optional[int] = None,
                     data_parallel_size: int = 1) -> int:
        """The run's global batch (called once by an adapter that sizes the data itself)."""
        return global_batch

    def check_model(self, num_layers: int, num_attention_heads: int) -> None:
        """``ValueError`` naming the setting if the extension does not fit a model of this size."""

    def layer_spec(self, num_experts=None, normalization=None, **kwargs):
        """megatron-core: the transformer layer spec to build the model with, or ``None`` for the adapter's own."""
        return None

    def prepare_model(self, model) -> None:
        """The model the trainer calls (megatron-core: the wrapped model of our entry point; DeepSpeed: the engine's
        module, an HF model the adapter did not build), before the monitors look at it."""

    def describe(self) -> Optional[str]:
        """One line for the run's log (``None``: nothing to say)."""
        return None

    def summary(self) -> Optional[dict]:
        """Plain values for the run's summary under :attr:`name` (``None``: no entry)."""
        return None

    # -------------------------------------------------------------------------------- lifecycle
    def setup(self, hook, view: ModelView, optimizer=None) -> None:
        """At the end of :meth:`MechHook.setup` (``hook``: that :class:`~megatron_mech.hook.MechHook`)."""

    def before_step(self, step: int) -> None:
        """Before the forward/backward of optimizer step ``step``."""

    def before_optimizer_step(self, optimizer, step: int) -> None:
        """In :meth:`MechHook.before_step`, when the hook knows the optimizer: this step's lr may be changed here."""

    def after_optimizer_step(self, step: int, *, loss: float, grad_norm: Optional[float], lr: float) -> None:
        """At the start of :meth:`MechHook.after_optimizer_step`; ``loss`` and ``grad_norm`` as the trainer gave
        them (floats, or tensors that an extension reading them brings to the host itself)."""

    def state_dict(self) -> dict:
        """This extension's part of the hook's state (empty: nothing saved)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    def close(self) -> None:
        """From :meth:`MechHook.close`."""
