//! The runtime-generic cross-thread suite (`tests/suite/`) on the host runtime. The same suite
//! runs on burn backends in `suite_backend.rs` (NdArray in CI, CUDA on a GPU).

mod common;
mod suite;

use common::{Client, client, host};

/// The host device counts its buffers and in-place reuses.
fn host_counters() -> suite::Counters<fusion_streams::host::HostRuntime> {
    suite::Counters {
        live_buffers: |c: &Client| Some(host(c).live_buffers()),
        in_place_reuses: |c: &Client| Some(host(c).in_place_reuses),
    }
}

#[test]
fn builtins_match_reference() {
    suite::builtins_match_reference(&client());
}

#[test]
fn pending_share_drains_then_aliases() {
    suite::pending_share_drains_then_aliases(&client());
}

#[test]
fn materialised_share_does_not_drain() {
    suite::materialised_share_does_not_drain(&client());
}

#[test]
fn chained_share_drains_once() {
    suite::chained_share_drains_once(&client());
}

#[test]
fn every_drop_order_frees_each_id_once() {
    suite::every_drop_order_frees_each_id_once(client, &host_counters());
}

#[test]
fn foreign_drop_under_a_pending_reader_is_deferred() {
    suite::foreign_drop_under_a_pending_reader_is_deferred(&client());
}

#[test]
fn errors_travel_across_threads() {
    suite::errors_travel_across_threads(&client());
}

#[test]
fn in_place_is_refused_while_an_alias_lives() {
    suite::in_place_is_refused_while_an_alias_lives(&client(), &host_counters());
}

#[test]
fn nothing_leaks_after_cross_thread_work() {
    suite::nothing_leaks_after_cross_thread_work(&client());
}

#[test]
fn a_chain_on_a_moved_tensor_is_complete_for_a_reader_on_a_third_stream() {
    suite::a_chain_on_a_moved_tensor_is_complete_for_a_reader_on_a_third_stream(&client(), 1 << 16);
}

#[test]
fn a_chain_on_a_moved_tensor_is_complete_for_a_publication_on_a_third_stream() {
    suite::a_chain_on_a_moved_tensor_is_complete_for_a_publication_on_a_third_stream(
        &client(),
        1 << 16,
    );
}

#[test]
fn a_chain_on_the_allocating_stream_is_complete_for_a_stream_that_synced_earlier() {
    suite::a_chain_on_the_allocating_stream_is_complete_for_a_stream_that_synced_earlier(
        &client(),
        1 << 16,
    );
}
