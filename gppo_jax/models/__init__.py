"""The policy model: architectures, attention, the decoder, sharding and Hugging Face I/O.

- `architectures`: `ModelConfig`, the named architectures, the config.json mapping.
- `attention`: causal GQA attention (dense reference, blockwise, cuDNN, splash).
- `low_precision`: 16-bit matrix products kept in 16 bits on XLA's CPU backend; `project`.
- `model`: the Llama/Qwen/Gemma decoder (Flax NNX), its `ModelOutput` and KV caches.
- `lora`: LoRA adapters: parameters, their term, merging, splitting a policy's state.
- `moe`: the mixture-of-experts MLP: router, expert dispatch, routing, load-balancing loss.
- `heads`: the output head and the chunked log-probs training reads.
- `partitioning`: logical-axis rules, the batch axes, activation constraints.
- `sharding`: the mesh, multi-host start-up, state and batch shardings, sharded jits.
- `hf_checkpoint`: Hugging Face safetensors in and out.
- `tokenizer`: tokenizer.json and chat templates.
"""
