"""Generation: the KV-cached sampler (`sampler`) on one device or a mesh (`MeshSampler`)."""
