"""CosmoFlow: model config and shard layout, NumPy 3D-CNN kernels, and the spatial x data
parallel proxy."""
