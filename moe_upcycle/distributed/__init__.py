"""Distributed stage: one build spread over the processes of a torchrun job, on one node or several.

`world` joins the job (a gloo process group from torchrun's environment; one process alone without it) and
makes one rank's failure every rank's (`failure_record`: what failed, raised again on the others);
`shard_split` deals the output shards to the ranks, balanced by bytes; `ranked_build` shares the lead's
staging folder and writes each rank's shards; `local_launch` starts N ranks on this machine
(``build --workers N``). `build.upcycle` runs through them with any number of processes, one included: the
same bytes whatever the world size (docs/distributed.md).
"""
