"""Layer 1, the model: config, layers, the Qwen3-Next hybrid decoder, weights and tokenizers.

Imports only `kernels_pallas` below it; nothing here knows about pools, layouts or serving.
"""
