"""The trainers' data: the embedded corpus (``corpus``), its BPE tokenizer (``tokenizer``), the prepared Megatron
``.bin/.idx`` files (``embedded``) and megatron-core datasets over them (``gpt_datasets``), and the checks of a
user's ``--data-path`` files (``data_path``, ``data_checks``)."""
