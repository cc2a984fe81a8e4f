"""FarSkip-Collective: connectivity that lets dispatch/combine overlap attention and the next layer.

``config.FarSkipConfig`` is the variant's config section (``--farskip``, ``--farskip-impl``, ...);
``variant.FarSkip`` registers it; ``block.apply_farskip`` switches a built model's selected layers
to the two-stream connectivity, executed ``simple`` (blocking, the reference) or ``overlapped``.
"""
