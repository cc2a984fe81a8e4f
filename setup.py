"""Install the MoE communication stack on top of the pinned megatron-core wheel.

`megatron` is a namespace package shared with megatron-core: this repository adds
`megatron.common`, `megatron.compat`, `megatron.components`, `megatron.training` and
`megatron.inference`, and must never ship `megatron/__init__.py`.
"""

from setuptools import find_namespace_packages, setup

EXTRAS = {
    # Transformer Engine range accepted by megatron-core 0.16.1's own `dev` extra.
    "gpu": ["transformer-engine[pytorch]>=2.9.0a0,<2.12.0"],
    "log": ["wandb", "tensorboard"],
    # the [api] extra: lm-eval's local-completions model, which scores through the server
    "eval": ["lm-eval[api]>=0.4.9,<0.5"],
    "data": ["datasets", "tokenizers>=0.15"],
    "dev": ["pytest>=7", "pytest-timeout", "pytest-xdist", "transformers>=4.46,<5", "safetensors", "scipy", "matplotlib",
            "openai==3.51.0", "hypothesis>=6.100,<7"],
    # megatron.inference.serve: hypercorn serves the HTTP API; einops is megatron-core's optional
    # dependency for its dynamic-batching attention; jinja2 renders tokenizer chat templates.
    "serve": ["hypercorn==0.18.0", "einops==0.8.2", "jinja2>=3.1"],
    # the EP benchmark's deepspeed-moe peer (tools/bench/peers): DeepSpeed's MoE layer on CPU/gloo
    # (DS_ACCELERATOR=cpu; it JIT-builds a small C++ op on first use). Its only torch requirement is
    # unversioned, so an installed torch is kept.
    "deepspeed": ["deepspeed==0.19.8"],
    # the documentation site (mkdocs.yml, `make docs`); mkdocs-material brings its pymdown-extensions
    "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2"],
}
EXTRAS["all"] = sorted({dep for name, deps in EXTRAS.items() if name != "gpu" for dep in deps})

setup(
    name="moe-comm-stack",
    version="0.1.0",
    description="Megatron-core MoE training with cheaper expert-parallel communication "
    "(BigMac, FarSkip-Collective, Sem-MoE) and a network-topology cost model",
    python_requires=">=3.10",
    packages=find_namespace_packages(
        include=["megatron.training*", "megatron.compat*", "megatron.common*", "megatron.components*", "megatron.inference*",
                 "moe_variants*", "distill*", "netsim*", "tools*"]
    ),
    include_package_data=True,
    package_data={"megatron.components": ["assets/*"]},
    install_requires=[
        "megatron-core==0.16.1",  # 0.17+ needs Python 3.12
        "torch>=2.6",
        "numpy",
        "packaging",
        "pyyaml",
        "tokenizers>=0.15",
        "safetensors",
        "scipy",
        "psutil",
    ],
    extras_require=EXTRAS,
)
