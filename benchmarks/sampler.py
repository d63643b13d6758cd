"""New tokens/s of the KV-cached JAX sampler vs Hugging Face `generate` and a no-cache JAX decode.

All run in this process on the same random Qwen2-shape model (weights copied from the HF model
into ours through hf_checkpoint when possible) and the same left-padded batch, float32, 2 CPU
threads each. Repeats are interleaved (this machine's speed drifts by 20-30%), compile time is
excluded from throughput and reported separately; medians are compared. Ends with one JSON line.

Methods: `ours` (the sampler as shipped: one prefill per group of `--group` identical prompts,
then on CPU the unrolled decode: layers unrolled, cache per layer with keys transposed, grown in
up to 4 phases), `ours_scan` (with --scan 1: the TPU / GPU form, a scan over the stacked layers
attending over the filled cache blocks), `hf`
(generate on the same rows; it prefills every row, as it does with num_return_sequences) and
`nocache` (full recompute every step). Compile time is timed alone (ahead-of-time lower +
compile); a first call would also decode. --compile-only 1 prints only `ours`' compile time.

Model: vocab 32k, hidden 512, 4 layers, 8 query / 2 KV heads (GQA, Qwen2 q/k/v bias), MLP 1408
(~44M parameters, two thirds in the embedding and LM head). Small enough to decode a batch in
about a second on 2 cores, big enough that per-token compute rather than Python or dispatch
overhead dominates, and its vocab-heavy cost split resembles small RL policies (Qwen2.5-0.5B).

  python benchmarks/sampler.py [--batch 8 --prompt 32 --new 64 --repeats 3 --group 1]
  python benchmarks/sampler.py --batch 64 --group 8 --nocache 0    # RL layout: 8 prompts x 8
  python benchmarks/sampler.py --new 1024 --nocache 0 --repeats 2
  python benchmarks/sampler.py --new 4096 --compile-only 1        # compile time alone
  python benchmarks/sampler.py --lora-rank 16 --nocache 0         # LoRA: merged vs on the fly

--lora-rank R > 0 times only ours, with rank-R adapters on every projection: `lora_merged`
(the sampler runs on W + s A B, merged once per call: model.SAMPLER_MERGES_LORA)
against `lora_fly` (the adapters applied at every step) and `base` (no adapters), and prints
the ratio lora_merged / lora_fly of their tokens/s.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from gppo_jax.generation import sampler
from gppo_jax.models import architectures
from gppo_jax.models import lora as lora_lib
from gppo_jax.models import model as model_lib
from gppo_jax.trainer import experiment

HF_SHAPE = dict(
  vocab_size=32000,
  hidden_size=512,
  intermediate_size=1408,
  num_hidden_layers=4,
  num_attention_heads=8,
  num_key_value_heads=2,
  max_position_embeddings=2048,
  rope_theta=10000.0,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
)


def build_models(seed: int):
  """(hf_model, our_model, copied): a random HF Qwen2 and ours with the same weights if loadable."""
  from transformers import Qwen2Config, Qwen2ForCausalLM

  torch.manual_seed(seed)
  hf_cfg = Qwen2Config(**HF_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  hf = Qwen2ForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
  hf.eval()
  try:
    from gppo_jax.models import hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
      hf.save_pretrained(tmp)
      ours = hf_checkpoint.load_model(tmp)
    return hf, ours, True
  except Exception as e:  # loader missing or failing: same shapes, random weights
    print(f"[warn] weights not copied ({type(e).__name__}: {e}); using random weights")
    cfg = architectures.ModelConfig(
      32000, 512, 1408, 4, 8, 2, 64, attention_bias=True, family="qwen2", pad_token_id=0
    )
    return hf, model_lib.Transformer(cfg, rngs=nnx.Rngs(seed)), False


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int, group: int = 1):
  """batch // group random prompts, each repeated `group` times in a row (the rollout layout)."""
  rs = np.random.RandomState(seed)
  lengths = rs.randint(prompt_len // 2, prompt_len + 1, size=batch // group)
  lengths[0] = prompt_len
  prompts = [list(rs.randint(3, vocab, size=n)) for n in lengths]
  rows = [p for p in prompts for _ in range(group)]
  return sampler.left_pad(rows, pad_id=0, length=prompt_len)


def nocache_decoder(graphdef, n_new: int):
  """Jitted baseline: every step recomputes the full forward over [B, P + n_new], then samples."""

  @jax.jit
  def run(params, tokens, mask, rng):
    model = nnx.merge(graphdef, params)
    B, P = tokens.shape
    tokens = jnp.concatenate([tokens, jnp.zeros((B, n_new), jnp.int32)], axis=1)
    mask = jnp.concatenate([mask, jnp.zeros((B, n_new), bool)], axis=1)

    def step(i, carry):
      tokens, mask = carry
      hidden = model(tokens, model_lib.positions_from_mask(mask), attn_mask=mask).hidden
      h = jax.lax.dynamic_index_in_dim(hidden, P + i - 1, axis=1, keepdims=False)
      tok = jax.random.categorical(jax.random.fold_in(rng, i), model.logits(h)).astype(jnp.int32)
      tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, P + i, axis=1)
      mask = jax.lax.dynamic_update_index_in_dim(mask, jnp.ones_like(tok, bool), P + i, axis=1)
      return tokens, mask

    return jax.lax.fori_loop(0, n_new, step, (tokens, mask))[0][:, P:]

  return run


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=32)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--nocache", type=int, default=1, help="also time the no-cache decode (0/1)")
  ap.add_argument("--group", type=int, default=1, help="rows per prompt (G samples of a prompt)")
  ap.add_argument("--scan", type=int, default=0, help="also time the layer scan decode (0/1)")
  ap.add_argument("--compile-only", type=int, default=0, help="only time ours' compile (0/1)")
  ap.add_argument("--lora-rank", type=int, default=0, help="LoRA: merged vs on the fly (rank)")
  args = ap.parse_args()
  # The trainer's host-memory setting (experiment.keep_cpu_memory), for both sides of the
  # comparison: they share this process. GPPO_CPU_MEMORY=release: glibc's and JAX's defaults.
  kept = experiment.keep_cpu_memory()
  torch.set_num_threads(2)
  B, P, N, G = args.batch, args.prompt, args.new, args.group
  if B % G:
    ap.error(f"--group {G} must divide --batch {B}")

  hf, ours, copied = build_models(0)
  tokens, mask = make_prompts(B, P, HF_SHAPE["vocab_size"], 0, G)
  assert sampler.detect_group_size(tokens, mask) == G
  graphdef, params = nnx.split(ours)
  sp = sampler.SamplingParams(max_new_tokens=N, temperature=1.0, stop_ids=(), pad_id=0)
  nocache = nocache_decoder(graphdef, N)
  jt, jm = jnp.asarray(tokens), jnp.asarray(mask)
  pt, pm = torch.from_numpy(tokens).long(), torch.from_numpy(mask).long()

  compile_s = {}

  def compiled_sampler(name, **kw):
    """Traces and compiles `sampler.sample` ahead of time (timed alone), returns run(r)."""
    t = time.perf_counter()
    fn = jax.jit(sampler.sample, static_argnums=(0, 5), static_argnames=("group_size", *kw))
    exe = fn.lower(graphdef, params, jt, jm, jax.random.key(0), sp, group_size=G, **kw).compile()
    compile_s[name] = time.perf_counter() - t
    return lambda r: exe(params, jt, jm, jax.random.key(r)).tokens

  def run_nocache(r):
    return nocache(params, jt, jm, jax.random.key(r))

  def run_hf(r, **kw):
    torch.manual_seed(r)
    with torch.inference_mode():
      out = hf.generate(
        input_ids=pt, attention_mask=pm, max_new_tokens=N, min_new_tokens=N, pad_token_id=0,
        eos_token_id=None, use_cache=True, **(kw or dict(do_sample=True, top_k=0, top_p=1.0,
        temperature=1.0)),
      )  # fmt: skip
    return out[:, P:]

  if args.lora_rank:
    return lora_comparison(ours, args.lora_rank, jt, jm, sp, G, args.repeats)
  methods = {"ours": compiled_sampler("ours"), "hf": run_hf}
  if args.compile_only:
    print(json.dumps(dict(benchmark="sampler_compile", batch=B, group=G, prompt=P, new_tokens=N,
                          compile_s=round(compile_s["ours"], 2))))  # fmt: skip
    return
  if args.scan:
    methods["ours_scan"] = compiled_sampler("ours_scan", unroll_layers=False)
  if args.nocache:
    methods["nocache"] = run_nocache
  first_call = {}
  for name, fn in methods.items():  # nocache: compiles; all: warm-up (allocator, kernels)
    t = time.perf_counter()
    jax.block_until_ready(fn(0)) if name != "hf" else fn(0)
    first_call[name] = time.perf_counter() - t

  # Sanity: with copied weights, greedy decoding of both implementations should agree (on the
  # first 16 tokens, or all N if fewer: HF's greedy run makes N).
  agree, n_agree = None, min(16, N)
  if copied:
    g = sampler.generate(ours, tokens, mask, jax.random.key(0), max_new_tokens=n_agree, greedy=True)
    h = run_hf(0, do_sample=False)[:, :n_agree].numpy()
    agree = float((np.asarray(g.tokens) == h).mean())

  times = {k: [] for k in methods}
  for r in range(1, args.repeats + 1):
    for name, fn in methods.items():
      t = time.perf_counter()
      out = fn(r)
      jax.block_until_ready(out) if name != "hf" else None
      times[name].append(time.perf_counter() - t)
      assert tuple(out.shape) == (B, N), (name, out.shape)

  tps = {k: B * N / statistics.median(v) for k, v in times.items()}
  if args.nocache:  # compiled by its first call: that call's time less a steady call's
    compile_s["nocache"] = first_call["nocache"] - statistics.median(times["nocache"])
  best = {k: B * N / min(v) for k, v in times.items()}  # robust to load spikes from other jobs
  n_params = model_lib.param_count(ours)
  print(f"model: Qwen2-shape {n_params / 1e6:.1f}M params, weights copied from HF: {copied}")
  print(
    f"batch {B} ({B // G} prompts x {G}), prompt {P} (left-padded), {N} new tokens, float32, "
    f"2 threads; decode phases end at cache slots {sampler.phase_ends(P, N)}"
  )
  if agree is not None:
    print(f"greedy agreement ours vs HF ({n_agree} tokens): {agree:.3f}")
  for k, v in times.items():
    spread = f"{min(v):.3f}-{max(v):.3f}s"
    print(f"  {k:8s} {tps[k]:9.1f} new tok/s  (median of {len(v)}: {spread})")
  print("compile (excluded): " + ", ".join(f"{k} {v:.1f}s" for k, v in compile_s.items()))
  ratios = {"ours_vs_hf": tps["ours"] / tps["hf"], "ours_vs_hf_best": best["ours"] / best["hf"]}
  if "ours_scan" in tps:
    ratios["ours_vs_scan"] = tps["ours"] / tps["ours_scan"]
  if args.nocache:
    ratios["ours_vs_nocache"] = tps["ours"] / tps["nocache"]
    ratios["ours_vs_nocache_best"] = best["ours"] / best["nocache"]
  print("  ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()), "(medians; _best: fastest runs)")
  result = dict(
    benchmark="sampler", batch=B, group=G, prompt=P, new_tokens=N,
    params_m=round(n_params / 1e6, 1), phase_ends=sampler.phase_ends(P, N),
    weights_copied=copied, greedy_agreement=agree,
    tokens_per_s={k: round(v, 1) for k, v in tps.items()},
    tokens_per_s_best={k: round(v, 1) for k, v in best.items()},
    compile_s={k: round(v, 2) for k, v in compile_s.items()}, cpu_memory_kept=kept,
    **{k: round(v, 3) for k, v in ratios.items()},
  )  # fmt: skip
  print(f"host memory: {'kept for reuse' if kept else 'glibc and JAX defaults'} (GPPO_CPU_MEMORY)")
  print(json.dumps(result))


def lora_comparison(ours, rank: int, tokens, mask, sp, group: int, repeats: int) -> None:
  """Tokens/s of the sampler on `ours` with rank-`rank` adapters on every projection, merged
  into the decode weights once per call vs applied at every step, and without adapters."""
  B, N = tokens.shape[0], sp.max_new_tokens
  base_graphdef, base_params = nnx.split(ours)
  cfg = dataclasses.replace(ours.cfg, lora_rank=rank, lora_alpha=2.0 * rank)
  graphdef, params = model_lib.with_lora(cfg, base_params, seed=0)
  adapters, base = lora_lib.split_lora(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  noise = [0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
  params = nnx.merge_state(base, jax.tree.unflatten(tree, noise))  # B != 0: adapters matter

  def compiled(g, p, merge):
    model_lib.SAMPLER_MERGES_LORA = merge  # read while tracing
    fn = jax.jit(sampler.sample, static_argnums=(0, 5), static_argnames=("group_size",))
    exe = fn.lower(g, p, tokens, mask, jax.random.key(0), sp, group_size=group).compile()
    return lambda r: exe(p, tokens, mask, jax.random.key(r)).tokens

  methods = {
    "lora_merged": compiled(graphdef, params, True),
    "lora_fly": compiled(graphdef, params, False),
    "base": compiled(base_graphdef, base_params, True),
  }
  model_lib.SAMPLER_MERGES_LORA = False  # the default
  for fn in methods.values():
    jax.block_until_ready(fn(0))
  times = {k: [] for k in methods}
  for r in range(1, repeats + 1):
    for name, fn in methods.items():
      jax.block_until_ready(fn(-r))  # an untimed call of its own right before the timed one
      t = time.perf_counter()
      jax.block_until_ready(fn(r))
      times[name].append(time.perf_counter() - t)
  tps = {k: B * N / statistics.median(v) for k, v in times.items()}
  rounds = [m / f for m, f in zip(times["lora_fly"], times["lora_merged"], strict=True)]
  for k, v in times.items():
    print(f"  {k:12s} {tps[k]:9.1f} new tok/s  (median of {len(v)}: {min(v):.3f}-{max(v):.3f}s)")
  ratio = tps["lora_merged"] / tps["lora_fly"]
  print(
    f"lora_merged / lora_fly = {ratio:.2f}x (rounds {min(rounds):.2f}-{max(rounds):.2f}); "
    f"base / lora_merged = {tps['base'] / tps['lora_merged']:.2f}x  (rank {rank}, batch {B}, "
    f"{N} new tokens, backend {jax.default_backend()})"
  )
  print(
    json.dumps(
      dict(
        benchmark="sampler_lora", rank=rank, batch=B, new_tokens=N,
        backend=jax.default_backend(), merged_vs_fly=round(ratio, 3),
        merged_vs_fly_rounds=[round(x, 3) for x in rounds],
        tokens_per_s={k: round(v, 1) for k, v in tps.items()},
      )
    )
  )  # fmt: skip


if __name__ == "__main__":
  main()
