"""GPT-2: model config and parameter layout, NumPy kernels, and the pipeline x data proxy."""
