"""GPT-3 (+MoE) proxy: data x tensor x pipeline (x expert) parallelism, as Megatron-LM."""
