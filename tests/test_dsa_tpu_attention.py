"""DSA's sparse attention on TPU (pallas_kernels/dsa/tpu_attention.py, and tpu_latent_attention.py
for one KV head): interpreted, it equals the XLA path (`sparse_attention`) in output and gradients
on random selections; it compiles for a TPU, alone at V3.2's widths (per head and absorbed) and per
shard under a mesh of TPU chips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_attention_over_selection, random_selection, v5e_arg
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels.dsa.tpu_attention as tpu_attention
from effattn_jax.config import load_config
from effattn_jax.ops.cache import CacheView
from effattn_jax.ops.dsa import dsa_decode_attention, dsa_sparse_attention
from effattn_jax.ops.platform import tracing_for
from effattn_jax.sharding import make_mesh, sharding_rules
from pallas_kernels.dsa.tpu_attention import chunk_size, sparse_attention_tpu
from pallas_kernels.registry import kernel


@pytest.mark.parametrize(
    "heads, kv_heads, d, dv, picks, interpret",
    [
        (4, 2, 12, 10, 7, True),  # GQA, widths off the lanes' 128, one chunk
        (2, 2, 16, 16, 20, True),  # MHA (MLA's per-head form), three chunks, the last part unused
        (4, 1, 8, 8, 11, True),  # one KV head for all
        (4, 2, 12, 10, 13, "tpu"),  # the TPU interpreter: its DMAs, semaphores and aliased buffers
    ],
)
def test_interpreted_kernel_equals_the_xla_path(monkeypatch, heads, kv_heads, d, dv, picks, interpret):
    """Output and dq, dk, dv (float32), chunks of 8 picks. Catches: a pick's slab from another
    batch row or chunk slot, a query head paired with another group's KV head, an unused pick
    attended or written back over row 0, a chunk's dK/dV rows lost to the next chunk's read (a
    read-add-write out of order), dq kept across queries."""
    monkeypatch.setattr(tpu_attention, "MAX_CHUNK", 8)
    rng = np.random.default_rng(picks)
    b, t, s = 2, 5, 32
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, t, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, dv))
    )
    idx, w = random_selection(rng, b, t, s, picks), jnp.asarray(rng.standard_normal((b, t, heads, dv)))
    run = lambda q, k, v, idx, scale: sparse_attention_tpu(q, k, v, idx, scale=scale, interpret=interpret)
    assert_attention_over_selection(run, q, k, v, idx, w)
    assert kernel("dsa", "attention", "tpu") is sparse_attention_tpu


@pytest.mark.parametrize(
    "seq, picks, dtype, interpret",
    [
        (300, 140, jnp.float32, True),  # two chunks of 128 picks
        (41, 9, jnp.bfloat16, "tpu"),  # row pairs: an odd length, picks on its last rows
    ],
)
def test_one_kv_head_runs_on_the_mxu_kernel(seq, picks, dtype, interpret):
    """One KV head (dsa.absorb's form) goes to tpu_latent_attention.py: output and dq, dk, dv equal
    the XLA path's (float32 there). Catches: the other row of a bf16 pair attended or written back,
    the last pair of an odd length read past the end, a pick's dK row added at its pair partner."""
    rng = np.random.default_rng(seq)
    b, t, h, d, dv = 2, 3, 8, 24, 16
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in ((b, t, h, d), (b, seq, 1, d), (b, seq, 1, dv))
    )
    # the last two rows picked once (the rest drawn from below them: a query's picks are distinct)
    idx = random_selection(rng, b, t, seq - 2, picks).at[0, 1, :2].set(jnp.asarray([seq - 1, seq - 2]))
    w = jnp.asarray(rng.standard_normal((b, t, h, dv)))
    run = lambda q, k, v, idx, scale: sparse_attention_tpu(q, k, v, idx, scale=scale, interpret=interpret)
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    assert_attention_over_selection(run, q, k, v, idx, w, tol=tol, out_atol=tol)


def test_chunk_size_keeps_a_chunk_within_its_budget():
    """V3.2's per-head 128 x (192 + 128) gets the smallest chunk; narrow heads the largest."""
    assert chunk_size(128, 192, 128) == 8
    assert chunk_size(16, 192, 128) == 32  # the paper config's 16 heads
    assert chunk_size(2, 12, 10) == 128


def _compile(step, *args):
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        lowered = step.lower(*args)
        assert lowered.as_text().count("tpu_custom_call") == 2  # the forward and the backward
        lowered.compile()


@pytest.mark.slow
@pytest.mark.parametrize(
    "heads, kv_heads, d, dv, seq, picks, dtype",
    [
        (128, 128, 192, 128, 4096, 2048, jnp.bfloat16),  # V3.2's per-head MLA widths
        (32, 8, 128, 128, 4096, 512, jnp.float32),  # GQA
        (128, 1, 576, 512, 4096, 2048, jnp.bfloat16),  # dsa.absorb's form: the MXU kernel
        (16, 1, 576, 512, 4099, 300, jnp.bfloat16),  # the same, an odd length, picks not a whole chunk
        (16, 1, 576, 512, 4096, 300, jnp.float32),
    ],
)
def test_compiles_for_a_real_tpu(heads, kv_heads, d, dv, seq, picks, dtype):
    """Mosaic lowering and a libtpu compile (no TPU needed) of the forward and backward for a v5e.
    Catches: a block whose last two axes Mosaic rejects, a copy or reduction it refuses (interpret
    mode accepts them), buffers past the scoped VMEM."""
    arg = v5e_arg()
    loss = lambda q, k, v, i: jnp.sum(sparse_attention_tpu(q, k, v, i, scale=0.1).astype(jnp.float32))
    _compile(
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
        arg((1, seq, heads, d), dtype), arg((1, seq, kv_heads, d), dtype), arg((1, seq, kv_heads, dv), dtype),
        arg((1, seq, picks), jnp.int32),
    )  # fmt: skip


@pytest.mark.slow
def test_compiles_per_shard_under_a_mesh_of_tpu_chips():
    """`dsa.impl=pallas_tpu`'s attention over a (data=2, tensor=2) mesh of v5e chips: per shard of
    the batch and heads (shard_map), forward and backward. Catches: the kernel left for the
    partitioner ("Mosaic kernels cannot be automatically partitioned")."""
    topologies = pytest.importorskip("jax.experimental.topologies")
    pytest.importorskip("libtpu", reason="libtpu (the `tpu` extra) is not installed")
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = make_mesh(2, 1, 2, devices=topo.devices)
    rules = sharding_rules(load_config(None, []))
    attend = dsa_sparse_attention("pallas_tpu", rules=rules)

    def loss(q, k, v, i):  # traced as a dry run traces for a TPU slice
        with tracing_for("tpu"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jnp.sum(attend(q, k, v, i, scale=0.1).astype(jnp.float32))

    heads = NamedSharding(mesh, P("data", None, "tensor"))
    arg = lambda shape, spec=heads, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=spec)
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
        arg((4, 512, 8, 64)), arg((4, 512, 8, 64)), arg((4, 512, 8, 64)),
        arg((4, 512, 64), NamedSharding(mesh, P("data")), jnp.int32),
    )  # fmt: skip
    assert lowered.as_text().count("tpu_custom_call") == 2
    lowered.compile()


@pytest.mark.slow
def test_latent_decode_compiles_per_batch_shard_under_a_mesh_of_tpu_chips():
    """`dsa.impl=pallas_tpu`'s decode step (the latent decode kernel) over a (data 4) mesh of v5e
    chips: per batch shard. Catches: the kernel left for the partitioner."""
    topologies = pytest.importorskip("jax.experimental.topologies")
    pytest.importorskip("libtpu", reason="libtpu (the `tpu` extra) is not installed")
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = make_mesh(4, 1, 1, devices=topo.devices)
    rules = sharding_rules(load_config(None, []))
    unused = lambda *_: None

    def step(q, lat, kr, idx):  # traced as a dry run traces for a TPU slice
        view = CacheView(q, q, lat.shape[1], unused, unused, unused, unused, latent=(lat, kr))
        with tracing_for("tpu"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return dsa_decode_attention(view, idx, 0.1, "pallas_tpu", rules)

    rows = NamedSharding(mesh, P("data"))
    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    lowered = jax.jit(step).lower(
        arg((8, 1, 16, 512 + 64)), arg((8, 4096, 512)), arg((8, 4096, 64)), arg((8, 1, 256), jnp.int32)
    )
    assert lowered.as_text().count("tpu_custom_call") == 1
    lowered.compile()
