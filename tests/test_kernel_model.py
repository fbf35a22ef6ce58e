"""eval.bench.kernel_model: the JSON scripts read, and the HLO traffic count it gives routing."""

import json

import pytest

from eval.bench import kernel_model

HLO = """HloModule m

%slice_chunk (param_0: f32[4,8], param_1: s32[]) -> f32[1,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,8]{1,0} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={1,8}
}

%write_chunk (param_0: f32[4,8], param_1: f32[1,8], param_2: s32[]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[1,8]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[4,8]{1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %zero)
}

%cond (arg: (s32[], f32[4,8], f32[4,8])) -> pred[] {
  %arg = (s32[], f32[4,8], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %trips = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %trips), direction=LT
}

%body (arg: (s32[], f32[4,8], f32[4,8])) -> (s32[], f32[4,8], f32[4,8]) {
  %arg = (s32[], f32[4,8], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%arg), index=1
  %y = f32[4,8]{1,0} get-tuple-element(%arg), index=2
  %chunk = f32[1,8]{1,0} fusion(%x, %i), kind=kLoop, calls=%slice_chunk
  %out = f32[4,8]{1,0} fusion(%y, %chunk, %i), kind=kLoop, calls=%write_chunk
  ROOT %t = (s32[], f32[4,8], f32[4,8]) tuple(%i, %x, %out)
}

ENTRY %main (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %c = f32[4,8]{1,0} copy(%p)
  %z = s32[] constant(0)
  %t = (s32[], f32[4,8], f32[4,8]) tuple(%z, %p, %c)
  %w = (s32[], f32[4,8], f32[4,8]) while(%t), condition=%cond, body=%body
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%w), index=2
}
"""


def test_hlo_traffic_counts_loop_trips_slices_and_in_place_updates():
    copy = 2 * 4 * 8 * 4  # the copy reads and writes the whole array
    # slice: chunk read and written; update: chunk read and written in place; each reads the 4-byte index
    per_trip = (32 + 32 + 4) + (32 + 32 + 4)
    assert kernel_model.hlo_traffic(HLO) == copy + 4 * per_trip


@pytest.mark.slow
def test_json_keys_and_sane_ratios(capsys):
    kernel_model.main(["--seq", "2048", "--kv-heads", "4", "--topology", "none", "--json"])
    row = json.loads(capsys.readouterr().out)
    for key in ("fwd_steps", "bwd_steps", "fwd_flops_over_ideal", "bwd_flops_over_ideal", "fwd_kv_bytes"):
        assert row[key] > 0, key
    assert row["bwd_hbm_bytes"] > row["fwd_kv_bytes"] and row["routing_bytes"] is None
    assert 1.0 <= row["fwd_flops_over_ideal"] < 2.0  # the kernels never issue less than the ideal
    # GPU own block: its band is the own block up to the query, 128-row tiles of a 512 block
    assert 1.0 <= row["gpu_own_fwd_flops_over_ideal"] < 1.4
    assert row["gpu_own_fwd_flops_over_ideal"] < row["gpu_own_bwd_flops_over_ideal"] < 1.4 * 1.4
