"""python -m proxies.collectives: the collectives benchmark (nccl-tests style), the app over
the algorithms in proxies/core/collectives."""
