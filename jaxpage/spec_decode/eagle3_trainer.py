"""Training an EAGLE-3 head for a target jaxpage serves, on the target's own answers (the speculators library
trains vLLM's heads with torch on GPUs; this trainer is the project's own, on optax, and runs on a CPU):

    python -m jaxpage.spec_decode.eagle3_trainer --out heads/smollm2 [--model M] [--num-prompts 400]

1. The target answers the "train" split of ``chat_prompts`` (greedy, as served).
2. One teacher-forced pass of the target over each conversation gives every position's auxiliary hidden states
   (the residual stream entering layers 2, L/2 and L-3, vLLM's default) and the target's own next-token choice.
3. The draft vocabulary is the ``draft_vocab_size`` tokens the target chose most often.
4. The head learns, with the target frozen, to predict the target's choice two positions on; training-time test
   (``ttt_steps``): step s feeds the head its own output of step s - 1 one position back, attending to step 0's
   keys up to s positions back and to each later step's key on its diagonal, as it attends when it drafts.
5. The head is written in the speculators library's layout (config.json, model.safetensors), which
   ``speculative_config={"method": "eagle3", "model": DIR, ...}`` serves."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpage.models.rope import apply_rope, rope_inv_freq, rope_tables


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    num_prompts: int = 400
    max_tokens: int = 192  # each answer's tokens
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    epochs: int = 4
    batch_size: int = 8
    learning_rate: float = 2e-3
    seed: int = 0
    # the answers' sampling temperature (0: greedy); sampled, a question asked again (num_prompts beyond the
    # split's 400) gets another answer, each drawn with its own seed (seed + its index)
    temperature: float = 0.0


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The head's decoder layer: the target's shapes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    inv_freq: tuple


def conversations(llm, config: TrainConfig) -> list[list[int]]:
    """The target's answers to the train split's questions (greedy, or sampled at ``config.temperature``), as
    chat-templated token ids (prompt and answer)."""
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.spec_decode.chat_prompts import chat_prompts

    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
               for q in chat_prompts("train", config.num_prompts, config.seed)]
    outs = llm.generate(prompts, [SamplingParams(temperature=config.temperature, seed=config.seed + i,
                                                 max_tokens=config.max_tokens) for i in range(len(prompts))])
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def target_features(engine, seqs: list[list[int]], aux_layers: tuple[int, ...], length: int):
    """Each conversation's auxiliary hidden states [N, length, A * D] (bfloat16) and the target's next-token
    choice at each position [N, length] (-1 past its end), from one teacher-forced pass of the target's step
    program's layers (the served weights and dtype)."""
    from jaxpage.attention.kv_cache import allocate_kv_pool
    from jaxpage.models import TokenBatch, compute_raw_logits, forward_hidden_aux

    cfg, params, bs = engine.config.step_model, engine.runner.params, engine.config.cache.block_size
    pool = allocate_kv_pool(cfg, -(-length // bs) + 1, bs, jnp.dtype(engine.config.kv_dtype))

    @jax.jit
    def one(tokens, pool):
        n = tokens.shape[0]
        pos = jnp.arange(n, dtype=jnp.int32)
        table = jnp.arange(1, 1 + -(-n // bs), dtype=jnp.int32)
        tables = jnp.zeros((1, engine.config.max_blocks_per_seq), jnp.int32).at[0, :table.shape[0]].set(table)
        batch = TokenBatch(tokens, pos, table[pos // bs] * bs + pos % bs, jnp.zeros(n, jnp.int32), tables,
                           jnp.zeros(1, jnp.int32))
        hidden, _, aux = forward_hidden_aux(cfg, params, pool, batch, engine.config.attention_backend, aux_layers)
        return aux.astype(jnp.bfloat16), jnp.argmax(compute_raw_logits(cfg, params, hidden), -1).astype(jnp.int32)

    aux_all, choice_all = [], []
    for seq in seqs:
        tokens = np.zeros(length, np.int32)
        tokens[:len(seq)] = seq[:length]
        aux, choice = one(tokens, pool)
        choice = np.array(choice)
        choice[min(len(seq), length):] = -1
        aux_all.append(np.asarray(aux))
        choice_all.append(choice)
    return np.stack(aux_all), np.stack(choice_all)


def draft_vocabulary(choices: np.ndarray, size: int, vocab: int) -> np.ndarray:
    """The ``size`` target tokens chosen most often (ties: lower id), in increasing id order."""
    counts = np.bincount(choices[choices >= 0], minlength=vocab)
    return np.sort(np.argsort(-counts, kind="stable")[:size])


def init_params(shapes: Shapes, num_aux: int, rng: np.random.Generator) -> dict:
    """The head's trained weights ([in, out] kernels, normal of std 1/sqrt(fan-in) x 0.5; norms of ones)."""
    d, h, kvh, hd, inter = shapes.hidden, shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.intermediate

    def w(rows, cols):
        return jnp.asarray(rng.normal(0, 0.5 / math.sqrt(rows), (rows, cols)), jnp.float32)
    ones = lambda n: jnp.ones(n, jnp.float32)  # noqa: E731
    return {"fc": w(num_aux * d, d), "q": w(2 * d, h * hd), "k": w(2 * d, kvh * hd), "v": w(2 * d, kvh * hd),
            "o": w(h * hd, d), "gate": w(d, inter), "up": w(d, inter), "down": w(inter, d),
            "hidden_norm": ones(d), "input_norm": ones(d), "post_norm": ones(d), "norm": ones(d)}


def _rms(x, weight, eps):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * weight


def _shift(x, by: int):
    """x [B, n, ...] moved ``by`` positions later along n (zeros in front)."""
    return x if by == 0 else jnp.pad(x, [(0, 0), (by, 0)] + [(0, 0)] * (x.ndim - 2))[:, :x.shape[1]]


def _attend(shapes: Shapes, q, keys, values, step: int):
    """TTT attention of step ``step``'s queries q [B, n, h, hd]: step 0's keys at positions <= p - step, and step
    i's key (1 <= i <= step) at p - (step - i), as a draft at step ``step`` attends in serving."""
    group, n = shapes.heads // shapes.kv_heads, q.shape[1]
    rep = lambda a: jnp.repeat(a, group, axis=2)  # noqa: E731
    scale = shapes.head_dim ** -0.5
    first = jnp.einsum("bphd,bthd->bhpt", q, rep(keys[0])) * scale
    p, t = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    first = jnp.where(t <= p - step, first, -jnp.inf)
    diag = [jnp.einsum("bphd,bphd->bhp", q, rep(_shift(keys[i], step - i)))[..., None] * scale
            for i in range(1, step + 1)]
    diag = [jnp.where((jnp.arange(n) >= step - i)[None, None, :, None], s, -jnp.inf)
            for i, s in zip(range(1, step + 1), diag)]
    probs = jax.nn.softmax(jnp.concatenate([first, *diag], -1), -1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # a position with no key at all (the sequence's first)
    out = jnp.einsum("bhpt,bthd->bphd", probs[..., :n], rep(values[0]))
    for i in range(1, step + 1):
        out = out + probs[..., n + i - 1, None].transpose(0, 2, 1, 3) * rep(_shift(values[i], step - i))
    return out


def ttt_logits(params: dict, frozen: dict, shapes: Shapes, tokens, aux, ttt_steps: int) -> list:
    """Each TTT step's draft-vocabulary logits [B, n, Vd]. tokens [B, n] (position p's input: token p + 1), aux
    [B, n, A * D] (position p's)."""
    b, n = tokens.shape
    h, kvh, hd = shapes.heads, shapes.kv_heads, shapes.head_dim
    cos, sin = rope_tables(jnp.arange(n), np.asarray(shapes.inv_freq, np.float32)[None])
    rope = jax.vmap(lambda x: apply_rope(x, cos[0], sin[0]))
    embeds = _rms(jnp.asarray(frozen["embed"])[tokens], params["input_norm"], shapes.eps)
    hidden = aux.astype(jnp.float32) @ params["fc"]
    keys, values, logits = [], [], []
    for step in range(ttt_steps):
        normed = _rms(hidden, params["hidden_norm"], shapes.eps)
        x = jnp.concatenate([embeds, normed], -1)
        q = rope((x @ params["q"]).reshape(b, n, h, hd))
        keys.append(rope((x @ params["k"]).reshape(b, n, kvh, hd)))
        values.append((x @ params["v"]).reshape(b, n, kvh, hd))
        x = hidden + _attend(shapes, q, keys, values, step).reshape(b, n, h * hd) @ params["o"]
        m = _rms(x, params["post_norm"], shapes.eps)
        x = x + (jax.nn.silu(m @ params["gate"]) * (m @ params["up"])) @ params["down"]
        logits.append(_rms(x, params["norm"], shapes.eps) @ frozen["lm_head"])
        hidden = _shift(x, 1)  # the next step's position p reads this step's output at p - 1
    return logits


def ttt_losses(params: dict, frozen: dict, shapes: Shapes, tokens, aux, labels, ttt_steps: int):
    """Each TTT step's mean cross-entropy over the positions with a label in the draft vocabulary (labels [B, n]
    draft ids, -1: none) that step reaches (p >= step)."""
    losses = []
    for step, logits in enumerate(ttt_logits(params, frozen, shapes, tokens, aux, ttt_steps)):
        valid = (labels >= 0) & (jnp.arange(tokens.shape[1]) >= step)[None]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
        losses.append(jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(valid.sum(), 1))
    return jnp.stack(losses)


def train(params: dict, frozen: dict, shapes: Shapes, data: tuple, config: TrainConfig, log=print) -> dict:
    """Adam with warm-up and cosine decay over ``config.epochs`` passes of shuffled batches; data: (tokens,
    aux, labels) as ``ttt_losses`` takes them, one row per conversation."""
    tokens, aux, labels = data
    steps_per_epoch = max(1, len(tokens) // config.batch_size)
    total = steps_per_epoch * config.epochs
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, min(100, total // 10), total)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    state = optimizer.init(params)

    @jax.jit
    def update(params, state, frozen, t, a, y):
        def loss(p):
            per_step = ttt_losses(p, frozen, shapes, t, a, y, config.ttt_steps)
            return per_step.sum(), per_step
        (_, per_step), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, per_step

    rng = np.random.default_rng(config.seed)
    for epoch in range(config.epochs):
        order, seen = rng.permutation(len(tokens)), []
        for i in range(steps_per_epoch):
            idx = np.sort(order[i * config.batch_size:(i + 1) * config.batch_size])
            params, state, per_step = update(params, state, frozen, tokens[idx], aux[idx], labels[idx])
            seen.append(np.asarray(per_step))
        log(f"epoch {epoch + 1}/{config.epochs}: loss per TTT step {np.round(np.mean(seen, 0), 3).tolist()}")
    return params


def save_head(out: Path, params: dict, shapes: Shapes, layer_config: dict, draft_ids: np.ndarray,
              aux_layers: tuple[int, ...], lm_head: np.ndarray, vocab: int) -> None:
    """The head in the speculators library's layout: config.json and model.safetensors (transformers' names,
    [out, in] weights; the frozen LM head's draft rows, d2t offsets and t2d)."""
    from safetensors.numpy import save_file

    p = {k: np.asarray(v, np.float32) for k, v in params.items()}
    prefix = "layers.0."
    tensors = {"fc.weight": p["fc"].T, "norm.weight": p["norm"], "lm_head.weight": np.asarray(lm_head).T,
               f"{prefix}hidden_norm.weight": p["hidden_norm"], f"{prefix}input_layernorm.weight": p["input_norm"],
               f"{prefix}post_attention_layernorm.weight": p["post_norm"],
               **{f"{prefix}self_attn.{n}_proj.weight": p[n].T for n in "qkvo"},
               **{f"{prefix}mlp.{n}_proj.weight": p[n].T for n in ("gate", "up", "down")},
               "d2t": (draft_ids - np.arange(len(draft_ids))).astype(np.int64),
               "t2d": np.isin(np.arange(vocab), draft_ids)}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": layer_config, "draft_vocab_size": len(draft_ids),
              "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": list(aux_layers),
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}}}
    (out / "config.json").write_text(json.dumps(config, indent=1))


def head_shapes(cfg) -> tuple[Shapes, dict]:
    """The head's shapes and its transformers layer config (the target's, one layer)."""
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_parameters))
    layer = {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
             "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
             "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
             "hidden_act": cfg.hidden_act, "num_hidden_layers": 1}
    return Shapes(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                  cfg.rms_norm_eps, tuple(inv.tolist())), layer


def train_head(llm, out: Path, config: TrainConfig, log=print, features: Path | None = None) -> dict:
    """Steps 1-5 of the module's docstring for the target served by ``llm``; returns the timings (seconds).
    features: an .npz of steps 1-2's results, written if missing, read (steps 1-2 skipped) if present."""
    engine = llm.engine
    cfg = engine.config.step_model
    n = cfg.num_layers
    aux_layers = (2, n // 2, n - 3)
    times, started = {}, time.perf_counter()
    if features is not None and features.exists():  # an earlier run's conversations and features
        with np.load(features) as f:
            seqs = [row[row >= 0].tolist() for row in f["seqs"]]
            aux, choices = f["aux"].view(jnp.bfloat16), f["choices"]
        times["generate"] = times["features"] = 0.0
    else:
        seqs = conversations(llm, config)
        times["generate"] = time.perf_counter() - started
        aux, choices = target_features(engine, seqs, aux_layers, max(len(s) for s in seqs))
        times["features"] = time.perf_counter() - started - times["generate"]
        if features is not None:
            rows = np.full((len(seqs), aux.shape[1]), -1, np.int32)
            for i, s in enumerate(seqs):
                rows[i, :len(s)] = s
            np.savez(features, seqs=rows, aux=aux.view(np.uint16), choices=choices)
    length, started = aux.shape[1], time.perf_counter()
    draft_ids = draft_vocabulary(choices, config.draft_vocab_size, cfg.vocab_size)
    to_draft = np.full(cfg.vocab_size + 1, -1, np.int32)
    to_draft[draft_ids] = np.arange(len(draft_ids))
    tokens = np.stack([np.pad(s[1:length], (0, length - 1 - len(s[1:length]))) for s in seqs]).astype(np.int32)
    labels = to_draft[choices[:, 1:]]  # -1 past the end (choice -1 reads the extra entry) or off the vocabulary
    log(f"{len(seqs)} conversations, {int((choices >= 0).sum())} positions; the draft vocabulary of "
        f"{len(draft_ids)} tokens covers {float((labels >= 0).sum() / (choices[:, 1:] >= 0).sum()):.1%} of labels")
    embed = np.asarray(engine.runner.params["embed"]["embedding"], np.float32)
    if not cfg.tie_word_embeddings:
        raise ValueError("the trainer takes a target whose LM head is its embedding (tie_word_embeddings)")
    lm_head = embed.T[:, draft_ids]  # speculators' start: the target's LM head, kept frozen
    shapes, layer = head_shapes(cfg)
    frozen = {"embed": jnp.asarray(embed), "lm_head": jnp.asarray(lm_head)}
    params = init_params(shapes, len(aux_layers), np.random.default_rng(config.seed))
    params = train(params, frozen, shapes, (tokens, aux[:, :-1], labels), config, log)
    times["train"] = time.perf_counter() - started
    save_head(out, params, shapes, layer, draft_ids, aux_layers, lm_head, cfg.vocab_size)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the head's directory (written)")
    parser.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--features", type=Path, default=None,
                        help="an .npz keeping the conversations and the target's features: written, or read if present")
    for field in dataclasses.fields(TrainConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = parser.parse_args(argv)
    from jaxpage import LLM

    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=512, progress=False)
    times = train_head(llm, Path(args.out), config, features=args.features)
    print(json.dumps({"out": args.out, "config": dataclasses.asdict(config),
                      "seconds": {k: round(v, 1) for k, v in times.items()}}))


if __name__ == "__main__":
    main()
