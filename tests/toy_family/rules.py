"""The toy family's detector rules: a layer's update norm far above its own baseline."""
from megatron_mech.core.detect import SeriesRule


def toy_rules(settings) -> list:
    """One baseline-relative rule, its family left to the monitor's name."""
    return [SeriesRule("toy/layer*/update_norm", direction="up")]
