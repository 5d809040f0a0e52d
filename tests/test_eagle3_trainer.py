"""The EAGLE-3 trainer (jaxpage/spec_decode/eagle3_trainer.py): its training-time-test pass is the served head's
drafting, step for step (each step's logits at a position equal the float32 torch reference's draft chain that
starts from the target's hidden states that many positions back), a head it saves loads into the engine, and
training lowers the loss on a tiny target's own choices; sampled answers (SmolLM2) vary a repeated question and
repeat with their seeds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxpage.spec_decode import eagle3_trainer as tr
from tests.eagle3_heads import reference_pass
from tests.factories import tiny_llama

D, N = 64, 12


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A trainer-initialized head of the tiny Llama's shapes (its norms and fc perturbed), saved; with its frozen
    embedding and LM head over a draft vocabulary of 100 tokens."""
    from jaxpage.config import ModelConfig
    from jaxpage.models.hf_config import common_fields

    cfg = ModelConfig(**common_fields(tiny_llama(num_hidden_layers=4)))
    shapes, layer = tr.head_shapes(cfg)
    rng = np.random.default_rng(0)
    params = tr.init_params(shapes, 3, rng)
    params = {k: v * (1 + 0.2 * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}
    draft_ids = np.sort(rng.choice(cfg.vocab_size, 100, replace=False))
    embed = rng.normal(size=(cfg.vocab_size, D)).astype(np.float32)
    lm_head = embed.T[:, draft_ids]
    path = tmp_path_factory.mktemp("trained-head")
    tr.save_head(path, params, shapes, layer, draft_ids, (1, 2, 3), lm_head, cfg.vocab_size)
    return cfg, shapes, params, {"embed": embed, "lm_head": lm_head, "draft_ids": draft_ids}, path


def test_each_ttt_step_is_the_heads_draft_chain(head):
    """Step s at position p: the head's (s + 1)-th draft from the target's hidden states of positions <= p - s
    and its own outputs after, with the tokens given (torch reference over the saved tensors)."""
    from safetensors.torch import load_file

    cfg, shapes, params, frozen, path = head
    frozen = {k: frozen[k] for k in ("embed", "lm_head")}
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (1, N)).astype(np.int32)
    aux = rng.normal(size=(1, N, 3 * D)).astype(np.float32)
    logits = [np.asarray(a[0]) for a in tr.ttt_logits(params, frozen, shapes, tokens, aux, 3)]
    tensors = load_file(str(path / "model.safetensors"))
    layer = {**tr.head_shapes(cfg)[1]}
    embeds = torch.tensor(frozen["embed"])[torch.tensor(tokens[0])]
    hidden0 = torch.tensor(aux[0]) @ tensors["fc.weight"].T
    for step in range(3):
        for p in (step, N // 2, N - 1):
            base = p - step
            emb, hid = embeds[:base + 1], hidden0[:base + 1]
            normed, pre = reference_pass(tensors, layer, emb, hid)
            for j in range(1, step + 1):
                emb, hid = torch.cat([emb, embeds[base + j][None]]), torch.cat([hid, pre[-1:]])
                normed, pre = reference_pass(tensors, layer, emb, hid)
            expected = (normed[-1] @ tensors["lm_head.weight"].T).numpy()
            np.testing.assert_allclose(logits[step][p], expected, rtol=1e-4, atol=1e-4, err_msg=f"{step} {p}")


def test_a_saved_head_loads_with_its_draft_vocabulary(head):
    from jaxpage.models.eagle3 import load_head

    cfg, _, _, frozen, path = head
    loaded, params = load_head(str(path), cfg, frozen["embed"])
    assert loaded.draft_vocab_size == 100 and loaded.aux_layer_ids == (1, 2, 3)
    np.testing.assert_array_equal(np.arange(100) + params["d2t"], frozen["draft_ids"])


def test_training_lowers_the_loss(head):
    """Labels a function of the input token (what a head can learn): 40 steps lower every TTT step's loss."""
    import jax

    cfg, shapes, params, frozen, _ = head
    frozen = {k: frozen[k] for k in ("embed", "lm_head")}
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.vocab_size, (16, N)).astype(np.int32)
    aux = rng.normal(size=(16, N, 3 * D)).astype(np.float32)
    labels = (tokens * 7) % 100
    config = tr.TrainConfig(epochs=20, batch_size=8, ttt_steps=2, learning_rate=3e-3)
    before = np.asarray(jax.jit(tr.ttt_losses, static_argnums=(2, 6))(params, frozen, shapes, tokens, aux, labels, 2))
    trained = tr.train(params, frozen, shapes, (tokens, aux, labels), config, log=lambda _: None)
    after = np.asarray(jax.jit(tr.ttt_losses, static_argnums=(2, 6))(trained, frozen, shapes, tokens, aux, labels, 2))
    assert np.all(after < 0.7 * before), (before, after)



def test_sampled_answers_vary_a_repeated_question_and_repeat_with_their_seeds(monkeypatch):
    """temperature > 0: a question asked again (the split's questions repeat past its 400) gets an answer of its
    own, each drawn with its seed (the same config gives the same conversations); greedy (the default) gives one
    answer per question."""
    from jaxpage import LLM
    from jaxpage.spec_decode import chat_prompts

    questions = chat_prompts.chat_prompts("train", 2)
    monkeypatch.setattr(chat_prompts, "chat_prompts", lambda split, n, seed=0: [questions[0]] * 2 + [questions[1]] * 2)
    llm = LLM(None, max_num_seqs=4, progress=False)
    sampled = tr.TrainConfig(num_prompts=4, max_tokens=12, temperature=1.0, seed=3)
    one, two = tr.conversations(llm, sampled), tr.conversations(llm, sampled)
    assert one == two and one[0] != one[1] and one[2] != one[3]
    greedy = tr.conversations(llm, tr.TrainConfig(num_prompts=4, max_tokens=12))
    assert greedy[0] == greedy[1] and greedy[2] == greedy[3]
