"""The jitted train and eval steps (explicit in/out shardings, donated state)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from effattn_jax.sharding import use_rules
from effattn_jax.train.state import TrainSetup


def loss_sums(model, batch) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token NLL, number of masked tokens) for one batch, float32."""
    logits = model(batch["inputs"], batch["segment_ids"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    return jnp.sum(nll * mask), jnp.sum(mask)


def make_train_step(setup: TrainSetup):
    """state, batch -> (state, metrics). Batch leaves are [batch, seq]; with
    `train.grad_accum` = A the batch is split into A micro-batches whose summed
    gradients are normalised by the total token count (same as one big batch)."""
    accum = setup.cfg.train.grad_accum

    def micro_grads(params, micro):
        def f(p):
            s, n = loss_sums(setup.model(p), micro)
            return s, n

        (s, n), g = jax.value_and_grad(f, has_aux=True)(params)
        return s, n, g

    def step(state, batch):
        params = state["params"]
        with use_rules(setup.mesh, setup.rules):
            if accum == 1:
                s, n, g = micro_grads(params, batch)
            else:
                micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

                def body(carry, mb):
                    s, n, g = micro_grads(params, mb)
                    return jax.tree.map(jnp.add, carry, (s, n, g)), None

                zero = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
                (s, n, g), _ = jax.lax.scan(body, zero, micro)
        n = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda x: x / n, g)
        updates, opt_state = setup.tx.update(grads, state["opt_state"], params)
        new = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }
        metrics = {
            "loss": s / n,
            "grad_norm": optax.tree.norm(grads),
            "lr": setup.schedule(state["step"]),
            "tokens": n,
        }
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
        with use_rules(setup.mesh, setup.rules):
            return loss_sums(setup.model(params), batch)

    replicated = NamedSharding(setup.mesh, PartitionSpec())
    return jax.jit(
        step, in_shardings=(setup.state_shardings["params"], setup.batch_sharding()), out_shardings=replicated
    )
