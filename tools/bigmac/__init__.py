"""BigMac tools: the side-by-side compute profile of a BigMac layer and its fine-grained twin
(``python -m tools.bigmac.profile_layer``). The variant itself is ``moe_variants.bigmac``."""
