"""gppo_jax: Generalized Proximal Policy Optimization for LLM reinforcement learning in JAX.

The package is layered; each folder imports only from the folders above it in this list
(docs/architecture.md, checked by tests/test_layering.py):

- `errors`, `registry`, `cli`: user-error types, the name registry, command-line error handling.
- `algorithm/`: divergences, estimators, the GPPO objective, advantages, theory, presets.
- `models/`: the Llama/Qwen decoder, attention, sharding, Hugging Face checkpoints, tokenizer.
- `generation/`: the KV-cached sampler.
- `rewards/`: math and sandboxed code rewards, pass@k.
- `data/`: built-in tasks, dataset readers, environments.
- `config_lib`: the config every `configs/*.py` file builds, and its validation.
- `trainer/`: the compiled update, rollouts, evaluation, warm start, checkpoints, metrics.
- `research/`: the sweep's report and statistics, estimator diagnostics.
- entry points: `python -m gppo_jax.train | evaluate | plan | prepare_data | sweep`.
"""

__version__ = "0.1.0"
