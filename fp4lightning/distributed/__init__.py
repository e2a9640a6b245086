"""Data-parallel communication: FP8 gradient exchange for DDP (:mod:`~fp4lightning.distributed.comm`), its
one-device simulation (:mod:`~fp4lightning.distributed.grad_comm_sim`) and FSDP2 with FP4 weight gathers
(:mod:`~fp4lightning.distributed.fsdp`)."""
