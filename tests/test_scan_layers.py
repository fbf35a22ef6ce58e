"""`model.scan_layers`: stacked layers run by a scan give what the per-layer loop gives
(forward, gradients, decoding), grouped by kind so a MoBA -> dense switch keeps the tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL
from flax import nnx

from effattn_jax.config import load_config
from effattn_jax.model import Transformer, init_cache, layer_groups, ready_for_decoding
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import loss_sums, make_train_step

# layers: mha:moba, mha:moba, mha:dense (one kind, two core runs), mla:dense
MIXED = TINY_MODEL + [
    "model.num_layers=4",
    "attention.layers=[mha:moba, mha:moba, mha:dense, mla:dense]",
    "moba.block_size=4",
    "moba.top_k=2",
    "mla.kv_lora_rank=16",
    "mla.qk_nope_head_dim=8",
    "mla.qk_rope_head_dim=4",
    "mla.v_head_dim=8",
]


def test_groups_follow_kinds_and_cores():
    cfg = load_config(None, MIXED)
    assert layer_groups(cfg) == [(0, 3, [(0, 2), (2, 1)]), (3, 1, [(0, 1)])]
    switched = [(start, n) for start, n, _ in layer_groups(cfg.with_full_attention())]
    assert switched == [(0, 3), (3, 1)]  # the same stacks: the same parameter tree


def stacked_like(loop: Transformer, scanned: Transformer) -> Transformer:
    """The scanned model carrying the loop model's parameters."""
    for g, (start, n, _) in enumerate(layer_groups(CFG)):
        layers = [nnx.state(loop.blocks[start + i]) for i in range(n)]
        nnx.update(scanned.blocks[g], jax.tree.map(lambda *a: jnp.stack(a), *layers))
    nnx.update(scanned.final_norm, nnx.state(loop.final_norm))
    scanned.embed[...] = loop.embed[...]
    return scanned


CFG = load_config(None, MIXED)


def models():
    loop = Transformer(CFG, rngs=nnx.Rngs(0))
    scanned_cfg = load_config(None, MIXED + ["model.scan_layers=true", "model.remat=true"])
    return loop, stacked_like(loop, Transformer(scanned_cfg, rngs=nnx.Rngs(1)))


@pytest.mark.slow
def test_forward_gradients_and_decoding_match_the_loop():
    loop, scanned = models()
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 16)), jnp.int32)
    segments = jnp.asarray([[1] * 9 + [2] * 7, [1] * 16])
    batch = {
        "inputs": tokens,
        "targets": jnp.roll(tokens, -1, 1),
        "segment_ids": segments,
        "loss_mask": jnp.ones((2, 16)),
    }

    def run(model):
        """(logits, gradients of the loss, decoded logits of row 1), jitted."""
        graphdef, params = nnx.split(model)

        def f(params):
            m = nnx.merge(graphdef, params)
            grads = jax.grad(lambda p: loss_sums(nnx.merge(graphdef, p), batch)[0])(params)
            # decoding walks the layers one by one (views of the stacks when scanned)
            decoded = m.decode(tokens[1:], jnp.arange(16)[None], init_cache(m, 1, 16), prefill=True)[0]
            return m(tokens, segments), grads, decoded

        return jax.jit(f)(params)

    (logits, g_loop, dec_loop), (logits_scan, g_scan, dec_scan) = run(loop), run(scanned)
    np.testing.assert_allclose(logits_scan, logits, atol=1e-5)
    np.testing.assert_allclose(dec_scan, dec_loop, atol=1e-5)
    for i in range(3):  # the first stack: layers 0-2
        for a, b in zip(
            jax.tree.leaves(g_loop["blocks"][i]), jax.tree.leaves(g_scan["blocks"][0]), strict=True
        ):
            np.testing.assert_allclose(b[i], a, atol=1e-5)
    np.testing.assert_allclose(g_scan["embed"][...], g_loop["embed"][...], atol=1e-5)


@pytest.mark.slow
def test_a_sharded_train_step_equals_one_device():
    """Stacked parameters get a leading unsharded axis in their shardings (fsdp and tensor), and a
    train step on a (2, 2, 2) mesh gives the loss and parameters of the same step on one device."""
    cfg = load_config(None, TINY_MODEL + ["model.scan_layers=true", "data.batch_size=4", "data.seq_len=16"])
    sharded = make_setup(cfg, make_mesh(2, 2, 2))
    spec = sharded.state_shardings["params"]["blocks"][0]["mlp"]["up"]["kernel"].spec
    assert spec[0] is None and "fsdp" in jax.tree.leaves(tuple(spec))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, (4, 16)).astype(np.int32)
    batch = {
        "inputs": tokens,
        "targets": tokens,
        "segment_ids": np.ones_like(tokens),
        "loss_mask": np.ones((4, 16), np.float32),
    }
    results = []
    for setup in (sharded, make_setup(cfg, make_mesh(1, 1, 1))):
        state = init_state(setup)
        results.append(make_train_step(setup)(state, jax.device_put(batch, setup.batch_sharding())))
    (state_8, metrics_8), (state_1, metrics_1) = results
    assert float(metrics_8["loss"]) == pytest.approx(float(metrics_1["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(state_8["params"]), jax.tree.leaves(state_1["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_ready_for_decoding_unstacks_the_layers_once():
    """Decoding a scanned model slices its layers out of the stacks once (not at every step):
    one Block per layer after, decoding and the forward pass unchanged."""
    loop, scanned = models()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (1, 16)), jnp.int32)
    positions = jnp.arange(16)[None]
    before = scanned.decode(tokens, positions, init_cache(scanned, 1, 16), prefill=True)[0]
    ready_for_decoding(scanned)
    assert not scanned.scan_layers and len(scanned.blocks) == 4
    after = scanned.decode(tokens, positions, init_cache(scanned, 1, 16), prefill=True)[0]
    np.testing.assert_allclose(after, before, atol=1e-5)
    np.testing.assert_allclose(scanned(tokens), loop(tokens), atol=1e-5)
