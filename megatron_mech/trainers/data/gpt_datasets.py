"""megatron-core ``GPTDataset`` s over a prepared corpus (:func:`build_gpt_datasets`, on every rank)."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from megatron_mech.trainers.data.tokenizer import CorpusTokenizer, _register_megatron_base, load_tokenizer

__all__ = ["build_gpt_datasets"]


def build_gpt_datasets(paths: Any, seq_length: int, seed: int = 1234,
                       train_samples: Optional[int] = None, valid_samples: Optional[int] = None,
                       tokenizer: Optional[CorpusTokenizer] = None, cache_dir: os.PathLike[str] | str | None = None,
                       is_built_on_rank: Optional[Callable[[], bool]] = None, **config_overrides: Any):
    """(train, valid) megatron-core ``GPTDataset`` s over a prepared corpus (``paths``: its
    :class:`~megatron_mech.trainers.data.embedded.DataPaths`).

    Uses ``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` with ``blend_per_split`` (train prefix,
    valid prefix, no test). ``*_samples=None`` means one epoch of that split; more samples than an epoch
    wrap into further (reshuffled) epochs. Each item is megatron's dict: ``tokens``/``labels``/
    ``loss_mask``/``position_ids`` of length ``seq_length`` (+ ``attention_mask`` unless
    ``create_attention_mask=False``), drawn from ``seq_length + 1`` consecutive tokens of the stream.

    Works in a single process without ``torch.distributed`` and under torchrun. When torch.distributed
    is initialised this is a collective: call it on *every* rank (rank 0 builds the index cache, barrier,
    the others load it). ``is_built_on_rank`` defaults to "every rank" (return False on ranks that need no
    data, e.g. non-first pipeline stages; they get None). The index cache (``.npy``) goes to ``cache_dir``,
    default ``<data dir>/gpt_index_cache``; pass a run directory if the data dir is read-only.
    ``config_overrides`` go to ``GPTDatasetConfig`` (defaults: no position-id/attention-mask resets,
    ``eod_mask_loss=False``).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    _register_megatron_base(import_megatron=True)
    tok = tokenizer if tokenizer is not None else load_tokenizer(paths)
    kwargs: Dict[str, Any] = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    kwargs.update(config_overrides)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend_per_split=[paths.train_blend or ([paths.train_prefix], None),
                         paths.valid_blend or ([paths.valid_prefix], None), None],
        tokenizer=tok,
        path_to_cache=str(cache_dir) if cache_dir is not None else paths.index_cache_dir,
        **kwargs,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, valid_samples, None],
                                            is_built_on_rank or (lambda: True), config)
    train, valid, _ = builder.build()
    return train, valid
