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
}
SHORT = {"embed_allreduce": "tied ar", "ep_alltoall": "ep a2a"}
