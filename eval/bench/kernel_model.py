"""What the MoBA Pallas kernels would issue on a TPU, counted from their own schedule.

    python -m eval.bench.kernel_model [--seq 8192,32768,131072] [--kv-heads 16,4] [--json]

Routes random bf16 q/k with the real gate (`moba_routing`), builds the tile tables the kernels
run with (`tpu_own.own_tables`, `schedule.past_tiles`, the default `BlockSizes`) and counts, per
forward and backward, for the own-block kernels (tpu_own.py) plus the whole-block kernels of
the selected earlier blocks (tpu_blocks.py):
- grid steps, as issued (padding tiles included);
- issued matmul FLOPs (the kernels' own `pl.CostEstimate`s) over the ideal: every
  visible (query, key) pair once, 2 (D + Dv) FLOPs forward, 6 D + 4 Dv backward (a fused flash
  backward: scores, dP, dV, dQ, dK);
- HBM bytes under the TPU pipeline's rules: a block is copied only when its index differs
  from the previous grid step's; lse and delta are lane-dense rows. Both directions also count
  the XLA glue around the kernels: the per-head layouts of q, K, V, dO and o (read + write;
  none where the kernels read them in place: head dim a multiple of 128, S of the block),
  the tile gathers of q and dO (read + write), and the backward's final pass for dq, which
  reads the own part's row and each selection's row and writes dq (the selected blocks' kernel
  adds its dK/dV into the own part's in place: each group's window read and written);
- the GPU own-block kernels (gpu_own.py): issued (query, key) pairs from their tables, over the
  own block's visible pairs;
- routing: HBM bytes of the gate compiled ahead of time for a TPU (libtpu, the `tpu` extra),
  with each loop body counted once per trip (`cost_analysis()` counts it once).

Batch 1, 16 query heads, head dim 128, block 512, top_k 3 (the benchmark shape). `--json`
prints one JSON object (a list for several shapes) with `fwd_steps`, `bwd_steps`,
`fwd_flops_over_ideal`, `bwd_flops_over_ideal`, `fwd_kv_bytes`, `fwd_hbm_bytes`,
`bwd_hbm_bytes`, `routing_bytes`, `gpu_own_fwd_flops_over_ideal`, `gpu_own_bwd_flops_over_ideal`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from effattn_jax.cli import positive_int, positive_int_list
from effattn_jax.ops.routing import moba_routing
from eval.bench import common
from pallas_kernels.moba import gpu_own, tpu_blocks, tpu_own
from pallas_kernels.moba.parts import padded_length, reads_in_place, tpu_past_slices
from pallas_kernels.moba.schedule import BlockSizes, past_tiles

GIB = 2**30


def _copies(index: np.ndarray) -> int:
    """Block copies of a kernel whose grid steps read the block `index` [steps] in order: the
    pipeline copies only when the index differs from the previous step's."""
    return int(1 + np.count_nonzero(index[1:] != index[:-1]))


def own_counts(
    needs: np.ndarray,
    prev: np.ndarray,
    *,
    b: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    item: int,
    block_size: int,
    in_place: bool,
) -> dict:
    """The chunk-diagonal own-block kernels (tpu_own.py): grid (B x Hkv, chunk, query head of
    the group), forward and fused backward; the previous chunk only where a chunk needs it (its
    dK/dV carried in VMEM); every gradient written once, in the input dtype. `in_place`: q, K,
    V, dO read as they lie (parts.reads_in_place), else through head-major copies."""
    c, n = block_size, needs.shape[0] // b
    steps = b * hq * n
    q = jax.ShapeDtypeStruct((b * hq, n * c, d), jnp.bfloat16 if item == 2 else jnp.float32)
    k, v = jax.ShapeDtypeStruct((b * hkv, 1, d), q.dtype), jax.ShapeDtypeStruct((1, 1, dv), q.dtype)
    tile = tpu_own.own_tile(c, BlockSizes().resolve("tpu").key_tile)
    flops = {
        p: tpu_own.cost_estimate(q, k, v, c, n, float(needs.mean()), p, tile).flops for p in ("fwd", "bwd")
    }
    # K/V copies: the current chunk once per (row, chunk) (the group's heads share it); the
    # previous chunk whenever its index moves (grid order: row, chunk)
    prev_index = np.repeat(np.arange(b * hkv), n) * n + np.tile(prev.reshape(b, n), (1, hkv)).reshape(-1)
    kv_bytes = (b * hkv * n + _copies(prev_index)) * c * (d + dv) * item
    rows_q, rows_do = steps * c * d * item, steps * c * dv * item
    lane_row = steps * c * 4
    own_grads = b * hkv * n * c * (d + dv) * item  # dK, dV of the keys, written once
    copies = 0 if in_place else 1
    kv_layout = copies * 2 * b * hkv * n * c * (d + dv) * item  # K/V to [B*Hkv, S_pad, D]: read + write
    fwd_bytes = kv_bytes + rows_q + steps * c * dv * 4 + lane_row
    bwd_kernel = kv_bytes + rows_q + rows_do + 2 * lane_row + steps * c * d * item + own_grads
    glue = (
        copies * 2 * (rows_q + rows_do) + kv_layout
    )  # head layouts of q, dO, K, V (the final pass: combine_counts)
    return {
        "fwd_steps": steps,
        "bwd_steps": steps,
        "fwd_flops": flops["fwd"],
        "bwd_flops": flops["bwd"],
        "fwd_kv_bytes": kv_bytes,
        "fwd_hbm_bytes": fwd_bytes + copies * 2 * (rows_q + steps * c * dv * 4) + kv_layout,  # + layouts
        "bwd_hbm_bytes": bwd_kernel + glue,
    }


def past_counts(past, *, d: int, dv: int, item: int, block_size: int, seq_pad: int) -> dict:
    """The whole-block kernels (tpu_blocks.py): one step per tile, forward and fused backward,
    padding tiles skipped (`pl.when`; the last real tile's K/V window and rows: no copy), in
    calls of the schedule's slices (parts.tpu_past_slices: each call copies its first window); dq
    per tile row in the input dtype; dK/dV accumulated in float32 VMEM per (batch, KV head,
    block) group and added, once per group, into the own part's dK/dV window in place (the
    window read and written, in the input dtype)."""
    ntiles, qt = past.tiles.rows.shape
    groups = int((np.asarray(past.group_tiles) > 0).sum())
    real = int(np.asarray(past.group_tiles).sum())  # tiles that do work
    q = jax.ShapeDtypeStruct((ntiles, qt, d), jnp.bfloat16 if item == 2 else jnp.float32)
    w = tpu_blocks.window(block_size, q.dtype)
    starts = tpu_blocks.window_starts(past.tiles.key_start, block_size, seq_pad, q.dtype)
    starts = np.asarray(starts).astype(np.int64)
    window_index = np.asarray(past.tiles.kv_row).astype(np.int64) * seq_pad + starts

    def kv_bytes_of(kernel):  # each call (a slice whose tables fit SMEM) copies its first window anew
        cuts = tpu_past_slices(kernel, ntiles, qt)
        return sum(_copies(window_index[c]) for c in cuts) * w * (d + dv) * item

    kv_bytes, kv_bwd = kv_bytes_of("moba_block_fwd"), kv_bytes_of("moba_block_bwd")
    lane_rows = ntiles * qt * 4  # one lane-dense float32 [1, Qt] row per tile
    rows_in = ntiles * qt * (d + dv) * item  # q and dO tiles
    dq = ntiles * qt * d * item
    group_grads = 2 * groups * w * (d + dv) * item
    # the kernels read the rows of real tiles only (padding tiles keep the last real tile's);
    # every tile's outputs are written, and XLA's gathers fill every tile
    read_rows = real * qt * (d + dv) * item + 2 * real * qt * 4  # q, dO, lse, delta
    fwd_bytes = (
        kv_bytes + 2 * ntiles * qt * d * item + real * qt * d * item + ntiles * qt * dv * 4 + lane_rows
    )
    bwd_kernel = kv_bwd + read_rows + dq + group_grads
    bwd_glue = 2 * rows_in + 4 * lane_rows  # q, dO, lse, delta gathered into tiles (read + write)
    return {
        "fwd_steps": ntiles,
        "bwd_steps": ntiles,
        "fwd_flops": tpu_blocks.cost_estimate("fwd", q, dv, block_size).flops * real // ntiles,
        "bwd_flops": tpu_blocks.cost_estimate("bwd", q, dv, block_size).flops * real // ntiles,
        "fwd_kv_bytes": kv_bytes,
        "fwd_hbm_bytes": fwd_bytes,
        "bwd_hbm_bytes": bwd_kernel + bwd_glue,
    }


def combine_counts(*, b: int, s: int, hq: int, d: int, item: int, pairs: int) -> int:
    """The backward's final pass (attention._bwd): dq reads the own part's rows and each real
    selection's tile row (input dtype) and is written once. dK/dV need no pass: the selected
    blocks' kernel adds into the own part's (past_counts)."""
    return 2 * b * s * hq * d * item + pairs * d * item


def gpu_own_counts(first: np.ndarray, q_end: np.ndarray, *, b: int, hq: int, seq_pad: int, bs) -> dict:
    """(query, key) pairs the GPU own-block kernels (gpu_own.py) issue, from their tables:
    forward and dq walk key steps first..last per (query head, query tile); dK/dV walk query
    tiles i0..q_end per (KV head, key step), for each query head of the group."""
    qt, ck = bs.q_tile, bs.kv_block
    nq, nk = seq_pad // qt, seq_pad // ck
    last = (np.arange(nq) * qt + qt - 1) // ck
    q_steps = int((last[None] - first.reshape(b, nq) + 1).sum()) * hq
    kv_steps = int((q_end.reshape(b, nk) - (np.arange(nk) * ck // qt)[None]).sum()) * hq
    return {"fwd_pairs": q_steps * qt * ck, "dkv_pairs": kv_steps * qt * ck}


def ideal_pairs(own_start: np.ndarray, past_start: np.ndarray, block_size: int) -> tuple[int, int]:
    """Visible (query head, key) pairs of MoBA: (the own block up to the query, each selected
    earlier (full) block)."""
    t = np.arange(own_start.shape[1])[None]
    own = int((t - own_start + 1).sum()) * past_start.shape[2]
    return own, int((past_start >= 0).sum()) * block_size


_WIDTH = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_ARRAY = re.compile(r"\b(" + "|".join(_WIDTH) + r")\[([\d,]*)\]")
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-start", "copy-done"}


def _shape_bytes(text: str) -> int:
    return sum(
        _WIDTH[t] * int(np.prod([int(d) for d in dims.split(",") if d])) for t, dims in _ARRAY.findall(text)
    )


def _closing(text: str, i: int) -> int:
    """Index just past the parenthesis that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    raise ValueError(f"unbalanced parentheses in HLO: {text[:80]!r}")


def _computations(hlo: str) -> dict[str, list[tuple[str, str, int, str, str]]]:
    """name -> its instructions (name, opcode, output bytes, operand text, attributes)."""
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) \(.*\{$", line)
        if head:
            current = comps.setdefault("ENTRY" if line.startswith("ENTRY") else head.group(1), [])
            continue
        inst = re.match(r"^\s+(?:ROOT )?%(\S+) = (.*)$", line)
        if current is None or not inst:
            continue
        rest = inst.group(2)
        shape_end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
        op = re.match(r"\s*([\w-]+)\(", rest[shape_end:])
        if not op:
            continue
        args_start = shape_end + op.end() - 1
        args_end = _closing(rest, args_start)
        args = rest[args_start + 1 : args_end - 1]
        current.append((inst.group(1), op.group(1), _shape_bytes(rest[:shape_end]), args, rest[args_end:]))
    return comps


def _sliced_params(comps, name: str) -> dict[int, int]:
    """Parameter index -> bytes actually read, for the parameters a fused computation reads only
    through dynamic slices, directly or in a nested fusion (a loop body reading one chunk of a
    stacked array reads the chunk)."""
    comp = comps[name]
    index = {n: int(a) for n, o, _, a, _ in comp if o == "parameter"}
    read: dict[int, int] = {}
    whole: set[int] = set()
    for _, op, out, args, attrs in comp:
        operands = re.findall(r"%([\w.-]+)", args)
        nested = (
            _sliced_params(comps, re.search(r"calls=%([\w.-]+)", attrs).group(1)) if op == "fusion" else {}
        )
        for position, operand in enumerate(operands):
            if operand not in index:
                continue
            i = index[operand]
            if op == "dynamic-slice" and position == 0:
                read[i] = read.get(i, 0) + out
            elif position in nested:
                read[i] = read.get(i, 0) + nested[position]
            else:
                whole.add(i)
    return {i: b for i, b in read.items() if i not in whole}


def _in_place_update(comps, name: str) -> tuple[int, int] | None:
    """(parameter index, update bytes) when a fused computation's root dynamic-update-slices one
    of its parameters: XLA updates that buffer in place, so only the update is written."""
    comp = comps[name]
    _, op, _, args, _ = comp[-1]  # the root is printed last
    if op != "dynamic-update-slice":
        return None
    target, update = re.findall(r"%([\w.-]+)", args)[:2]
    params = {n: int(a) for n, o, _, a, _ in comp if o == "parameter"}
    sizes = {n: b for n, _, b, _, _ in comp}
    return (params[target], sizes[update]) if target in params else None


def hlo_traffic(hlo: str) -> int:
    """HBM bytes of a compiled module's schedule: every top-level op reads its operands and
    writes its output once (intermediates inside a fusion are free; an operand a fusion only
    dynamic-slices counts its slices; a dynamic-update-slice writes in place); a while loop
    counts its body once per trip, the trip count read from its condition (the one integer
    constant the counter is compared with)."""
    comps = _computations(hlo)

    def walk(name: str) -> int:
        sizes = {n: b for n, _, b, _, _ in comps[name]}
        total = 0
        for _, op, out, args, attrs in comps[name]:
            operands = [sizes.get(o, 0) for o in re.findall(r"%([\w.-]+)", args)]
            if op == "while":
                cond = re.search(r"condition=%([\w.-]+)", attrs).group(1)
                body = re.search(r"body=%([\w.-]+)", attrs).group(1)
                limits = {a for _, o, b, a, _ in comps[cond] if o == "constant" and b == 4 and a.isdigit()}
                if len(limits) != 1:
                    raise ValueError(f"cannot read the trip count of while loop {body} from {cond}")
                total += int(limits.pop()) * walk(body)
            elif op == "dynamic-slice":
                total += 2 * out
            elif op == "dynamic-update-slice":
                total += 2 * operands[1]
            elif op == "fusion":
                called = re.search(r"calls=%([\w.-]+)", attrs).group(1)
                read = _sliced_params(comps, called)
                written = _in_place_update(comps, called)
                if written is not None:  # the output aliases that operand: only the update moves
                    read[written[0]], out = 0, written[1]
                total += out + sum(read.get(i, b) for i, b in enumerate(operands))
            elif op not in _NO_TRAFFIC:
                total += out + sum(operands)
        return total

    return walk("ENTRY")


def routing_bytes(seq: int, hq: int, hkv: int, d: int, *, block_size: int, top_k: int, topology: str) -> int:
    """HBM bytes of the gate compiled ahead of time for a TPU topology (`hlo_traffic`)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rep)
    route = jax.jit(lambda q, k: moba_routing(q, k, block_size=block_size, top_k=top_k))
    compiled = route.lower(spec((1, seq, hq, d)), spec((1, seq, hkv, d))).compile()
    return hlo_traffic(compiled.as_text())


def model(seq: int, hq: int, hkv: int, *, d: int = 128, block_size: int = 512, top_k: int = 3, topology=None):
    """Every figure of one shape, as a JSON-ready dict."""
    bs = BlockSizes().resolve("tpu")
    gpu_bs = BlockSizes().resolve("gpu", head_dim=d)  # the GPU's auto tiles, for its own-block counts
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, seq, hq, d), np.float32), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, seq, hkv, d), np.float32), jnp.bfloat16)
    r = jax.jit(lambda q, k: moba_routing(q, k, block_size=block_size, top_k=top_k))(q, k)
    del q, k
    in_place = reads_in_place("tpu", seq, d, d, block_size)
    seq_pad = seq if in_place else padded_length(seq, block_size, bs)
    _, needs, prev = tpu_own.own_tables(r.own_start, block_size=block_size, seq_pad=seq_pad)
    own = own_counts(
        np.asarray(needs),
        np.asarray(prev),
        b=1,
        hq=hq,
        hkv=hkv,
        d=d,
        dv=d,
        item=2,
        block_size=block_size,
        in_place=in_place,
    )
    parts = [own]
    past = None
    if r.past_start.shape[-1]:
        past = past_tiles(r.past_start, num_kv_heads=hkv, block_size=block_size, q_tile=bs.past_q_tile)
    if past is not None:
        parts.append(past_counts(past, d=d, dv=d, item=2, block_size=block_size, seq_pad=seq_pad))
    total = {key: sum(p[key] for p in parts) for key in parts[0]}
    own_pairs, past_pairs = ideal_pairs(np.asarray(r.own_start), np.asarray(r.past_start), block_size)
    total["bwd_hbm_bytes"] += combine_counts(b=1, s=seq, hq=hq, d=d, item=2, pairs=past_pairs // block_size)
    pairs = own_pairs + past_pairs
    gpu_pad = padded_length(seq, block_size, gpu_bs)  # the GPU kernels take head-major copies
    _, first, q_end = gpu_own.own_tables(
        r.own_start, seq_pad=gpu_pad, q_tile=gpu_bs.q_tile, kv_block=gpu_bs.kv_block
    )
    gpu = gpu_own_counts(np.asarray(first), np.asarray(q_end), b=1, hq=hq, seq_pad=gpu_pad, bs=gpu_bs)
    out = {
        "seq": seq,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": d,
        "block_size": block_size,
        "top_k": top_k,
        "q_tile": bs.q_tile,
        "kv_block": bs.kv_block,
        "past_q_tile": bs.past_q_tile,
        "fwd_steps": total["fwd_steps"],
        "bwd_steps": total["bwd_steps"],
        "fwd_flops_over_ideal": total["fwd_flops"] / (pairs * 4 * d),
        "bwd_flops_over_ideal": total["bwd_flops"] / (pairs * 10 * d),
        "fwd_kv_bytes": total["fwd_kv_bytes"],
        "fwd_hbm_bytes": total["fwd_hbm_bytes"],
        "bwd_hbm_bytes": total["bwd_hbm_bytes"],
        "routing_bytes": None,
        # GPU own block (gpu_own.py): split backward (dq, then dK/dV) recomputes scores and dP,
        # 8 D + 6 Dv per issued pair against the fused ideal's 6 D + 4 Dv
        "gpu_own_fwd_flops_over_ideal": gpu["fwd_pairs"] / own_pairs,
        "gpu_own_bwd_flops_over_ideal": (gpu["fwd_pairs"] * 6 * d + gpu["dkv_pairs"] * 8 * d)
        / (own_pairs * 10 * d),
    }
    if topology:
        out["routing_bytes"] = routing_bytes(
            seq, hq, hkv, d, block_size=block_size, top_k=top_k, topology=topology
        )
    return out


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--seq", type=positive_int_list, default=[8192, 32768, 131072])
    p.add_argument("--kv-heads", type=positive_int_list, default=[16, 4])
    p.add_argument("--q-heads", type=positive_int, default=16)
    p.add_argument(
        "--topology", default="v5e:2x2", help="TPU topology for the routing compile; 'none' skips it"
    )
    args = p.parse_args(argv)
    bad = [h for h in args.kv_heads if args.q_heads % h]
    if bad:
        p.error(f"--kv-heads {bad[0]} does not divide --q-heads {args.q_heads}")
    topology = None if args.topology == "none" else args.topology
    with common.report(args, f"{args.q_heads} query heads, head dim 128, block 512, top_k 3, bf16") as emit:
        print(
            "| seq | Hkv | fwd steps | bwd steps | fwd FLOPs/ideal | bwd FLOPs/ideal | fwd K/V GiB "
            "| fwd HBM GiB | bwd HBM GiB | routing GiB | GPU own FLOPs/ideal fwd, bwd |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        rows = []
        for seq, hkv in ((seq, hkv) for seq in args.seq for hkv in args.kv_heads):
            row = model(seq, args.q_heads, hkv, topology=topology)
            rows.append(row)
            rb = "-" if row["routing_bytes"] is None else f"{row['routing_bytes'] / GIB:.2f}"
            print(
                f"| {seq} | {hkv} | {row['fwd_steps']:,} | {row['bwd_steps']:,} "
                f"| {row['fwd_flops_over_ideal']:.2f} | {row['bwd_flops_over_ideal']:.2f} "
                f"| {row['fwd_kv_bytes'] / GIB:.2f} | {row['fwd_hbm_bytes'] / GIB:.2f} "
                f"| {row['bwd_hbm_bytes'] / GIB:.2f} | {rb} "
                f"| {row['gpu_own_fwd_flops_over_ideal']:.2f}, "
                f"{row['gpu_own_bwd_flops_over_ideal']:.2f} |",
                flush=True,
            )
        emit(rows[0] if len(rows) == 1 else rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
