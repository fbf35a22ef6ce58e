"""MLA and EG-MLA modules against the equations of docs/mla.md and docs/eg_mla.md, written out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MLA
from flax import nnx

from effattn_jax.config import load_config
from effattn_jax.layers import apply_rope
from effattn_jax.model import Transformer, param_counts
from effattn_jax.ops.dense import causal_segment_mask, masked_attention
from effattn_jax.ops.segments import segment_positions

TINY = TINY_MLA
VARIANTS = {
    "mla": ["attention.kind=mla"],
    "mla_q_lora": ["attention.kind=mla", "mla.q_lora_rank=12"],
    "eg_mla_heads": ["attention.kind=eg_mla"],
    "eg_mla_latent": ["attention.kind=eg_mla", "eg_mla.gate_at=latent"],
    "eg_mla_projected": ["attention.kind=eg_mla", "eg_mla.gate_at=projected", "eg_mla.projected_dim=12"],
}


def rms(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def ln(x, scale, bias, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def by_hand(attn, x, tokens, seg, kind, gate_at, q_lora):
    """One attention layer from its weights, following docs/mla.md and docs/eg_mla.md literally."""
    W = lambda mod: mod.kernel[...]
    pos = segment_positions(seg)
    c = rms(jnp.einsum("bsd,dc->bsc", x, W(attn.dkv)), attn.kv_norm.scale[...])
    kr = apply_rope(jnp.einsum("bsd,dr->bsr", x, W(attn.kr))[:, :, None], pos, 10000.0)
    qin = rms(jnp.einsum("bsd,dq->bsq", x, W(attn.dq)), attn.q_norm.scale[...]) if q_lora else x
    q = jnp.einsum("bsq,qhe->bshe", qin, W(attn.q))
    q = jnp.concatenate([q[..., :8], apply_rope(q[..., 8:], pos, 10000.0)], -1)
    if kind == "mla":
        k_nope, v = jnp.einsum("bsc,che->bshe", c, W(attn.uk)), jnp.einsum("bsc,che->bshe", c, W(attn.uv))
    elif gate_at == "heads":
        e = attn.gate_table[...][tokens]
        gk, gv = jnp.einsum("bsg,ghe->bshe", e, W(attn.gk)), jnp.einsum("bsg,ghe->bshe", e, W(attn.gv))
        k_nope = ln(
            jnp.einsum("bsc,che->bshe", c, W(attn.uk)) * gk, attn.k_ln.scale[...], attn.k_ln.bias[...]
        )
        v = ln(jnp.einsum("bsc,che->bshe", c, W(attn.uv)) * gv, attn.v_ln.scale[...], attn.v_ln.bias[...])
    else:
        gate = attn.gate_table[...][tokens]  # E[x]; projected: W_G E[x]
        gate = jnp.einsum("bse,eg->bsg", gate, W(attn.g)) if gate_at == "projected" else gate
        ct = ln(
            jnp.einsum("bsc,cg->bsg", c, W(attn.u)) * gate,
            attn.c_ln.scale[...],
            attn.c_ln.bias[...],
        )
        k_nope, v = jnp.einsum("bsg,ghe->bshe", ct, W(attn.uk)), jnp.einsum("bsg,ghe->bshe", ct, W(attn.uv))
    k = jnp.concatenate([k_nope, jnp.broadcast_to(kr, k_nope.shape[:3] + (4,))], -1)
    out = masked_attention(
        q, k, v, causal_segment_mask(seg, 12, 12), 1 / np.sqrt(8 + 4)
    )  # scale: nope + rope
    return jnp.einsum("bshe,hed->bsd", out, W(attn.o))


@pytest.mark.parametrize("name", VARIANTS)
def test_layer_follows_the_equations(name):
    cfg = load_config(None, TINY + VARIANTS[name])
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    attn = model.blocks[0].attn
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 12, 32)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 12)))
    seg = jnp.asarray([[1] * 5 + [2] * 7, [1] * 12])
    got = attn(x, positions=segment_positions(seg), segment_ids=seg, token_ids=tokens)
    want = by_hand(attn, x, tokens, seg, cfg.attention.kind, cfg.eg_mla.gate_at, cfg.mla.q_lora_rank > 0)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_documents_and_core_switch(name):
    cfg = load_config(None, TINY + VARIANTS[name])
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 128, 5), rng.integers(0, 128, 7)
    packed = model(jnp.asarray(np.concatenate([a, b])[None]), jnp.asarray([[1] * 5 + [2] * 7]))
    np.testing.assert_allclose(packed[0, 5:], model(jnp.asarray(b[None]))[0], atol=1e-5)
    moba = load_config(
        None, TINY + VARIANTS[name] + ["attention.core=moba", "moba.block_size=4", "data.seq_len=16"]
    )
    paths = lambda c: [
        (p, v.shape) for p, v in nnx.to_flat_state(nnx.state(Transformer(c, rngs=nnx.Rngs(0)), nnx.Param))
    ]
    assert paths(moba) == paths(cfg)


def test_a_projected_gate_folds_into_one_table_for_decoding():
    """gate_at=projected: E W_G folded into a [vocab, d_g] table gives the same decode steps, and
    the table's width is d_g whatever d_e is, also for stacked layers (unstacked first); W_G
    counts as a non-embedding matmul."""
    from effattn_jax.model import init_cache, ready_for_decoding

    counts = {}
    for d_e, scan in ((8, False), (32, True)):
        extra = [f"eg_mla.gate_dim={d_e}", f"model.scan_layers={str(scan).lower()}"]
        cfg = load_config(None, TINY + VARIANTS["eg_mla_projected"] + extra)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        counts[d_e] = param_counts(model)
        tokens = jnp.asarray(np.random.default_rng(2).integers(0, 128, (2, 9)))
        positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
        plain, _ = model.decode(tokens, positions, init_cache(model, 2, 16), prefill=True)
        ready_for_decoding(model)
        assert model.blocks[0].attn.folded_gate[...].shape == (128, 12)
        folded, _ = model.decode(tokens, positions, init_cache(model, 2, 16), prefill=True)
        np.testing.assert_allclose(folded, plain, atol=1e-5, rtol=1e-5)
    assert counts[32]["embedding_gate"] - counts[8]["embedding_gate"] == 2 * 128 * 24  # the tables
    assert counts[32]["non_embedding"] - counts[8]["non_embedding"] == 2 * 24 * 12  # W_G [d_e, d_g]


def test_gate_tables_are_counted_apart():
    cfg = load_config(None, TINY + VARIANTS["eg_mla_heads"])
    counts = param_counts(Transformer(cfg, rngs=nnx.Rngs(0)))
    assert counts["embedding_gate"] == 2 * 128 * 8  # layers x vocab x d_e
    assert counts["total"] == counts["embedding"] + counts["embedding_gate"] + counts["non_embedding"]


TABLE = ["attention.kind=mla", "mla.token_table_dim=8"]  # matched to VARIANTS' EG-MLA tables (d_e 8)


def test_token_table_is_counted_like_eg_mlas_gate_tables_plus_its_projection():
    """mla.token_table_dim=d_e: the same [vocab, d_e] table per layer as EG-MLA's gate (counted
    apart, as token_table), plus W_l [d_e, d_model] per layer among the non-embedding params."""
    counts = lambda extra: param_counts(Transformer(load_config(None, TINY + extra), rngs=nnx.Rngs(0)))
    table, mla, eg = counts(TABLE), counts(VARIANTS["mla"]), counts(VARIANTS["eg_mla_latent"])
    cfg = load_config(None, TINY + TABLE)
    projection = cfg.model.num_layers * 8 * cfg.model.d_model
    assert table["token_table"] == eg["embedding_gate"] == cfg.model.num_layers * 128 * 8
    assert table["total"] - mla["total"] == eg["embedding_gate"] + projection
    assert table["non_embedding"] - mla["non_embedding"] == projection
    assert table["total"] == sum(
        table[k] for k in ("embedding", "embedding_gate", "token_table", "non_embedding")
    )
    from eval.decoding import kv_cache_report

    kv = lambda extra: kv_cache_report(load_config(None, TINY + extra))
    assert kv(TABLE)["kv_elements_per_token"] == kv(VARIANTS["mla"])["kv_elements_per_token"]  # MLA's cache
    assert kv(TABLE)["params_token_table"] == table["token_table"]


@pytest.mark.parametrize("scan", [False, True])
def test_token_table_acts_only_through_the_residual(scan):
    """A zero table gives plain MLA bit for bit; a nonzero one is h + W_l E_l[x] at each layer's
    input, written out here for one layer."""
    extra = [f"model.scan_layers={str(scan).lower()}"]
    plain = Transformer(load_config(None, TINY + VARIANTS["mla"] + extra), rngs=nnx.Rngs(0))
    model = Transformer(load_config(None, TINY + TABLE + extra), rngs=nnx.Rngs(1))
    nnx.update(model, nnx.state(plain, nnx.Param))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 9)))
    tables = [block.attn.token_table.token_table for block in model.blocks]  # stacked: one
    assert not np.allclose(model(tokens), plain(tokens), atol=1e-3)
    for table in tables:
        table[...] = jnp.zeros_like(table[...])
    np.testing.assert_array_equal(model(tokens), plain(tokens))

    if not scan:  # one layer by hand: block(h + W E[x]) with the table back
        table = tables[0]
        table[...] = jax.random.normal(jax.random.key(3), table[...].shape)
        block = model.blocks[0]
        x = jax.random.normal(jax.random.key(4), (2, 9, 32))
        seg = jnp.ones((2, 9), jnp.int32)
        pos = segment_positions(seg)
        h = x + jnp.einsum("bse,ed->bsd", table[...][tokens], block.attn.token_table.proj.kernel[...])
        h = h + block.attn(block.attn_norm(h), positions=pos, segment_ids=seg, token_ids=tokens)
        want = h + block.mlp(block.mlp_norm(h))
        np.testing.assert_allclose(block(x, pos, seg, tokens), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("absorb", "scan"), [(True, False), (False, False), (True, True)])
def test_token_table_decode_step_is_the_full_forwards_last_position(absorb, scan):
    """Prefill all but the last token, then one decode step: its logits are the full forward's
    at the last position (the table reads only the step's own token; the cache stays MLA's), also
    for stacked layers readied for decoding as generation and the decode benchmarks do."""
    from effattn_jax.model import init_cache, ready_for_decoding

    cfg = load_config(None, TINY + TABLE + [f"model.scan_layers={str(scan).lower()}"])
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 9)))
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    full = model(tokens)
    ready_for_decoding(model)
    cache = init_cache(model, 2, 16)
    assert set(cache[0]) == {"c", "kr"}  # MLA's cache, nothing for the table
    _, cache = model.decode(tokens[:, :8], positions[:, :8], cache, prefill=True, absorb=absorb)
    step, _ = model.decode(tokens[:, 8:], positions[:, 8:], cache, absorb=absorb)
    np.testing.assert_allclose(step[:, 0], full[:, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "extra",
    [["attention.kind=eg_mla", "mla.token_table_dim=8"], ["attention.kind=mha", "mla.token_table_dim=8"]],
)
def test_token_table_only_on_mla_layers(extra):
    from effattn_jax.config import ConfigError

    with pytest.raises(ConfigError, match="mla.token_table_dim"):
        load_config(None, TINY + extra)


def test_token_table_trains_the_rows_it_reads():
    """The loss's gradient reaches W_l and exactly the table rows of the tokens whose positions
    feed a prediction (the last token, 9, predicts nothing here and no later position sees it)."""
    model = Transformer(load_config(None, TINY + TABLE), rngs=nnx.Rngs(0))
    tokens = jnp.asarray([[3, 5, 7, 5, 9]])
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens)
        return -jax.nn.log_softmax(logits[:, :-1])[0, jnp.arange(4), tokens[0, 1:]].mean()

    grads = jax.grad(loss)(params)
    for block in grads["blocks"].values():
        g = np.asarray(block["attn"]["token_table"]["token_table"][...])
        assert sorted(np.flatnonzero(np.abs(g).sum(-1))) == [3, 5, 7]
        assert np.abs(block["attn"]["token_table"]["proj"]["kernel"][...]).sum() > 0
