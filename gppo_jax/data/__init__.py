"""Data and environments (plain Python; no JAX).

- `tasks`: the built-in synthetic tasks (`addsub3`, ...).
- `readers`: the JSONL / JSON / Parquet reader, and prompt/answer datasets.
- `envs`: a built-in task or a dataset plus its reward, behind one `Env` interface.
"""
