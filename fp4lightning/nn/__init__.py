"""Layers: :class:`~fp4lightning.nn.linear.FP4Linear` (autograd over the three FP4 GeMMs), the block-scaled
recipes' layer (:mod:`~fp4lightning.nn.block_linear`) and the in-place conversion
(:func:`~fp4lightning.nn.convert.convert_to_fp4`)."""
