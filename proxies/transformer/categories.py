"""The timing categories the GPT proxies add (core/report.py has the shared ones): the
label of each, in display order, and the column headers of the tables where the automatic
abbreviation would not read well. gpt2 and gpt3 declare the same family's categories."""

CATEGORIES = {
    "embed_allreduce": "tied-embedding allreduce",
    "tp_allreduce": "tensor-parallel allreduce",
    "tp_allgather": "tensor-parallel allgather",
    "tp_reduce_scatter": "tensor-parallel reduce-scatter",
    "ep_alltoall": "expert all-to-all (dispatch, combine)",
    "edp_allreduce": "expert-data-parallel allreduce",
    # context parallelism (transformer/cp.py): the ring's point-to-point key/value
    # blocks ("cp", with cp_send / cp_recv bytes), and the collectives of the other comms
    "cp": "context-parallel ring (k,v and dk,dv blocks)",
    "cp_allgather": "context-parallel allgather (k,v)",
    "cp_allreduce": "context-parallel allreduce (dk,dv)",
    "cp_reduce": "context-parallel reduces (dk,dv)",
    "cp_reduce_scatter": "context-parallel reduce-scatter (dk,dv)",
    "cp_alltoall": "context-parallel all-to-all (Ulysses)",
    # FSDP / ZeRO-3 (transformer/fsdp.py): per unit, over the shard group; HSDP's replicas
    "fsdp_allgather": "FSDP parameter all-gather",
    "fsdp_reduce_scatter": "FSDP gradient reduce-scatter",
    "hsdp_allreduce": "HSDP replica allreduce (reduced shards)",
}
SHORT = {
    "embed_allreduce": "tied ar",
    "ep_alltoall": "ep a2a",
    "cp": "cp ring",
    "cp_allgather": "cp ag",
    "cp_allreduce": "cp ar",
    "cp_reduce": "cp red",
    "cp_reduce_scatter": "cp rs",
    "cp_alltoall": "cp a2a",
    "fsdp_allgather": "fsdp ag",
    "fsdp_reduce_scatter": "fsdp rs",
    "hsdp_allreduce": "hsdp ar",
}
