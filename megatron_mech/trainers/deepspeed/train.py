"""Train a small HF model with DeepSpeed on the embedded corpus, with megatron-mech's monitors (and MoLS).

Models: ``llama`` (dense, grouped-query attention), ``mixtral`` (HF MoE blocks) or ``ds-moe`` (Llama with
``deepspeed.moe`` feed-forward layers, expert parallel with ``--ep-size``). The DeepSpeed config is built from the
flags, or read from ``--deepspeed-config`` (its ``"mech"`` section configures the monitors either way). Faults are
not offered here: the studies' launcher, ``torchrun -m megatron_mech.studies.deepspeed_fault_train``, is this launcher
with ``--fault-start`` and a study config's ``"fault"`` key (``main(study=...)`` is its seam).

    torchrun --nproc_per_node=2 -m megatron_mech.trainers.deepspeed.train --zero-stage 2 --steps 40 --output-dir runs/ds
    deepspeed --num_accelerators 2 --module megatron_mech.trainers.deepspeed.train --model ds-moe --ep-size 2 \\
        --zero-stage 1

On CPU machines set ``OMP_NUM_THREADS=1`` under the ``deepspeed`` launcher. Writes ``<output-dir>/mech.jsonl``
(one record per evaluation) and ``<output-dir>/summary.json`` (step time, monitor cost, the step the detectors are
armed from; the schema in docs/outputs.md), from rank 0. SIGTERM or SIGINT (to torchrun, which forwards it) stops
every rank after the same step: it saves a checkpoint (with ``--save``), writes ``summary.json`` (``"trainer"``:
``"stopped_by_signal"``) and exits 0, as the megatron-core entry point does. A fresh run into an ``--output-dir``
(or ``--save``) that already holds a run is refused before anything is built: resume it with ``--load``, or pass
``--overwrite-run`` to start over. So is one into a directory another run is writing (the run holds its directories
until its process ends). Each run has an id (``run_id.txt`` in ``--output-dir`` and in each checkpoint it saves): a
resume into an ``--output-dir`` holding another run's records is refused too; resume into the checkpoint's own
output directory, or into a new one.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import torch

logger = logging.getLogger("deepspeed_train")
LATEST = "latest"  # DeepSpeed's tracker file: the tag of the newest checkpoint in a save directory
STUDY_LAUNCHER = "megatron_mech.studies.deepspeed_fault_train"  # this launcher with the studies' fault


def parse_args(argv=None, add_study_flags: Optional[Callable[[argparse.ArgumentParser], None]] = None
               ) -> argparse.Namespace:
    """The launcher's flags; ``add_study_flags``: a study launcher's own (see :func:`main`)."""
    from megatron_mech.config import MonitorConfig
    from megatron_mech.options import add_section_flags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("llama", "mixtral", "ds-moe"), default="llama")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 training (DeepSpeed's \"bf16\": {\"enabled\": true}: bf16 module weights, float32 "
                        "master weights, which the monitors read by default: mech.monitors.weights)")
    p.add_argument("--deepspeed-config", default=None, help="a DeepSpeed JSON config (overrides the flags below)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="WarmupLR steps (0: no scheduler)")
    add_section_flags(p, MonitorConfig, only=("interval",))  # --mech-interval, as the config declares it
    p.add_argument("--mols", action="store_true", help="module-wise lr scaling from gradient SNR")
    p.add_argument("--output-dir", default="runs/deepspeed")
    p.add_argument("--save", default=None, help="checkpoint directory (saved at the end)")
    p.add_argument("--load", default=None, help="resume from this checkpoint directory (read weights-only)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load --load with DeepSpeed's own unrestricted unpickler (only for checkpoints you trust)")
    p.add_argument("--overwrite-run", action="store_true",
                   help="start over in an --output-dir / --save that already holds a run (its records go)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    if add_study_flags is not None:
        add_study_flags(p)
    return p.parse_args(argv)


def corpus_tokens() -> torch.Tensor:
    """The embedded corpus as UTF-8 bytes (vocabulary 256): real English text, no tokenizer to build."""
    from megatron_mech.trainers.data.embedded import load_corpus

    text = "\n".join(d.text for d in load_corpus())
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def build_config(args) -> dict:
    if args.deepspeed_config:
        from megatron_mech.adapters.deepspeed.ds_config_section import load_config_file

        return load_config_file(args.deepspeed_config)  # a key given twice is refused, naming it
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.zero_stage}, "steps_per_print": 10 ** 9,
              "gradient_clipping": 1.0,
              "mech": {"monitors": {"interval": args.mech_interval}, "output": {"dir": args.output_dir}}}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.warmup:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                              "warmup_num_steps": args.warmup}}
    if args.mols:
        config["mech"]["mols"] = {"enabled": True}  # window: 1% of the steps (at least 5); ramp: the warm-up
    return config


def output_settings(config: dict):
    """The config's ``"mech"`` output settings (validates the section: an unknown key, e.g. a study's ``"fault"``,
    is refused naming it)."""
    from megatron_mech.adapters.deepspeed.ds_config_section import parse_section

    section = config.get("mech")
    if isinstance(section, dict) and "fault" in section:
        raise ValueError(f"mech.fault: faults are injected by the studies' launcher only (torchrun -m "
                         f"{STUDY_LAUNCHER} ...), not by this one")
    return parse_section(section)[0].output


def mech_output_dir(config: dict) -> str:
    """Where the hook writes ``mech.jsonl``: the config's ``mech.output.dir``."""
    from megatron_mech.config import output_directory

    return output_directory(output_settings(config).dir)


def check_sinks(config: dict) -> None:
    """The optional sinks the "mech" section asks for can start: their packages are installed and W&B, online, has
    an API key. Checked before anything is built; the sinks start on rank 0 once the engine is (``ValueError``
    naming the key)."""
    from megatron_mech.records.sinks import sink_start_problem

    output = output_settings(config)
    for key, kind in (("tensorboard_dir", "tensorboard"), ("wandb_project", "wandb")):
        value = getattr(output, key)
        reason = sink_start_problem(kind) if value else None
        if reason:
            raise ValueError(f"mech.output.{key} {value}: {reason}")


def output_dirs(args, config: dict) -> list:
    """The directories the run's records go to: ``--output-dir`` (summary.json) and ``mech.output.dir``
    (mech.jsonl), once each when they are one."""
    return list(dict.fromkeys([args.output_dir, mech_output_dir(config)]))


def check_run_directories(args, config: dict, rank: int) -> tuple[bool, Optional[str]]:
    """Before anything is built, on every rank: the directories are writable, ``--load`` holds a checkpoint, a
    fresh run does not go into a directory holding another run (unless ``--overwrite-run``), and a resume does not
    go into an output directory of another run (its ``run_id.txt`` differs from the checkpoint's, or it holds
    records and no id). Rank 0 first claims them for the run's life, so a second run started at the same time is
    refused instead of passing the same checks. Returns whether the previous run there is to be cleared, and the
    id of the run a resume continues (None: the run needs a new id). Raises ``ValueError`` naming the flag or
    directory."""
    from megatron_mech.records.run_directory import (
        FIRST_ALERT,
        MAX_SMALL_FILE_BYTES,
        RUN_FILES,
        claim_run_directory,
        previous_run,
        probe_writable,
        refuse_linked_checkpoints,
        refuse_mixing_runs,
        refuse_unsafe_files_in,
        resumed_run_id,
    )
    from megatron_mech.records.safe_files import read_small_file

    directories = output_dirs(args, config)
    flags = {directory: "--output-dir" if directory == args.output_dir else "mech.output.dir"
             for directory in directories}
    if args.save:
        flags.setdefault(args.save, "--save")
    for directory, flag in flags.items():
        probe_writable(directory, flag, rank)
    if rank == 0:  # one rank: the ranks of this run would refuse each other
        for directory, flag in flags.items():
            claim_run_directory(directory, flag)
    for directory in directories:  # what the run writes must not lead out of its directories
        refuse_unsafe_files_in(directory, RUN_FILES)
    tag = None
    if args.load:
        tracker = Path(args.load) / LATEST
        if not os.path.lexists(tracker):
            raise ValueError(f"--load {args.load} holds no DeepSpeed checkpoint (no {LATEST} file there)")
        tag = read_small_file(tracker, MAX_SMALL_FILE_BYTES, "a DeepSpeed tracker").decode("utf-8", "replace").strip()
    if args.save:
        refuse_unsafe_files_in(args.save, (LATEST, FIRST_ALERT))
        # the tag directories this run will save into (global_step<N> past the resumed step) must not lead out
        from megatron_mech.adapters.deepspeed.engine import TAG_PREFIX

        resumed = tag[len(TAG_PREFIX):] if tag and tag.startswith(TAG_PREFIX) else ""
        refuse_linked_checkpoints(args.save, TAG_PREFIX, int(resumed) if resumed.isdigit() else 0)
    if args.load:
        # the records after the checkpoint's step are cut back when the hook starts: only safe in its own run's
        # directories (a tag leading out of --load is refused by the load itself)
        checkpoint = Path(args.load) / tag
        run_ids = [resumed_run_id(checkpoint, directory, load_dir=args.load, output_flag=flags[directory],
                                  other_checkpoints="*") for directory in directories]
        return False, next((run_id for run_id in run_ids if run_id is not None), None)
    if args.overwrite_run:
        return True, None
    markers = [Path(args.save) / LATEST] if args.save else []
    previous = [found for directory in directories for found in previous_run(directory, markers)]
    refuse_mixing_runs(" and ".join(directories), sorted(set(previous)), load=None,
                       other_dir_flags="--output-dir/--save")
    return False, None


def clear_previous_run(args, config: dict) -> None:
    """``--overwrite-run``: remove the previous run's records, summary and alert marker, and make its checkpoints
    no longer "latest" (their directories stay until overwritten)."""
    from megatron_mech.records.run_directory import FIRST_ALERT, RUN_ID_FILE
    from megatron_mech.records.run_directory import clear_previous_run as clear_run_files

    save_markers = [Path(args.save) / LATEST, Path(args.save) / FIRST_ALERT] if args.save else []
    for directory in output_dirs(args, config):
        clear_run_files(directory, [*save_markers, Path(directory) / RUN_ID_FILE])


def record_run_id(args, config: dict, run_id: str) -> None:
    """Write the run's id into its output directories (rank 0): a later resume checks them against its
    checkpoint's id."""
    from megatron_mech.records.run_directory import write_run_id

    for directory in output_dirs(args, config):
        Path(directory).mkdir(parents=True, exist_ok=True)
        write_run_id(directory, run_id)


def build_model(args):
    from megatron_mech.adapters.deepspeed import models

    common = dict(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                  ffn=4 * args.hidden, seq_len=args.seq_len + 1, seed=args.seed)
    if args.model == "llama":
        return models.dense_llama(**common)
    if args.model == "mixtral":
        return models.mixtral(num_experts=args.experts, **common)
    return models.deepspeed_moe_llama(num_experts=args.experts, ep_size=args.ep_size, **common)


def main(argv=None, study=None) -> int:
    """Train; returns the exit code (0; 2: a bad flag, config or directory, one line on stderr; 3: records
    incomplete).

    ``study``: what a study launcher adds, ``None`` for the product — an object with ``add_flags(parser)`` (its own
    flags) and ``extensions(args, config) -> [Extension]``, called before anything is built: it takes its own keys
    out of the DeepSpeed config (e.g. ``mech.fault``), so that the product sees its own config only, and returns the
    hook extensions to register (``ValueError`` naming the flag or key for bad input)."""
    args = parse_args(argv, study.add_flags if study is not None else None)
    from megatron_mech.adapters.path_packages import DEEPSPEED_LAUNCHER, missing_packages

    missing = missing_packages(DEEPSPEED_LAUNCHER)  # all of them at once, before any import of DeepSpeed
    if missing:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank stops; one line says why
            sys.stderr.write(f"deepspeed_train: error: {missing}\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = build_config(args)
        extensions = study.extensions(args, config) if study is not None else []  # takes the study's own keys
        check_sinks(config)
        overwrite, run_id = check_run_directories(args, config, int(os.environ.get("RANK", "0")))
    except ValueError as exc:
        sys.stderr.write(f"deepspeed_train: error: {exc}\n")
        return 2
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    import deepspeed
    import torch.distributed as dist

    from megatron_mech.adapters.deepspeed.batches import rank_batch
    from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech, load_checkpoint, save_checkpoint
    from megatron_mech.adapters.deepspeed.models import moe_aux_loss
    from megatron_mech.adapters.deepspeed.mols_backend import param_groups
    from megatron_mech.hook import Action
    from megatron_mech.trainers.stop_signals import StopOnSignal

    stop_signal = StopOnSignal().install()  # SIGTERM/SIGINT: finish the step, save, write the summary, exit
    if not torch.cuda.is_available():
        from megatron_mech.adapters.deepspeed.cpu import single_process_env, skip_shm_comm_build

        single_process_env()
        skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        if overwrite:
            clear_previous_run(args, config)
        # a fresh run (or one resumed from a checkpoint written before run ids) gets a new id; only rank 0 writes
        # it, here and into each checkpoint, so the other ranks need not agree on it
        run_id = run_id or uuid.uuid4().hex
        record_run_id(args, config, run_id)
    dist.barrier()
    model = build_model(args)
    groups = param_groups(model, weight_decay=0.01)
    if args.model == "ds-moe":
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    # validates the "mech" section before any training step
    mech = DeepSpeedMech.from_engine(engine, train_steps=args.steps, lr_warmup_steps=args.warmup or None,
                                     extensions=extensions)
    # once a stop is asked for, a save waits at most STOP_WAIT_SECONDS for the monitors' evaluation in flight
    mech.hook.stop_requested = lambda: stop_signal.received is not None
    if args.load:
        try:
            load_checkpoint(engine, mech, args.load, trust_checkpoint=args.trust_checkpoint)
        except ValueError as exc:  # a refused or mismatched checkpoint: one line, not a traceback
            sys.stderr.write(f"deepspeed_train: error: {exc}\n")
            return 2
    tokens = corpus_tokens()
    device = engine.device
    step_seconds = []
    start = engine.global_steps
    for step in range(start, args.steps):
        started = time.perf_counter()
        batch = rank_batch(tokens, step, args.micro_batch, rank, world, args.seq_len, seed=args.seed).to(device)
        mech.before_step()
        out = engine(input_ids=batch, labels=batch)
        loss = out.loss + 0.01 * moe_aux_loss(engine.module).to(out.loss.device)
        engine.backward(loss)
        mech.after_backward()
        engine.step()
        action = mech.after_step(out.loss)
        step_seconds.append(time.perf_counter() - started)
        if action is not Action.CONTINUE and args.save:  # mech.on_alert: checkpoint (or stop) on the first alert
            save_checkpoint(engine, mech, args.save, run_id=run_id)
        if action is Action.STOP:
            break
        if rank == 0 and (mech.is_evaluation_step(engine.global_steps) or step == args.steps - 1):
            logger.info("step %d loss %.4f lr %.3g (%.3f s/step)", engine.global_steps, float(out.loss.detach()),
                        engine.get_lr()[0], step_seconds[-1])
        if stop_signal.agreed():  # one tiny all-reduce: every rank stops after the same step
            if rank == 0:
                logger.info("%s received: stopping cleanly after step %d", stop_signal.stopped_by,
                            engine.global_steps)
            break
    if args.save:
        save_checkpoint(engine, mech, args.save, run_id=run_id)
    # reads back the last values (their records and alerts belong in the summary); rank 0 writes summary.json
    summary = mech.close(summary_dir=args.output_dir, step_seconds=step_seconds, model=args.model,
                         zero_stage=engine.zero_optimization_stage(), world=world, steps=len(step_seconds),
                         stopped_by_signal=stop_signal.stopped_by)
    incomplete = None
    if rank == 0:
        from megatron_mech.records.run_directory import records_incomplete

        logger.info("monitor cost: %.3f s of %.3f s (%.2f%% of step time)", summary.monitor_seconds,
                    sum(step_seconds), 100 * (summary.monitor_share or 0.0))
        incomplete = records_incomplete(summary.records_lost_steps, bool(mech.summary_written),
                                        summary.async_evaluation["failure"])
        if incomplete:
            sys.stderr.write(f"deepspeed_train: {incomplete}\n")
    dist.barrier()
    stop_signal.uninstall()
    from megatron_mech.records.run_directory import RECORDS_INCOMPLETE_EXIT, release_run_directories
    from megatron_mech.trainers.process_exit import end_now_if_worker_left_running

    release_run_directories()  # the claim ends with the run, also when the process calling main() goes on
    code = RECORDS_INCOMPLETE_EXIT if incomplete else 0
    end_now_if_worker_left_running(mech.hook, code)  # a worker still in a gloo collective would abort the exit
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
