"""gppo_jax: Generalized Proximal Policy Optimization for LLM reinforcement learning in JAX.

The math layer (divergences, estimators, objective, advantages, theory) imports only jax/numpy;
the model side, rewards/data and the training shell build on it. See README.md.
"""

__version__ = "0.1.0"
