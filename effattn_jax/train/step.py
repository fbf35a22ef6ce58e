"""The jitted train and eval steps (explicit in/out shardings, donated state).

Both trace under the run's mesh as jax's context mesh, which is how the model's
sharding constraints and the Pallas shard_map find it (effattn_jax.sharding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from effattn_jax.ops.context_parallel import balanced_batch, shard_rows
from effattn_jax.ops.cross_entropy import chunked_cross_entropy
from effattn_jax.sharding import constrain, sharding_rules
from effattn_jax.train.state import TrainSetup


def loss_sums(model, batch) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token NLL, number of masked tokens) for one batch, float32."""
    nll, _, tokens = loss_terms(model, batch)
    return nll, tokens


def loss_terms(model, batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of masked token NLL, sum of the DSA indexers' KL loss over the same tokens averaged
    over the DSA layers (0 without one), number of masked tokens), float32. The output head runs
    chunked (`model.loss_chunk_tokens`): the [B, S, vocab] logits are never held. Over a
    `context` mesh axis the batch is first laid out in the balanced order (a sum over tokens does
    not mind their order), and the loss runs over each shard's tokens as rows."""
    batch = balanced_batch(batch)
    mask, inputs = batch["loss_mask"], (batch["inputs"], batch["segment_ids"], batch["positions"])
    x, kl = model.features_and_indexer_kl(*inputs)
    kl_sum = jnp.zeros(()) if kl is None else jnp.sum(kl * mask) / model.dsa_layers
    if not model.loss_chunk_tokens:
        logits = constrain(model.logits(x), ("batch", "length", "vocab"), model.rules)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(nll * mask), kl_sum, jnp.sum(mask)
    x = model.final_norm(x)
    (x, rows), (targets, _), (weights, _) = (shard_rows(a, model.rules) for a in (x, batch["targets"], mask))
    total = chunked_cross_entropy(
        x, model.output_projection(), targets, weights, chunk_tokens=model.loss_chunk_tokens, rows=rows
    )
    return total, kl_sum, jnp.sum(mask)


def split_micro_batches(batch: dict, accum: int, rules) -> dict:
    """[B, ...] leaves -> [accum, B / accum, ...], micro-batch i = rows i, i + accum, ....

    Strided, not contiguous: the batch is sharded in contiguous row ranges, so a
    strided split leaves every device the same share of every micro-batch and
    no data moves (a contiguous split would put micro-batch 0 on the first
    devices only, and reshard each micro-step)."""

    def split(x):
        micro = jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1)
        return constrain(micro, (None, "batch", "length"), rules)

    return jax.tree.map(split, batch)


def make_train_step(setup: TrainSetup):
    """state, batch -> (state, metrics). Batch leaves are [batch, seq]; with
    `train.grad_accum` = A the batch is split into A micro-batches whose summed
    gradients are normalised by the total token count (same as one big batch). `nonfinite` in
    the metrics is 1 for a step whose loss or gradient is not finite (`train.nonfinite`). With a
    DSA layer the objective adds `dsa.kl_weight` times the indexers' KL loss (alone in the
    warm-up stage), and the metrics its mean, `indexer_kl`; `loss` is the LM loss throughout."""
    accum, rules = setup.cfg.train.grad_accum, sharding_rules(setup.cfg)
    skip_nonfinite = setup.cfg.train.nonfinite == "skip"

    dsa = setup.cfg.dsa
    warmup = setup.cfg.uses_dsa and dsa.stage == "warmup"  # the indexers alone train

    def objective(params, micro):
        nll, kl, tokens = loss_terms(setup.model(params), micro)
        # in the warm-up the LM loss is only reported: left out of the objective, it costs no backward
        return dsa.kl_weight * kl + (0.0 if warmup else nll), (nll, kl, tokens)

    def micro_grads(params, micro):
        (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(params, micro)
        return sums, grads

    def step(state, batch):
        params = state["params"]
        with jax.sharding.use_abstract_mesh(setup.mesh.abstract_mesh):
            if accum == 1:
                (loss_sum, kl_sum, tokens), grads = micro_grads(params, batch)
            else:

                def body(carry, micro):
                    return jax.tree.map(jnp.add, carry, micro_grads(params, micro)), None

                zero = ((jnp.zeros(()),) * 3, jax.tree.map(jnp.zeros_like, params))
                ((loss_sum, kl_sum, tokens), grads), _ = jax.lax.scan(
                    body, zero, split_micro_batches(batch, accum, rules)
                )
        tokens = jnp.maximum(tokens, 1.0)
        grads = jax.tree.map(lambda g: g / tokens, grads)
        loss, grad_norm = loss_sum / tokens, optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)  # any non-finite gradient makes the norm so
        updates, opt_state = setup.tx.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
        if skip_nonfinite:  # the step happens (its batch is consumed), its update does not
            new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, {k: state[k] for k in new})
        new["step"] = state["step"] + 1
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": setup.schedule(state["step"]),
            "tokens": tokens,
            "nonfinite": 1 - finite.astype(jnp.int32),
        }
        if setup.cfg.uses_dsa:
            metrics["indexer_kl"] = kl_sum / tokens
        return new, metrics

    replicated = NamedSharding(setup.mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(setup.state_shardings, setup.batch_sharding()),
        out_shardings=(setup.state_shardings, replicated),
        donate_argnums=0,
    )


def make_eval_step(setup: TrainSetup):
    """params, batch -> (sum NLL, token count)."""

    def step(params, batch):
        with jax.sharding.use_abstract_mesh(setup.mesh.abstract_mesh):
            return loss_sums(setup.model(params), batch)

    replicated = NamedSharding(setup.mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(setup.state_shardings["params"], setup.batch_sharding()),
        out_shardings=replicated,
    )


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every floating-point array of a tree is finite (checked before each save)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
