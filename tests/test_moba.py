"""MoBA op: the XLA path against the dense-mask reference, and the routing against
a direct reading of docs/moba.md."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_outputs, quick_or_slow, rand_qkv, segments
from hypothesis import given, settings
from hypothesis import strategies as st

from effattn_jax.ops.dense import dense_attention
from effattn_jax.ops.moba import BlockSizes, moba_attention
from effattn_jax.ops.routing import moba_routing


def run(impl, q, k, v, segment_ids=None, **kw):
    """Jitted forward and (q, k, v) gradients of a random projection of the output."""
    f = lambda q, k, v, seg: moba_attention(q, k, v, impl=impl, segment_ids=seg, **kw)
    out = jax.jit(f)(q, k, v, segment_ids)
    w = jnp.asarray(np.random.default_rng(9).standard_normal(out.shape), out.dtype)
    loss = lambda q, k, v, seg: jnp.sum((f(q, k, v, seg) * w).astype(jnp.float32))
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, segment_ids)


CASES = {
    # name: (batch, seq, q_heads, kv_heads, head_dim, v_dim, block, top_k, segment lengths or None)
    "partial_last_block": (1, 50, 2, 2, 8, 8, 8, 3, None),
    "packed_odd_documents": (2, 50, 2, 1, 8, 8, 4, 3, [13, 20, 17]),
    "gqa_4x": (1, 40, 8, 2, 8, 8, 8, 3, None),
    "top_k_1": (1, 40, 2, 2, 8, 8, 8, 1, None),
    "top_k_covers_all": (1, 40, 2, 2, 8, 8, 8, 5, [25, 15]),
    "batch_rows_route_differently": (3, 64, 2, 2, 8, 8, 8, 2, None),
    "value_dim_differs": (1, 33, 4, 2, 8, 16, 8, 3, [7, 26]),
    "eight_row_parts_packed": (1, 100, 2, 2, 8, 8, 32, 3, [45, 55]),  # own block in 8 row parts
}

QUICK = {"top_k_1"}  # the cases `make test-fast` runs


@pytest.mark.parametrize("name", quick_or_slow(CASES, QUICK))
def test_xla_matches_reference_float32(name):
    b, s, hq, hkv, d, dv, c, k_top, lengths = CASES[name]
    q, k, v = rand_qkv(1, b, s, hq, hkv, d, dv)
    seg = None if lengths is None else segments(b, lengths)
    kw = dict(block_size=c, top_k=k_top, segment_ids=seg)
    (ro, rg), (xo, xg) = run("reference", q, k, v, **kw), run("xla", q, k, v, **kw)
    np.testing.assert_allclose(xo, ro, atol=1e-5, rtol=1e-5)
    for a, r in zip(xg, rg, strict=True):
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)
    if name == "top_k_covers_all":  # every query sees its whole past: plain causal attention
        np.testing.assert_allclose(xo, dense_attention(q, k, v, segment_ids=seg), atol=1e-5)
    if name == "batch_rows_route_differently":
        past = moba_routing(q, k, block_size=c, top_k=k_top).past_start
        assert not all(bool((past[0] == past[i]).all()) for i in range(1, b))


@pytest.mark.slow
def test_tile_and_chunk_knobs_change_the_schedule_not_the_result(monkeypatch):
    """moba.past_q_tile reaches the XLA path's tiles and moba.routing_chunk the gate's query chunks
    (small values: several tiles per block, several chunks plus a padded one)."""
    from effattn_jax.ops import moba_xla

    q_tiles = []
    schedule = moba_xla.past_tiles
    monkeypatch.setattr(
        moba_xla, "past_tiles", lambda *a, **kw: q_tiles.append(kw["q_tile"]) or schedule(*a, **kw)
    )
    q, k, v = rand_qkv(3, 2, 50, 2, 1, 8)
    kw = dict(block_size=4, top_k=3, segment_ids=segments(2, [13, 20, 17]))
    want = jax.jit(lambda q, k, v: moba_attention(q, k, v, impl="reference", **kw))(q, k, v)
    xla = lambda q, k, v: moba_attention(
        q, k, v, impl="xla", block_sizes=BlockSizes(past_q_tile=3), routing_chunk=7, **kw
    )
    got = jax.jit(xla)(q, k, v)
    assert q_tiles == [3]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    chunked, whole = (
        moba_routing(q, k, block_size=4, top_k=3, segment_ids=kw["segment_ids"], query_chunk=chunk)
        for chunk in (7, 512)
    )
    np.testing.assert_array_equal(chunked.past_start, whole.past_start)


@pytest.mark.slow
def test_xla_matches_reference_bfloat16():
    """Both paths get the same bf16 inputs (so identical routing) and accumulate in float32;
    they differ by summation order and the final rounding to bf16: one bf16 ulp (2^-8
    relative) of outputs bounded by ~4, hence atol 2e-2. Gradients pass through a few
    more bf16 roundings: 3% of their largest magnitude."""
    q, k, v = rand_qkv(2, 2, 48, 4, 2, 16, dtype=jnp.bfloat16)
    kw = dict(block_size=8, top_k=3, segment_ids=segments(2, [30, 18]))
    (ro, rg), (xo, xg) = run("reference", q, k, v, **kw), run("xla", q, k, v, **kw)
    assert xo.dtype == jnp.bfloat16
    np.testing.assert_allclose(xo.astype(np.float32), ro.astype(np.float32), atol=2e-2, rtol=1e-2)
    for a, r in zip(xg, rg, strict=True):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        assert np.abs(a - r).max() <= 3e-2 * np.abs(r).max()


def spec_routing(q, k, block_size, top_k, lengths):
    """docs/moba.md items 1-5, read literally, with Python loops (one row)."""
    s, hq, _ = q.shape
    g = hq // k.shape[1]
    selected = {}
    start = 0
    for n in lengths:
        blocks = [(start + j, min(start + j + block_size, start + n)) for j in range(0, n, block_size)]
        for t in range(start, start + n):
            own = (t - start) // block_size
            for h in range(hq):
                kbar = [k[a:e, h // g].astype(np.float32).mean(0) for a, e in blocks[:own]]
                scores = [float(np.dot(q[t, h].astype(np.float32), kb)) for kb in kbar]
                order = sorted(range(own), key=lambda j: (-scores[j], j))  # ties -> earlier block
                selected[t, h] = {blocks[j][0] for j in order[: top_k - 1]}
        start += n
    return selected


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_routing_matches_the_spec(top_k):
    lengths = [11, 29, 6]
    q, k, _ = rand_qkv(3, 1, sum(lengths), 4, 2, 8)
    r = moba_routing(q, k, block_size=5, top_k=top_k, segment_ids=segments(1, lengths))
    want = spec_routing(np.asarray(q[0]), np.asarray(k[0]), 5, top_k, lengths)
    for (t, h), blocks in want.items():
        got = {int(x) for x in r.past_start[0, t, h] if x >= 0}
        assert got == blocks, (t, h)


def test_routing_ties_go_to_the_earlier_block():
    q = jnp.ones((1, 16, 1, 4))
    k = jnp.ones((1, 16, 1, 4))  # every block scores the same
    r = moba_routing(q, k, block_size=4, top_k=2)
    assert r.past_start[0, 15, 0].tolist() == [0]  # blocks 0, 1, 2 tie: block 0 wins


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_property_random_shapes(data):
    b = data.draw(st.integers(1, 2))
    hkv = data.draw(st.integers(1, 2))
    g = data.draw(st.integers(1, 2))
    s = data.draw(st.integers(1, 70))
    c = data.draw(st.integers(1, 16))
    top_k = data.draw(st.integers(1, 6))
    lengths = []
    while sum(lengths) < s:
        lengths.append(min(data.draw(st.integers(1, 40)), s - sum(lengths)))
    q, k, v = rand_qkv(data.draw(st.integers(0, 99)), b, s, hq=hkv * g, hkv=hkv, d=4)
    f = jax.jit(moba_attention, static_argnames=("block_size", "top_k", "impl"))
    kw = dict(block_size=c, top_k=top_k, segment_ids=segments(b, lengths))
    np.testing.assert_allclose(
        f(q, k, v, impl="xla", **kw), f(q, k, v, impl="reference", **kw), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    "kw, arg",
    [
        (dict(block_size=0), "block_size"),
        (dict(top_k=0), "top_k"),
        (dict(impl="cuda"), "impl"),
    ],
)
def test_bad_arguments_name_the_argument(kw, arg):
    q, k, v = rand_qkv(0, 1, 8, 2, 2, 4)
    args = dict(block_size=4, top_k=2) | kw
    with pytest.raises(ValueError, match=arg):
        moba_attention(q, k, v, **args)


def test_bad_shapes():
    q, k, v = rand_qkv(0, 1, 8, 3, 2, 4)
    with pytest.raises(ValueError, match="kv heads"):
        moba_attention(q, k, v, block_size=4, top_k=2)
    q, k, v = rand_qkv(0, 1, 8, 2, 2, 4)
    with pytest.raises(ValueError, match="segment_ids"):
        moba_attention(q, k, v, block_size=4, top_k=2, segment_ids=jnp.ones((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="shapes do not match"):
        moba_attention(q, k[:, :6], v[:, :6], block_size=4, top_k=2)


def _largest_intermediate(fn, *args) -> int:
    """Elements of the largest array in fn's jaxpr, including scan/map bodies."""
    return int(
        max(np.prod(shape, dtype=np.int64) for shape in _array_shapes(jax.make_jaxpr(fn)(*args).jaxpr))
    )


@pytest.mark.parametrize("impl, growth", [("xla", (3, 5)), ("reference", (16, 17))])
def test_memory_grows_linearly_not_quadratically(impl, growth):
    """Forward + backward: 4x the sequence makes the largest intermediate ~4x larger for the
    XLA path (no [S, S] array anywhere), 16x for the dense-mask reference."""

    def largest(s):
        q, k, v = rand_qkv(0, 1, s, 2, 1, 8)
        seg = segments(1, [300, s - 300])
        loss = lambda q, k, v: moba_attention(
            q, k, v, block_size=64, top_k=3, segment_ids=seg, impl=impl
        ).sum()
        return _largest_intermediate(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)

    ratio = largest(4096) / largest(1024)
    assert growth[0] <= ratio <= growth[1]


@pytest.mark.parametrize("packed", [False, True])
def test_routing_holds_no_per_query_copy_of_the_block_means(packed):
    """The gate is one matmul of each query chunk against the block means: no array with the
    chunk, block and head-dim sizes together (what gathering the means per query would hold),
    and the top-k is taken per chunk: no scores of the whole sequence ([S, ..., blocks])."""
    chunk, blocks, block, d = 96, 48, 32, 24
    q, k, _ = rand_qkv(0, 1, blocks * block, 6, 2, d)
    seg = segments(1, [700, blocks * block - 700]) if packed else None
    route = lambda q, k: moba_routing(q, k, block_size=block, top_k=3, segment_ids=seg, query_chunk=chunk)
    shapes = list(_array_shapes(jax.make_jaxpr(route)(q, k).jaxpr))
    assert shapes and not [s for s in shapes if {chunk, blocks, d} <= set(s)]
    assert not [s for s in shapes if {blocks * block, blocks} <= set(s)]


def _array_shapes(jaxpr):
    """Shapes of every intermediate, sub-jaxprs (loops, maps) included."""
    return (shape for _, shape in jaxpr_outputs(jaxpr))
