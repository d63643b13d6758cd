"""The policy model: architectures, attention, the decoder, sharding and Hugging Face I/O.

- `architectures`: `ModelConfig`, the named architectures, the config.json mapping.
- `attention`: causal GQA attention (dense reference, blockwise, cuDNN, splash).
- `low_precision`: 16-bit matrix products kept in 16 bits on XLA's CPU backend.
- `model`: the Llama/Qwen decoder (Flax NNX), its KV cache and chunked log-prob heads.
- `partitioning`: logical-axis rules, the batch axes, activation constraints.
- `sharding`: the mesh, multi-host start-up, state and batch shardings, sharded jits.
- `hf_checkpoint`: Hugging Face safetensors in and out.
- `tokenizer`: tokenizer.json and chat templates.
"""
