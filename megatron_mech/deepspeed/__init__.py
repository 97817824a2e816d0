"""DeepSpeed adapter: the monitors, detectors and MoLS for ``deepspeed.initialize`` engines.

One call after ``deepspeed.initialize`` (every rank)::

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    mech = DeepSpeedMech.from_engine(engine)          # reads the "mech" section of the same config
    for step in ...:
        mech.before_step()                            # arms router capture / MoLS gradient statistics
        loss = engine(batch); engine.backward(loss)
        mech.after_backward()                         # MoLS: reduced gradients, before engine.step()
        engine.step()
        mech.after_step(loss)                         # monitors, detectors, engine.monitor + JSONL

Modules (one concept each): :mod:`.config` (the ``"mech"`` JSON section), :mod:`.attention` (HF attention
discovery and ZeRO weight access), :mod:`.router` (DeepSpeed ``TopKGate`` and HF MoE router capture),
:mod:`.mols` (gradient statistics and the per-group lr scheduler wrapper), :mod:`.engine` (the adapter object),
:mod:`.cpu` (running DeepSpeed on CPU machines over gloo).
"""
