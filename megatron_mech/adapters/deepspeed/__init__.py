"""DeepSpeed adapter: the monitors, detectors and MoLS of :class:`megatron_mech.hook.MechHook` for
``deepspeed.initialize`` engines, configured by a ``"mech"`` section in the DeepSpeed JSON config.

One call after ``deepspeed.initialize`` (every rank)::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    mech = DeepSpeedMech.from_engine(engine, train_steps=T)   # validates cfg["mech"], before training
    for batch in data:
        mech.before_step()
        loss = engine(**batch).loss; engine.backward(loss)
        mech.after_backward()                                 # MoLS statistics, before engine.step()
        engine.step()
        action = mech.after_step(loss)                        # monitors, detectors, mech.jsonl + engine.monitor

Modules (one concept each): :mod:`.ds_config_section` (the ``"mech"`` section), :mod:`.attention` (HF attention
discovery and ZeRO weight access), :mod:`.router_capture` (DeepSpeed ``TopKGate`` and HF MoE router capture),
:mod:`.mols_backend` (gradient statistics, the lr-multiplier scheduler wrapper, the MoLS backend), :mod:`.engine` (the
adapter object and checkpoints), :mod:`.safe_load` (weights-only loading of DeepSpeed checkpoints), :mod:`.models`
(small HF models), :mod:`.batches` (deterministic LM batches), :mod:`.cpu` (DeepSpeed on CPU machines over gloo).
Importing this package imports neither DeepSpeed nor transformers.
"""
