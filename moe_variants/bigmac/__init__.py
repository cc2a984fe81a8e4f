"""BigMac (DCCA): MoE layers whose all-to-all runs at a low dimension r x h.

``layer.BigMacMoELayer`` is the megatron-core module; ``accounting`` gives parameters, FLOPs and
all-to-all bytes (BigMac Table 3) for both the fine-grained baseline and BigMac.
"""
