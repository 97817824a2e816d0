"""megatron-mech: mechanism-based instability monitors and MoLS for megatron-core, Megatron-LM and DeepSpeed.

torch is a plain requirement on purpose: users bring the torch build that matches their CUDA stack.
The CI/dev install path (``scripts/setup.sh``) pins ``torch==2.13.0`` (CPU wheel) *before* installing this package.
"""
from setuptools import find_packages, setup

EXTRAS = {
    "megatron": ["megatron-core>=0.13", "psutil"],
    # DeepSpeed adapter: engines (ZeRO 0-3, deepspeed.moe) and the HF models it discovers (AttentionInterface).
    "deepspeed": ["deepspeed>=0.16", "transformers>=4.48"],
    # A Megatron-LM fork's own pretrain_gpt.py (megatron/training/) imports these beyond megatron-core's own
    # dependencies; pybind11 builds its dataset helpers; triton is imported at module level by
    # megatron/core/transformer/custom_layers/batch_invariant_kernels.py (no triton kernel runs on CPU).
    "megatron-lm": ["megatron-core>=0.13", "psutil", "six", "regex", "pydantic>=2", "pybind11", "triton"],
    "viz": ["matplotlib>=3.7", "tensorboard>=2.12"],
    "data": ["tokenizers>=0.15"],
    # LoRA fine-tuning with MoLS (tests and benchmarks/bench_mols_lora.py): peft wraps HF transformers models.
    "lora": ["peft>=0.13", "transformers>=4.48"],
    "test": ["pytest>=7", "hypothesis>=6", "pytest-timeout>=2"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="megatron-mech",
    version="0.1.0",
    description="Mechanism-based training-instability monitors and module-wise LR scaling (MoLS) "
    "for megatron-core, Megatron-LM and DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_mech", "megatron_mech.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.1", "numpy"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megatron-mech=megatron_mech.cli:main"]},
)
