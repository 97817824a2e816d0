"""The reference trainers: programs that train a model with megatron-mech's hook, built on the adapters.

``megatron_core`` is our megatron-core entry point (``megatron-mech train``/``demo``,
``launch_scripts/pretrain_gpt_mech.py``) with its flags, checkpoints and run-directory checks; ``deepspeed`` trains
small HF models with DeepSpeed (``torchrun -m megatron_mech.trainers.deepspeed.train``); ``data`` is the embedded
corpus and its tokenizer (both trainers train on it) and the checks of a user's Megatron data files;
``stop_signals`` stops either trainer cleanly on SIGTERM/SIGINT. The adapters never import the trainers.
"""
