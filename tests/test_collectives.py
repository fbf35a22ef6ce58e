"""Reading the bytes of a compiled program's collectives from its HLO text."""

from effattn_jax.collectives import collective_bytes

HLO = """
HloModule step

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ag = f32[4,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}
  %rs = bf16[4,2]{1,0} reduce-scatter(%y), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}
  %one = f32[64]{0} all-reduce(%z), channel_id=3, replica_groups={{0},{1},{2},{3}}, to_apply=%add
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %bound = s32[]{:T(128)} constant(14)
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

%gather_fusion (a: f32[2,8]) -> f32[4,8] {
  ROOT %ag2 = f32[4,8]{1,0} all-gather(%a), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %w = (s32[], f32[4,8]) while(%t), condition=%cond, body=%body
  %w2 = (s32[], f32[4,8]) while(%t), condition=%cond, body=%body,\
    backend_config={"known_trip_count":{"n":"3"}}
  %start = (f32[2,8], f32[4,8]) async-collective-start(%a), kind=kCustom, calls=%gather_fusion
  %ar = (f32[16]{0}, f32[8]{0}) all-reduce(%b, %c), channel_id=5, replica_groups={{0,1}}, to_apply=%add
}
"""


def test_loops_multiply_their_bodies_and_trivial_groups_move_nothing():
    """A while counts its body per iteration: 3 where XLA proved the trip count, 14 from its
    condition's bound otherwise; an async collective's computation counts once; a tuple
    all-reduce counts every operand; an all-reduce over groups of one device counts nothing."""
    got = collective_bytes(HLO)
    assert got["all-gather"] == (14 + 3) * 4 * 8 * 4 + 4 * 8 * 4
    assert got["reduce-scatter"] == (14 + 3) * 4 * 2 * 2
    assert got["all-reduce"] == (16 + 8) * 4
