"""KV-cache decoding: equal to the full forward pass for every attention kind, absorbed equal
to naive, cached generation equal to uncached generation, and the CLI on a trained run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA, tiny_overrides
from flax import nnx

from effattn_jax.config import load_config
from effattn_jax.generate import Generator, main, sample
from effattn_jax.model import Transformer, init_cache
from effattn_jax.train.loop import run

TINY = TINY_MLA + ["data.seq_len=16"]
MOBA = ["attention.core=moba", "moba.block_size=4", "moba.top_k=2"]
KINDS = {
    "mha": [],
    "gqa": ["model.num_kv_heads=2"],
    "mqa": ["model.num_kv_heads=1"],
    "mla": ["attention.kind=mla"],
    "mla_q_lora": ["attention.kind=mla", "mla.q_lora_rank=12"],
    "eg_mla_heads": ["attention.kind=eg_mla"],
    "eg_mla_latent": ["attention.kind=eg_mla", "eg_mla.gate_at=latent"],
    "eg_mla_projected": ["attention.kind=eg_mla", "eg_mla.gate_at=projected", "eg_mla.projected_dim=12"],
    "mha_moba": MOBA,
    "mla_moba": ["attention.kind=mla"] + MOBA,
    "gqa_qkv_bias_qk_norm": ["model.num_kv_heads=2", "model.qkv_bias=true", "model.qk_norm=true"],
    "mla_yarn": ["attention.kind=mla", "model.rope_scaling=yarn", "model.rope_scaling_factor=4"]
    + ["model.rope_original_max_positions=8", "model.rope_mscale_all_dim=0.8"],
}


def model_for(name):
    return Transformer(load_config(None, TINY + KINDS[name]), rngs=nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
def test_decode_equals_full_forward(name):
    model = model_for(name)
    graphdef, params = nnx.split(model)
    decode = jax.jit(
        lambda p, t, pos, c, absorb, prefill: nnx.merge(graphdef, p).decode(
            t, pos, c, absorb=absorb, prefill=prefill
        ),
        static_argnames=("absorb", "prefill"),
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 14)))
    full = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
    # absorbed (where the kind allows it) and naive; a prompt through the prefill path or as
    # a plain multi-token step
    for absorb, prefill in ((True, True), (False, False)):
        caches = init_cache(model, 2, 16)
        first = jnp.broadcast_to(jnp.arange(6), (2, 6))
        logits, caches = decode(params, tokens[:, :6], first, caches, absorb=absorb, prefill=prefill)
        steps = [logits]
        for t in range(6, 14):
            logits, caches = decode(params, tokens[:, t : t + 1], jnp.full((2, 1), t), caches, absorb, False)
            steps.append(logits)
        np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-4, rtol=1e-4)
    if name == "mha_moba":  # the routing is really sparse here, so this is not dense attention
        assert float(jnp.abs(full - model_for("mha")(tokens)).max()) > 1e-3


def uncached_greedy(model, prompt, n, width=16):
    """Greedy decoding by re-running the full forward pass on the whole sequence each step
    (right-padded to one width: causal, so the padding changes nothing before it)."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    seq = list(prompt)
    for _ in range(n):
        logits = forward(params, jnp.asarray([seq + [0] * (width - len(seq))]))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt) :]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gqa", "eg_mla_latent", "mha_moba"])
def test_cached_generation_equals_uncached(name):
    model = model_for(name)
    prompts = [[5, 17, 3], [9, 1, 2, 60, 7, 7, 100], [42]]  # different lengths in one batch
    got = Generator(model).generate(prompts, 8)
    assert got == [uncached_greedy(model, p, 8) for p in prompts]


@pytest.mark.parametrize("kind, copies", [("eg_mla", 1), ("mla", 0), ("mha", 0)])
def test_token_ids_cached_once_per_model(kind, copies):
    """EG-MLA's layers all read the same cached token ids: one [B, L] array for the model
    (decoding through it: test_decode_equals_full_forward)."""
    cfg = load_config(None, TINY_MLA + [f"attention.kind={kind}"])
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    caches = jax.eval_shape(lambda: init_cache(model, 2, 16))
    assert cfg.model.num_layers > 1
    assert [name for c in caches for name in c if name == "token_ids"] == ["token_ids"] * copies


def test_generation_is_one_donated_program_per_token(caplog):
    """After a first call compiled everything, generating 6 tokens runs the prefill and 5 calls of one
    jitted step (model step and sampling together), compiles nothing, moves nothing between host and
    device implicitly (transfer guard), and each step takes the cache donated (its buffers are gone
    after the call, and the compiled step copies no cache-sized array). Catches: sampling or position
    updates run eagerly per token, a token read back to the host inside the loop, a cache copied each
    step, a step recompiled per token."""
    model = model_for("gqa")
    gen = Generator(model)
    prompts = [[5, 17, 3], [9, 1]]
    first = gen.generate(prompts, 6, temperature=1.0, seed=3)
    step = gen.compiled_step(2, 16)  # the public API eval reads, before the step is wrapped below
    calls = []
    for name in ("_step", "_checked_step"):
        fn = getattr(gen, name)
        setattr(gen, name, lambda *a, fn=fn, **kw: calls.append(1) or fn(*a, **kw))
    with jax.log_compiles(), caplog.at_level("WARNING"), jax.transfer_guard("disallow"):
        again = gen.generate(prompts, 6, temperature=1.0, seed=3)
    assert again == first and len(calls) == 5
    assert not [r for r in caplog.records if "ompil" in r.getMessage()], caplog.text
    caches = gen.empty_caches(2, 16)
    hlo = step.as_text()
    cache_shape = ",".join(map(str, jax.tree.leaves(caches)[0].shape))
    assert cache_shape in hlo and not [x for x in hlo.splitlines() if " copy(" in x and cache_shape in x]
    tokens, pos = jnp.zeros(2, jnp.int32), jnp.full(2, 3, jnp.int32)
    step(gen.params, tokens, pos, caches, jax.random.key(0))
    assert all(x.is_deleted() for x in jax.tree.leaves(caches))


def test_sampling():
    logits = jnp.log(jnp.asarray([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]]))
    key = jax.random.key(0)
    assert sample(logits, key).tolist() == [0, 2]
    assert sample(logits, key, temperature=1.0, top_p=0.5).tolist() == [0, 2]  # nucleus holds one token
    draws = {int(sample(logits, k, temperature=1.0)[0]) for k in jax.random.split(key, 64)}
    assert draws == {0, 1, 2}


@pytest.mark.slow
def test_cli_on_a_trained_run(tmp_path, corpus_dir, capsys):
    run(load_config(None, tiny_overrides(corpus_dir, tmp_path / "run", **{"train.steps": 2})))
    capsys.readouterr()
    assert (
        main(
            [
                "--run",
                str(tmp_path / "run"),
                "--prompt",
                "the of",
                "--prompt",
                "and",
                "--max-new-tokens",
                "3",
                "--temperature",
                "0.7",
                "--top-p",
                "0.9",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.split("---\n")
    assert out[0].startswith("the of") and out[1].startswith("and")
    # bad input: one line naming the argument, exit 2 (the tiny run's context is data.seq_len=32)
    for argv, needle in (
        (["--prompt", ""], "--prompt: an empty prompt"),
        (["--prompt", "and", "--max-new-tokens", "-5"], "--max-new-tokens: '-5': must be a positive integer"),
        (["--prompt", "and", "--max-new-tokens", "40"], "must fit the model's context of 32 tokens"),
        (["--prompt", "and", "--top-p", "0"], "--top-p: '0': must be a number in (0, 1]"),
        (["--prompt", "and", "--temperature", "-1"], "--temperature: '-1': must be a number >= 0"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["--run", str(tmp_path / "run"), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and needle in err[0], err
        assert err[0].startswith("python -m effattn_jax.generate: error: "), err  # not generate.py
    assert main(["--run", str(tmp_path / "nonexistent"), "--prompt", "a"]) == 2
    assert "not a run directory" in capsys.readouterr().err
