"""Generated reference pages of the documentation, each rendered from the one declaration it documents:
:mod:`~megatron_mech.references.config_reference` (every setting, from the ``option()`` declarations) and
:mod:`~megatron_mech.references.cli_reference` (the ``megatron-mech`` command, from its argparse parsers).

They sit beside :mod:`megatron_mech.cli`, the last layer, because they read every layer's declarations: the
product's settings, the DeepSpeed adapter's section and the studies' fault settings. (The metrics reference,
which reads only the math core's detector rules, lives in :mod:`megatron_mech.records.metrics_reference`.)
"""
