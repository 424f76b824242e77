"""Distributed stage: moe-upcycle inside torch.distributed jobs (torchrun, FSDP2, DTensor, DCP).

One build spread over the processes of a torchrun job, on one node or several: `world` joins the job (a gloo
process group from torchrun's environment; one process alone without it) and makes one rank's failure every
rank's (`failure_record`: what failed, raised again on the others; a rank gone without a word is found and named);
`agreement` proves every rank has the same recipe, sources and plan before the first byte; `shard_split` deals the
output shards to the ranks, balanced by bytes; `ranked_build` shares the lead's staging folder and writes each
rank's shards; `local_launch` starts N ranks on this machine (``build --workers N``). `build.upcycle` runs
through them with any number of processes, one included: the same bytes whatever the world size (docs/distributed.md).

Upcycling inside a training job: `fsdp_layout` reads how a dense model was sharded with FSDP2's ``fully_shard``;
`sharded_model` gives the MoE the same sharding and `local_fill` fills each rank's own shards (`upcycle_model`
calls them when the dense model holds DTensors); `dcp_export` streams a sharded MoE into the Hugging Face folder a
build writes; `rank_failures` makes one rank's failure every rank's there (docs/fsdp.md).
"""
