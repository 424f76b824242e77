"""Distributed stage: moe-upcycle inside torch.distributed jobs (torchrun, FSDP2, DTensor, DCP).

`fsdp_layout` reads how a dense model was sharded with FSDP2's ``fully_shard``; `sharded_model` gives the MoE the
same sharding and `local_fill` fills each rank's own shards (`upcycle_model` calls them when the dense model holds
DTensors); `dcp_export` streams a sharded MoE into the Hugging Face folder a build writes; `rank_failures` makes one
rank's failure every rank's. Nothing here runs without an initialised process group, except on a model that holds
no DTensor (the world-size-1 case).
"""
