"""The trainer: the compiled update, rollouts, evaluation, checkpoints and the run's I/O.

- `train_step`: the typed rollout `Batch` and the compiled update.
- `rollout`: prompts -> responses -> rewards -> advantages -> `Batch`.
- `async_rollout`: the sampler's own devices, parameter moves, the rollout drawn ahead.
- `policy_eval`: greedy accuracy, avg@k and pass@k on held-out prompts.
- `warmstart`: the cached supervised start of the built-in policy.
- `experiment`: what train and evaluate share: workdir lock, policy, state, sampling.
- `checkpointing`: Orbax behind a few functions.
- `metric_writers`: metrics.jsonl, TensorBoard, the progress bar.
- `interrupts`: SIGTERM / SIGINT as a stop flag agreed across hosts.
"""
