"""The attack suite's map: each hole of issue 11 and the tests that try it (all real servers).

The holes of the issue's "Why" (W) and of its points 3-6 (P3-P6); who tries each: ``none`` (no
credentials), ``role`` (another role's credential), ``tenant`` (another tenant's token or store),
``holder`` (a holder of a ref, without the store's secret). ``run`` is
``tests/attacks/test_attack_embedded_run.py::test_an_embedded_run_under_attack_trains_unharmed``,
a real embedded GRPO run attacked while it trains. This module checks that every test named
below exists, and every attack test is named, so the map cannot drift from the suite.

Hole (who tries it): the tests that try it.

W: NATS takes any client (no credentials, no TLS) (none):
    run
    tests/integration/test_nats_auth.py::test_a_client_without_credentials_cannot_connect
    tests/integration/test_nats_auth.py::test_a_wrong_password_is_refused_and_not_shown
    tests/integration/test_nats_auth_run.py::test_an_embedded_run_is_locked_by_default
    tests/integration/test_nats_auth_deploy.py::test_strangers_cannot_connect
    tests/integration/test_nats_creds.py::test_a_stranger_seed_or_none_is_refused
    tests/integration/test_nats_creds.py::test_forged_creds_are_refused

W: Shutdown to any worker (role):
    run
    tests/integration/test_nats_auth.py::test_only_the_controller_drives_the_trainer
    tests/integration/test_nats_auth.py::test_only_the_controller_commands_rollout_and_reward_workers

W: Shutdown to the token-protected reward server (tenant):
    tests/reward/test_tenant_safety.py::test_only_the_admin_shuts_a_shared_server_down
    tests/reward/test_deploy_shared_server.py::test_a_tenant_of_the_deploy_example_cannot_run_code_read_others_or_stop_it

W: drive trainer.step/publish/save/load (role):
    run
    tests/integration/test_nats_auth.py::test_only_the_controller_drives_the_trainer
    tests/integration/test_nats_auth_deploy.py::test_the_tiers_of_the_training_cluster_keep_to_their_roles

W: push weights into rollout workers (role):
    run
    tests/integration/test_nats_auth.py::test_only_the_controller_commands_rollout_and_reward_workers

W: forge announce and leave (role):
    run
    tests/integration/test_nats_auth.py::test_membership_cannot_be_forged_by_another_role
    tests/integration/test_nats_auth.py::test_the_controller_cannot_announce_workers

W: join the reward queue group, read tokens, forge scores (role, tenant):
    run
    tests/integration/test_nats_auth.py::test_no_other_role_joins_the_reward_queue_group
    tests/integration/test_nats_auth.py::test_no_role_reads_another_roles_replies
    tests/integration/test_nats_auth_deploy.py::test_a_tenant_scores_and_nothing_more

W: TensorStore is plain gRPC (none):
    tests/integration/test_tensor_guard_tls.py::test_tls_store_serves_tls_clients_only
    tests/integration/test_tensor_guard_tls.py::test_mutual_tls_serves_only_clients_with_a_certificate_of_its_ca
    tests/integration/test_tensor_guard_tls.py::test_worker_stores_and_clients_speak_mtls_from_their_settings
    tests/integration/test_tensor_guard_tls.py::test_an_embedded_run_trains_over_mutual_tls

W: predictable keys, anyone reads the weights (none):
    run
    tests/integration/test_tensor_guard.py::test_get_needs_the_refs_capability
    tests/integration/test_tensor_guard.py::test_a_capability_from_another_store_opens_nothing
    tests/integration/test_tensor_guard.py::test_keys_are_unpredictable_and_never_overwritten

W: overwrite a rollout batch before it is trained on (none, holder):
    run
    tests/integration/test_tensor_guard.py::test_put_delete_and_stat_need_the_store_secret
    tests/integration/test_tensor_guard.py::test_keys_are_unpredictable_and_never_overwritten

P4: a ref holder deletes a batch early (holder):
    run
    tests/integration/test_tensor_guard.py::test_a_capability_reads_but_never_deletes
    tests/integration/test_tensor_guard_release.py::test_a_rollout_worker_frees_its_batches_when_it_loads_newer_weights

W: the reward server reads whatever store a request names (tenant):
    tests/reward/test_tenant_safety.py::test_a_tenant_fetches_only_from_its_own_stores
    tests/attacks/test_attack_tenants.py::test_a_tenant_cannot_read_another_tenants_rollout_by_its_address

W, P5: a tenant runs code through a reward spec (tenant):
    tests/reward/test_tenant_safety.py::test_a_tenant_cannot_make_the_server_run_code
    tests/reward/test_tenant_safety.py::test_can_update_is_off_by_default
    tests/reward/test_tenant_safety.py::test_the_operator_may_admit_a_module
    tests/reward/test_deploy_shared_server.py::test_a_tenant_of_the_deploy_example_cannot_run_code_read_others_or_stop_it

W, P6: trainer.load takes any path and unpickles (role):
    tests/trainer/test_checkpoint_paths.py::test_confine_takes_paths_inside_the_root_only
    tests/trainer/test_checkpoint_paths.py::test_save_and_load_outside_the_root_are_refused
    tests/trainer/test_checkpoint_paths.py::test_inside_the_root_save_and_load_work_and_links_out_are_refused

P3: tokens sent to a subject an unverified announce names (role):
    tests/integration/test_nats_auth.py::test_membership_cannot_be_forged_by_another_role

P4: stalled streams, RPC floods, tiny chunks, no deadlines (none):
    tests/integration/test_tensor_guard.py::test_a_stalled_put_is_cut_off_and_others_are_served
    tests/integration/test_tensor_guard.py::test_concurrent_rpcs_are_capped
    tests/integration/test_tensor_guard.py::test_chunks_under_the_minimum_are_refused
    tests/integration/test_tensor_guard.py::test_every_client_call_has_a_deadline
    tests/integration/test_fuzz_grpc.py::test_malformed_streams_get_error_statuses_and_the_server_keeps_serving

P5: a tenant on another tenant's endpoint (tenant):
    tests/attacks/test_attack_tenants.py::test_a_tenant_cannot_score_on_another_tenants_endpoint

P5: a regex reward stalls the server (tenant):
    tests/reward/test_rules.py::test_regex_runs_in_linear_time_on_a_catastrophic_pattern
    tests/reward/test_rules.py::test_regex_refuses_what_re2_cannot_match_in_linear_time

P5: quotas, starving another tenant, huge batches (tenant):
    tests/reward/test_tenant_safety.py::test_every_tenant_request_counts_against_its_quota
    tests/reward/test_tenant_safety.py::test_a_busy_tenant_cannot_starve_another
    tests/reward/test_shared_quotas.py::test_a_tenant_gets_its_quota_once_across_two_replicas
    tests/reward/test_tenant_safety.py::test_max_batch_is_checked_before_any_text_is_fetched

P7: hostile messages on every subject (role):
    tests/integration/test_fuzz_messages.py::test_every_subject_answers_hostile_messages_with_errors

I29 P1: a membership message (leave, announce) in another worker's name (role):
    tests/attacks/test_forged_leave.py::test_membership_forged_in_a_rollout_workers_name_changes_nothing

I29 P5: generate requests whose fields are in bounds and whose products are not (role):
    tests/attacks/test_product_bounds.py::test_default_limits_refuse_samples_and_context_then_serve
    tests/attacks/test_product_bounds.py::test_configured_limits_refuse_each_product_then_serve

I29 P5/P6: a tenant's texts of any size, kept computing past the deadline (tenant):
    tests/attacks/test_tenant_resources.py::test_texts_over_the_tenants_caps_are_refused_before_they_are_fetched
    tests/attacks/test_tenant_resources.py::test_a_store_that_sends_more_than_it_declared_is_cut_off
    tests/attacks/test_tenant_resources.py::test_a_tenants_requests_hold_at_most_its_bytes_in_flight
    tests/attacks/test_tenant_resources.py::test_scoring_stops_when_the_requests_deadline_passes
    tests/attacks/test_tenant_resources.py::test_a_tenants_request_stops_at_its_request_s_without_a_deadline

I29 P6: pings make every worker broadcast (tenant):
    tests/attacks/test_tenant_resources.py::test_a_ping_flood_makes_a_worker_announce_at_a_bounded_rate

I29 P6: store allow-lists matched as strings, DNS answers that change (tenant):
    tests/attacks/test_tenant_resources.py::test_a_name_shaped_like_an_allowed_address_does_not_pass
    tests/attacks/test_tenant_resources.py::test_a_store_name_is_resolved_once_and_the_checked_address_is_dialled

I29 P6: errors tell whether a path exists on the server (tenant):
    tests/attacks/test_tenant_resources.py::test_every_model_path_a_tenant_may_not_use_gets_one_message
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = "tests/attacks/test_attack_embedded_run.py::test_an_embedded_run_under_attack_trains_unharmed"
ISSUE_29 = ("test_forged_leave.py", "test_product_bounds.py", "test_tenant_resources.py")
"""The outside-attacker suite of issue 29, named after what each attacks."""
NAMED = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }


def test_every_test_the_map_names_exists() -> None:
    named = NAMED.findall(__doc__ or "") + [tuple(RUN.split("::"))]
    assert len(named) > 40
    missing = [f"{path}::{name}" for path, name in named
               if not (REPO / path).is_file() or name not in _tests(REPO / path)]  # fmt: skip
    assert missing == [], f"the attack map names tests that do not exist: {missing}"


def test_every_attack_test_is_on_the_map() -> None:
    here = Path(__file__).parent
    on_map = {name for path, name in NAMED.findall(__doc__ or "") if path.startswith("tests/attacks/")}
    on_map.add(RUN.split("::")[1])
    for path in [*here.glob("test_attack_*.py"), *(here / name for name in ISSUE_29)]:
        if path.name != Path(__file__).name:
            assert _tests(path) <= on_map, f"{path.name} has tests missing from the map"
