"""The long lane: the tests `make test` leaves out to stay under 10 minutes on 2 cores, and
`make test-long` runs (CI runs both). Each took 15 s or more on 2 cores, summed over its cases:
whole commands and training runs, multi-process launches, the GPU suite's dry run, property
sweeps, and the largest interpreted kernel cases. Every case of a listed function is in the lane;
test_structure checks that each entry names a test that exists."""

LONG = (
    "test_context_parallel.py::test_model_loss_and_gradients_over_context_shards",
    "test_context_parallel.py::test_moba_kernels_over_context_shards_match_one_device",
    "test_context_parallel.py::test_training_over_context_shards_matches_and_resumes_across_degrees",
    "test_convert.py::test_a_converted_model_resumes_in_place_and_trains_on_as_moba",
    "test_eval.py::test_figure_commands_write_png_and_data",
    "test_eval.py::test_run_saved_on_eight_devices_evaluates_the_same_on_one",
    "test_gpu_suite.py::test_dry_run_writes_every_section_without_the_data_stack",
    "test_harness.py::test_harness_figures_equal_the_suites",
    "test_mla.py::test_a_projected_gate_folds_into_one_table_for_decoding",
    "test_mla_decode_mgpu.py::test_model_decode_equals_xla",
    "test_model.py::test_remat_gives_the_same_gradients",
    "test_moba.py::test_property_random_shapes",
    "test_moba_decode_mgpu.py::test_kernel_matches_xla_and_triton",
    "test_moba_mgpu_blocks.py::test_kernels_match_the_triton_kernels",
    "test_moba_mgpu_blocks.py::test_moba_with_them_matches_the_reference",
    "test_moba_pallas.py::test_kernels_inside_a_sharded_train_step",
    "test_moba_pallas.py::test_kernels_interpreted_match_reference",
    "test_moba_pallas.py::test_mosaic_gpu_kernels_through_the_op",
    "test_moba_routing_kernel.py::test_kernel_picks_equal_xla",
    "test_moba_smem.py::test_tpu_kernels_in_smem_sized_slices",
    "test_moba_train.py::test_hybrids_train_and_resume_across_the_switch",
    "test_moba_train.py::test_moba_model_learns_and_is_sparse",
    "test_multiprocess.py::test_eval_and_generate_split_across_processes",
    "test_multiprocess.py::test_two_processes_train_as_one_and_stop_together",
    "test_object_store.py::test_kill9_during_a_save_on_gs_resumes_to_the_same_result",
    "test_object_store.py::test_two_processes_on_gs_match_local_disk",
    "test_save_faults.py::test_real_full_and_read_only_filesystems",
    "test_scan_layers.py::test_forward_gradients_and_decoding_match_the_loop",
    "test_scan_layers.py::test_ready_for_decoding_unstacks_the_layers_once",
    "test_sweep.py::test_recipe_trains_summarizes_then_only_redraws",
)

# Out of the quick loop (`make test-fast`; `make test` runs them): cases of 4 s or more on 2 cores,
# and the converted families past llama and deepseek_v2, so the loop stays under 2 minutes. An
# entry is a function (every case) or one case, `name[id]`.
QUICK_OUT = (
    "test_bench.py::test_attention_json_has_the_documented_keys",
    "test_context_parallel.py::test_splash_over_context_shards_matches_one_device",
    "test_convert.py::test_converted_model_matches_the_reference[deepseek_v2_eps]",
    "test_convert.py::test_converted_model_matches_the_reference[deepseek_v3]",
    "test_convert.py::test_converted_model_matches_the_reference[llama3]",
    "test_convert.py::test_converted_model_matches_the_reference[llama_eos_list]",
    "test_convert.py::test_converted_model_matches_the_reference[mistral]",
    "test_convert.py::test_converted_model_matches_the_reference[qwen2]",
    "test_convert.py::test_converted_model_matches_the_reference[qwen3]",
    "test_convert.py::test_runs_of_this_project_export_and_import_back",
    "test_egmla_report.py::test_decode_is_measured_in_repeats_with_provenance_and_only_when_configs_change",
    "test_gpu_memory.py::test_mla_decode_head_groups_equal_xla",
    "test_mla.py::test_packed_documents_and_core_switch[mla]",
    "test_mla.py::test_token_table_acts_only_through_the_residual[True]",
    "test_mla.py::test_token_table_decode_step_is_the_full_forwards_last_position[True-False]",
    "test_mla.py::test_token_table_trains_the_rows_it_reads",
    "test_mla_decode.py::test_gpu_kernel_slices_equal_xla[128]",
    "test_mla_decode_mgpu.py::test_no_races_between_the_warpgroups",
    "test_mla_decode_mgpu.py::test_slices_equal_xla_and_triton[16-512]",
    "test_mla_decode_mgpu.py::test_slices_equal_xla_and_triton[16-64]",
    "test_mla_decode_mgpu.py::test_smem_estimate_is_what_the_lowering_allocates[512]",
    "test_moba_decode.py::test_gpu_decode_kernel_matches_xla_and_lowers_for_cuda[whole_blocks]",
    "test_moba_decode.py::test_tpu_decode_kernel_matches_xla[aligned-pallas_tpu]",
    "test_moba_routing_kernel.py::test_moba_attention_on_pallas_routes_with_the_kernel[triton]",
    "test_scaling_fits.py::test_fits_json_has_both_axes_both_methods_and_gap_intervals",
)
