//! The runtime-generic cross-thread suite (`tests/suite/`) on the burn backend runtime,
//! `FusionClient<BackendRuntime<B>>` — the engine under `StreamFusion<B>`: NdArray by default,
//! burn's CubeCL backend on CUDA with the `cuda` feature (then every test needs a GPU and is
//! ignored unless asked for: see scripts/gpu-tests.sh).

mod common;
mod suite;

#[cfg(not(feature = "cuda"))]
use burn_ndarray::NdArray;
use fusion_streams::FusionClient;
use fusion_streams::backend::BackendRuntime;

#[cfg(not(feature = "cuda"))]
type Plain = NdArray<f32>;
#[cfg(feature = "cuda")]
type Plain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

fn client() -> FusionClient<BackendRuntime<Plain>> {
    FusionClient::with_config(Default::default(), common::lazy_config()).expect("the device")
}

/// Elements of the long chains: 64 Mi f32 (256 MiB) on the GPU, so that each kernel of a chain
/// takes long enough for a reader that is not ordered after it to see it half done.
const LARGE: usize = if cfg!(feature = "cuda") {
    1 << 26
} else {
    1 << 12
};

/// One test per line: `suite!(module; name(args); ...)` calls `module::name(args)`.
macro_rules! suite {
    ($module:path; $($name:ident($($arg:expr),*);)*) => {$(
        #[test]
        #[cfg_attr(
            feature = "cuda",
            ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
        )]
        fn $name() {
            use $module as module;
            module::$name($($arg),*);
        }
    )*};
}

suite! {
    suite;
    builtins_match_reference(&client());
    pending_share_drains_then_aliases(&client());
    materialised_share_does_not_drain(&client());
    chained_share_drains_once(&client());
    every_drop_order_frees_each_id_once(client, &suite::Counters::none());
    foreign_drop_under_a_pending_reader_is_deferred(&client());
    errors_travel_across_threads(&client());
    in_place_is_refused_while_an_alias_lives(&client(), &suite::Counters::none());
    nothing_leaks_after_cross_thread_work(&client());
    a_chain_on_a_moved_tensor_is_complete_for_a_reader_on_a_third_stream(&client(), LARGE);
    a_chain_on_a_moved_tensor_is_complete_for_a_publication_on_a_third_stream(&client(), LARGE);
    a_chain_on_the_allocating_stream_is_complete_for_a_stream_that_synced_earlier(&client(), LARGE);
}

// Publication's shared properties (`suite/publication.rs`) on the burn backend's engine.
suite! {
    suite::publication;
    a_publication_survives_its_session(&client());
    a_publication_outlives_its_session_client_and_tensors(client());
    forgetting_a_publication_leaks_it_in_place(client(), &suite::Counters::none());
    a_refused_publication_returns_the_value(client);
    a_wrong_length_buffer_is_refused_with_both_owners_back(&client());
    one_session_per_stream(client);
    a_pinned_buffer_is_reused_across_downloads(&client());
    a_value_from_another_stream_is_published_after_its_producer_ran(&client());
}
