"""The GPT family written once: configuration, parameter layout, kernels, the tensor-parallel
stage model, data, plans and runtime that the gpt2 and gpt3 front ends share."""
