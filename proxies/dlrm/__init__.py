"""DLRM: presets, NumPy kernels, the sharded model, and the embedding all-to-all x
data-parallel MLP proxy."""
