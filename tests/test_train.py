import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import corrupt_step, random_batch, tiny_overrides

from effattn_jax import checkpoint
from effattn_jax.config import load_config
from effattn_jax.sharding import make_mesh
from effattn_jax.train.loop import Preempted, run
from effattn_jax.train.metrics import read_scalars
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import make_train_step

pytestmark = pytest.mark.slow  # training runs

TB_TAGS = {"loss", "learning_rate", "grad_norm", "tokens_per_sec", "tokens_seen", "val_loss"}


def tiny_cfg(corpus_dir, run_dir, **extra):
    return load_config(None, tiny_overrides(corpus_dir, run_dir, **extra))


def test_tiny_run_learns_and_logs(tmp_path, corpus_dir):
    res = run(tiny_cfg(corpus_dir, tmp_path / "run", **{"train.steps": 12, "train.profile_steps": "[2,4]"}))
    scalars = read_scalars(tmp_path / "run")
    assert set(scalars) >= TB_TAGS
    loss = [v for _, v in scalars["loss"]]
    assert len(loss) == 12 and np.mean(loss[-3:]) < np.mean(loss[:3]) - 1.0
    assert res["step"] == 12 and np.isfinite(res["val_loss"]) and res["unigram_loss"] > 0
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "launches.jsonl").exists()
    assert any(
        p.is_file() for p in (tmp_path / "run" / "profile").rglob("*")
    )  # the profiler window wrote a trace


def test_a_run_resumed_inside_its_profile_window_stops_no_trace(tmp_path, corpus_dir):
    """Preempted at step 3, then resumed with train.profile_steps=[2,5]: the trace was never started
    (it starts at step 2), so the resumed run stops none (jax: "No profile started") and writes none."""
    run_dir = tmp_path / "run"
    with pytest.raises(Preempted):
        run(tiny_cfg(corpus_dir, run_dir), stop_at=3)
    res = run(tiny_cfg(corpus_dir, run_dir, **{"train.profile_steps": "[2,5]"}))
    assert res["step"] == 6 and not (run_dir / "profile").exists()


def test_resume_is_bitwise_identical_past_corrupt_steps(tmp_path, corpus_dir, capsys):
    """A run cut short resumes to the uninterrupted run's losses and state bitwise, also when its newest
    step is corrupt each time it resumes (flipped, truncated, deleted file; flipped or truncated with the
    manifest removed too): the step is set aside (reported once), the run resumes from the newest step
    that verifies and saves that step again. Catches: a step restored without verifying its manifest, a
    step without a manifest restored and re-approved, a quarantine that leaves the step listed, a data
    iterator restored to the wrong position."""
    steps = {"train.steps": 8}
    full = run(tiny_cfg(corpus_dir, tmp_path / "full", **steps))
    cut = tmp_path / "cut"
    with pytest.raises(Preempted) as stopped:
        run(tiny_cfg(corpus_dir, cut, **steps), stop_at=3)
    assert stopped.value.code == 143
    assert checkpoint.kept_steps(cut) == [2, 3]
    capsys.readouterr()
    for how, no_manifest, newest, stop_at, kept in (
        ("flip", False, 3, 4, [2, 4]),
        ("flip", True, 4, 5, [4, 5]),
        ("truncate", True, 5, 6, [4, 6]),
        ("truncate", False, 6, 7, [6, 7]),
        ("delete", False, 7, None, [6, 8]),
    ):
        corrupt_step(cut / "checkpoints" / str(newest), how, drop_manifest=no_manifest)
        if stop_at is None:
            resumed = run(tiny_cfg(corpus_dir, cut, **steps))
        else:
            with pytest.raises(Preempted):
                run(tiny_cfg(corpus_dir, cut, **steps), stop_at=stop_at)
        err = capsys.readouterr().err
        verdict = "cannot be verified (MissingManifest" if no_manifest else "is corrupt"
        assert err.count(f"checkpoint step {newest} {verdict}") == 1, err
        assert err.count("checkpoint step") == 1 and "Traceback" not in err
        assert "Event loop is closed" not in err
        assert checkpoint.kept_steps(cut) == kept
    assert sorted(int(p.name) for p in (cut / "checkpoints" / "corrupt").iterdir()) == [3, 4, 5, 6, 7]
    la, lb = read_scalars(tmp_path / "full")["loss"], read_scalars(cut)["loss"]
    assert la[-1][0] == lb[-1][0] == 8 and la[-1][1] == lb[-1][1]
    assert resumed["val_loss"] == full["val_loss"]
    setup = make_setup(tiny_cfg(corpus_dir, tmp_path / "full"), make_mesh(1, 1, 1))
    states = [
        checkpoint.Checkpoints(tmp_path / r).restore_latest(setup.abstract_state)[1] for r in ("full", "cut")
    ]
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_round_trip_and_retention(tmp_path, corpus_dir):
    """A saved state restores exactly; retention keeps the newest step; a flipped byte fails `load_params`
    naming the checksum. Catches: a step deleted before the newer one is checksummed, a manifest that is
    not checked on load."""
    run(tiny_cfg(corpus_dir, tmp_path / "run", **{"train.steps": 4}))
    cfg = tiny_cfg(corpus_dir, tmp_path / "run")
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    ckpts = checkpoint.Checkpoints(tmp_path / "run", keep_last=1)
    assert ckpts.all_steps() == [2, 4]
    step, state = ckpts.restore_latest(setup.abstract_state)
    assert step == 4 and int(state["step"]) == 4
    # save/restore round trip of a fresh state, equal leaf for leaf; retention waits for the manifest
    fresh = init_state(setup)
    ckpts.save(10, fresh, None, cfg.to_dict())
    ckpts.finish()
    assert ckpts.all_steps() == [10] and (tmp_path / "run/checkpoints/10/checksums.json").is_file()
    step, back = ckpts.restore_latest(setup.abstract_state)
    assert step == 10
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(back), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    ckpts.close()
    assert checkpoint.restore_config(tmp_path / "run")["model"]["d_model"] == 32
    # eval verifies too: a corrupt step is refused, not loaded
    corrupt_step(tmp_path / "run/checkpoints/10", "flip")
    with pytest.raises(checkpoint.CheckpointError, match="does not match its checksum"):
        checkpoint.load_params(tmp_path / "run", 10)


def test_sharded_step_matches_single_device(tmp_path, corpus_dir):
    assert jax.device_count() == 8, "conftest simulates 8 CPU devices"
    batch = random_batch(0)
    results = []
    for mesh_shape in ((1, 1, 1), (2, 2, 2)):
        cfg = tiny_cfg(corpus_dir, tmp_path / "r")
        setup = make_setup(cfg, make_mesh(*mesh_shape))
        state = init_state(setup)
        new, metrics = make_train_step(setup)(state, jax.device_put(batch, setup.batch_sharding()))
        results.append((float(metrics["loss"]), jax.device_get(new["params"]), new))
    (l1, p1, _), (l8, p8, sharded) = results
    q = sharded["params"]["blocks"][0]["attn"]["q"]["kernel"]
    assert tuple(q.sharding.spec) == ("fsdp", "tensor", None)  # really sharded, not replicated
    assert abs(l8 - l1) <= 1e-5 * abs(l1)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_grad_accumulation_matches_one_batch(tmp_path, corpus_dir):
    """Summed micro-batch gradients equal the one-batch step with the batch sharded over two
    devices, and each micro-batch stays spread over both (no batch all-gather or all-to-all)."""
    batch = random_batch(1, mask_keep=0.7)  # uneven token counts per micro-batch
    out = []
    for accum in (1, 2):
        cfg = tiny_cfg(corpus_dir, tmp_path / "r", **{"train.grad_accum": accum, "mesh.data": 2})
        setup = make_setup(cfg, make_mesh(2, 1, 1))
        state, sharded_batch = init_state(setup), jax.device_put(batch, setup.batch_sharding())
        step = make_train_step(setup).lower(state, sharded_batch).compile()
        assert "all-to-all" not in step.as_text() and "all-gather" not in step.as_text()
        new, m = step(state, sharded_batch)
        out.append((float(m["loss"]), jax.device_get(new["params"])))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_run_dir_has_one_writer_and_keeps_its_config(tmp_path, corpus_dir):
    """A second live writer is refused, a stale lock taken over, a changed config refused on resume.
    Catches: a lock that ignores a live holder, a resume that silently takes a new config."""
    import json
    import os
    import socket
    import subprocess

    from effattn_jax.config import ConfigError

    run_dir = tmp_path / "run"
    run(tiny_cfg(corpus_dir, run_dir, **{"train.steps": 2}))
    saved = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e:  # another model on the same run: refused, nothing written
        run(tiny_cfg(corpus_dir, run_dir, **{"train.steps": 4, "model.d_model": 64, "train.lr": 1e-3}))
    assert "model.d_model: 32 -> 64" in str(e.value) and "train.lr: 0.01 -> 0.001" in str(e.value)
    assert (run_dir / "config.yaml").read_text() == saved and checkpoint.kept_steps(run_dir) == [2]

    lock = run_dir / "run.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": "now"}))
    with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()}"):
        run(tiny_cfg(corpus_dir, run_dir, **{"train.steps": 4}))
    dead = subprocess.Popen(["true"])  # a pid that has exited
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": "then"}))
    # a stale lock is replaced; steps, logging and checkpointing may change on resume
    res = run(tiny_cfg(corpus_dir, run_dir, **{"train.steps": 4, "checkpoint.every_steps": 4}))
    assert res["step"] == 4 and not lock.exists()
    # train.resume=false starts over (even with another model), the old run moved aside intact
    run(tiny_cfg(corpus_dir, run_dir, **{"train.steps": 2, "model.d_model": 64, "train.resume": False}))
    (previous,) = run_dir.glob("previous-*")
    assert checkpoint.kept_steps(previous) == [2, 4] and checkpoint.kept_steps(run_dir) == [2]
    assert "d_model: 64" in (run_dir / "config.yaml").read_text()


def test_nonfinite_step_is_skipped_or_stops_before_any_save(tmp_path, corpus_dir):
    """A non-finite step is skipped (the state unchanged) or stops the run before any save. Catches: a
    skipped step that still applies its update or advances Adam's moments, a non-finite state saved before
    the stop."""
    from effattn_jax.train.loop import NonFiniteError
    from effattn_jax.train.step import all_finite

    # skip: a step whose loss is NaN leaves parameters and optimizer state exactly as they were
    setup = make_setup(
        tiny_cfg(corpus_dir, tmp_path / "r", **{"train.nonfinite": "skip"}), make_mesh(1, 1, 1)
    )
    state = init_state(setup)
    state["params"]["embed"] = state["params"]["embed"].at[0, 0].set(np.nan)
    before = jax.device_get(state)
    batch = random_batch(0)
    batch["inputs"][0, 0] = 0  # reads the poisoned row
    new, metrics = make_train_step(setup)(state, jax.device_put(batch, setup.batch_sharding()))
    assert int(metrics["nonfinite"]) == 1 and int(new["step"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(new)), strict=True):
        assert a.shape == () or np.array_equal(a, b, equal_nan=True)

    # stop: training diverges (lr 1e30); the run stops naming the step, nothing non-finite is saved
    run_dir = tmp_path / "diverges"
    with pytest.raises(NonFiniteError, match="non-finite loss or gradients at step"):
        run(
            tiny_cfg(
                corpus_dir, run_dir, **{"train.lr": 1e30, "train.warmup_steps": 1, "eval.every_steps": 100}
            )
        )
    abstract = make_setup(tiny_cfg(corpus_dir, run_dir), make_mesh(1, 1, 1)).abstract_state
    mngr = checkpoint.manager(run_dir)
    for step in mngr.all_steps():
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        assert bool(all_finite(restored["state"]))


def test_init_from_starts_a_new_run_from_another_runs_parameters(tmp_path, corpus_dir, capsys):
    """train.init_from=RUN@STEP: a new run begins with that step's parameters, a fresh optimizer
    state and step 0; MoBA (no parameters of its own) and another RoPE base keep the shapes; a
    model of other shapes, or a step not kept, is refused in one line before anything is written.
    Catches: optimizer moments or the step carried over, a partial restore that leaves fresh weights."""
    from effattn_jax.config import ConfigError

    src = tmp_path / "src"
    run(tiny_cfg(corpus_dir, src, **{"train.steps": 4}))
    cfg = tiny_cfg(corpus_dir, tmp_path / "new", **{"train.steps": 2, "train.init_from": f"{src}@2"})
    setup = make_setup(cfg, make_mesh(1, 1, 1))
    state = init_state(setup, checkpoint.restore_params(src, 2, setup.abstract_state["params"]))
    _, _, saved = checkpoint.load_params(src, 2)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(saved), strict=True):
        assert np.array_equal(a, b)
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0]
    assert moments and all(not np.any(x) for x in moments) and int(state["step"]) == 0

    result = run(cfg)
    assert result["step"] == 2 and "started from the parameters of" in capsys.readouterr().err
    moba = tiny_cfg(corpus_dir, tmp_path / "moba", **MOBA_CORE, **{"model.rope_theta": 40000.0})
    abstract = make_setup(moba, make_mesh(1, 1, 1)).abstract_state["params"]
    assert checkpoint.shape_changes(src, 4, abstract) == []

    wider = {"train.init_from": str(src), "model.mlp_dim": 96}
    for extra, why in ((wider, "do not fit this model: .*mlp"), ({"train.init_from": f"{src}@3"}, "step 3")):
        with pytest.raises(ConfigError, match=why):
            run(tiny_cfg(corpus_dir, tmp_path / "bad", **extra))
        assert not (tmp_path / "bad").exists()


MOBA_CORE = {"attention.core": "moba", "moba.block_size": 8, "moba.top_k": 2}
