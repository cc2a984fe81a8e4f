"""MoE variants: BigMac, FarSkip-Collective, Sem-MoE (megatron-core modules and specs)."""
