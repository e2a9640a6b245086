"""Lightning integration: the precision plugin (:mod:`~fp4lightning.lightning.precision`) and its names,
``fp4lightning.Trainer``, Fabric, the DDP/FSDP strategies, dynamic loss scaling, the non-finite-step policy
and the reduced-precision AdamW (arXiv 2501.17116, section 4)."""
