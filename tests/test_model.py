import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL
from flax import nnx

from effattn_jax.attention.eg_mla import EGMLA
from effattn_jax.attention.mha import MHA
from effattn_jax.attention.mla import MLA
from effattn_jax.config import load_config
from effattn_jax.flops import mean_attended_keys, peak_flops, train_flops_per_token
from effattn_jax.model import Transformer, param_counts
from effattn_jax.ops.moba import moba_reference_mask
from effattn_jax.ops.routing import moba_routing
from effattn_jax.ops.segments import segment_positions

TINY = TINY_MODEL


def make(*over):
    cfg = load_config(None, TINY + list(over))
    return cfg, Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kv", [4, 2, 1])  # MHA, GQA, MQA
def test_shapes_and_kv_heads(kv):
    cfg, m = make(f"model.num_kv_heads={kv}")
    logits = m(jnp.zeros((2, 12), jnp.int32))
    assert logits.shape == (2, 12, 128) and logits.dtype == jnp.float32
    assert m.blocks[0].attn.k.kernel.shape == (32, kv, 8)


def test_tied_vs_untied_and_counts():
    _, tied = make()
    _, untied = make("model.tie_embeddings=false")
    ct, cu = param_counts(tied), param_counts(untied)
    assert cu["embedding"] == 2 * ct["embedding"] == 2 * 128 * 32
    assert ct["non_embedding"] == cu["non_embedding"]


def test_segment_positions_restart():
    seg = jnp.array([[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


@pytest.mark.slow
def test_packed_documents_do_not_see_each_other():
    """A document packed after another gives the same logits as the document alone,
    so there is no attention across documents and RoPE restarts per document."""
    _, m = make("model.num_kv_heads=2")
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 128, 5), rng.integers(0, 128, 7)
    packed = m(jnp.asarray(np.concatenate([a, b])[None]), jnp.asarray([[1] * 5 + [2] * 7]))
    alone = m(jnp.asarray(b[None]))
    np.testing.assert_allclose(packed[0, 5:], alone[0], atol=1e-5)
    # and it is causal: changing a later token leaves earlier logits alone
    b2 = b.copy()
    b2[-1] = (b2[-1] + 1) % 128
    np.testing.assert_allclose(m(jnp.asarray(b2[None]))[0, :-1], alone[0, :-1], atol=1e-6)


def test_per_layer_specs():
    """`last_layers` and `layers` pick each layer's (kind, core), and the model builds exactly those."""
    moba = ["moba.block_size=8"]
    cfg = load_config(
        None,
        TINY
        + moba
        + ["model.num_layers=3", "attention.last_layers.n=1"]
        + ["attention.last_layers.kind=mla", "attention.last_layers.core=moba"],
    )
    assert [cfg.layer_spec(i) for i in range(3)] == [("mha", "dense"), ("mha", "dense"), ("mla", "moba")]
    assert built_layers(cfg) == [(MHA, True), (MHA, True), (MLA, False)]
    cfg = load_config(
        None, TINY + moba + ["attention.core=moba", "attention.layers=[eg_mla:moba, mla:dense]"]
    )
    assert [cfg.layer_spec(i) for i in range(2)] == [("eg_mla", "moba"), ("mla", "dense")]
    assert built_layers(cfg) == [(EGMLA, False), (MLA, True)]


def built_layers(cfg):
    """(attention class, dense core?) of each block of the model the config builds."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    return [(type(b.attn), b.attn.core.causal_only) for b in model.blocks]


def test_bf16_matches_float32():
    _, m = make()
    _, mb = make("model.dtype=bfloat16")
    x = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 16)))
    np.testing.assert_allclose(mb(x), m(x), atol=0.05)  # bf16 matmuls on ~unit logits


@pytest.mark.slow
@pytest.mark.parametrize("core", ["dense", "moba"])
def test_remat_gives_the_same_gradients(core):
    """Remat recomputes each block's activations in the backward (keeping only MoBA's schedule):
    the gradients must be those of the plain model. Catches a recompute that differs from the
    forward (e.g. a policy that saves the wrong names, or a layer missed by the remat wrapper)."""
    x = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 16)))
    over = [f"attention.core={core}", "moba.block_size=4", "moba.top_k=2"]
    grads = []
    for remat in ("false", "true"):
        _, m = make(*over, f"model.remat={remat}")
        graphdef, params = nnx.split(m)
        grads.append(jax.grad(lambda p, g=graphdef: nnx.merge(g, p)(x).astype(jnp.float32).var())(params))
    assert "remat" in str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(x).sum())(params))  # remat ran
    for plain, rematted in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(rematted, plain, rtol=1e-5, atol=1e-6)


def test_mean_attended_keys():
    assert mean_attended_keys(4, "dense") == 2.5
    # block 2, top_k 2: positions 0..5 see 1, 2, 1+2, 2+2, 1+2, 2+2 keys
    assert mean_attended_keys(6, "moba", 2, 2) == pytest.approx(17 / 6)
    # MoBA with top_k covering every block is dense
    assert mean_attended_keys(64, "moba", 8, 8) == mean_attended_keys(64, "dense")
    assert mean_attended_keys(6, "dsa", top_k=2) == pytest.approx((1 + 2 * 5) / 6)
    assert mean_attended_keys(64, "dsa", top_k=64) == mean_attended_keys(64, "dense")


def counted_attention_flops(cfg, seq_len):
    """Training FLOPs per token of the attention matmuls, counted from what each layer's core
    really receives: 3 (fwd + bwd) * 2 * (q/k width + v width) * heads * attended pairs / S,
    with the pairs summed from the dense causal mask or MoBA's reference mask of a routing.
    The model is traced abstractly (shapes only); the masks are built at those shapes."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    seen = []  # (q shape, v width, MoBA?) per layer

    def recording(core, is_moba):
        def attend(q, k, v, *, segment_ids, scale=None, kv_whole=False):
            seen.append((q.shape, v.shape[-1], is_moba))
            return core.attend(q, k, v, segment_ids=segment_ids, scale=scale, kv_whole=kv_whole)

        return dataclasses.replace(core, attend=attend)

    for i, block in enumerate(model.blocks):
        block.attn.core = recording(block.attn.core, cfg.layer_spec(i)[1] == "moba")
    jax.eval_shape(model, jnp.zeros((1, seq_len), jnp.int32))
    total = 0.0
    for (b, s, h, d_qk), d_v, is_moba in seen:
        if is_moba:
            q = jax.random.normal(jax.random.key(0), (b, s, h, d_qk))
            routing = moba_routing(q, q, block_size=cfg.moba.block_size, top_k=cfg.moba.top_k)
            pairs = float(moba_reference_mask(routing, block_size=cfg.moba.block_size).sum()) / h
        else:
            pairs = float(np.tril(np.ones((s, s))).sum())
        total += 3 * 2 * (d_qk + d_v) * h * pairs / s
    return total, param_counts(model)


@pytest.mark.parametrize("kind", ["mha", "mla", "eg_mla"])
def test_flops_match_an_independent_count(kind):
    """`train_flops_per_token` against FLOPs counted from the tensors each layer's attention really
    gets (MLA's q/k width is nope + rope and its v width differs), on a MoBA/dense layer hybrid and
    after the MoBA -> dense switch."""
    seq = 16
    cfg = load_config(
        None,
        TINY
        + [f"attention.kind={kind}", f"data.seq_len={seq}", "attention.core=moba", "moba.block_size=4"]
        + ["moba.top_k=2", "attention.last_layers.n=1", "attention.last_layers.core=dense"],
    )
    for config in (cfg, cfg.with_full_attention()):
        attention, counts = counted_attention_flops(config, seq)
        matmuls = 6 * (counts["non_embedding"] + 32 * 128)  # every non-embedding weight, plus the tied head
        got = train_flops_per_token(config, counts["non_embedding"])
        assert got == pytest.approx(matmuls + attention, rel=1e-9)
    assert train_flops_per_token(cfg, 0) < train_flops_per_token(cfg.with_full_attention(), 0)


def test_mfu_peak_by_device_kind():
    """MFU's denominator: H100/H200 SXM 989 TFLOP/s bf16, the PCIe H100 its own, nothing for a CPU (no MFU
    logged). Catches: the PCIe card matched by the plain H100 entry."""
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("TPU v5 lite") == 197e12 and peak_flops("TPU v5") == 459e12
    assert peak_flops("cpu") is None
