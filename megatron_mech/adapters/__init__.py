"""The framework adapters: each one connects :class:`megatron_mech.hook.MechHook` to one training framework.

* :mod:`megatron_mech.adapters.megatron_core` adapts megatron-core: the package's own ``pretrain_gpt`` entry point
  (``megatron-mech train``), its data, checkpoints, model discovery and MoLS for megatron-core models.
* :mod:`megatron_mech.adapters.megatron_lm_fork` adapts a user's Megatron-LM fork: the patch series in
  ``patches/`` that adds our call sites to the fork, the call-site functions themselves (``callsites``), the patch
  tool (``patcher``) and the fork's CPU training-layer shims.
* :mod:`megatron_mech.adapters.deepspeed` adapts DeepSpeed engines (``deepspeed.initialize``), configured by a
  ``"mech"`` section of the DeepSpeed JSON config.

Importing this package imports no framework.
"""
