"""A toy built-in-style monitor family for the tests, laid out as a built-in family is: one folder with its
``Monitor`` subclass (:mod:`toy_family.monitor`) and its detector rules (:mod:`toy_family.rules`); registering it is
one line, its class added to ``BUILTIN_MONITORS``. It reads its inputs from the model view's open slot,
``ModelView.families["toy_updates"]``."""
from toy_family.monitor import ToyUpdatesMonitor

__all__ = ["ToyUpdatesMonitor"]
