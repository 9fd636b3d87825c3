//! The runtime-generic cross-thread suite (`tests/suite/`) on the burn backend runtime,
//! `FusionClient<BackendRuntime<B>>` — the engine under `StreamFusion<B>`: NdArray by default,
//! burn's CubeCL backend on CUDA with the `cuda` feature (then every test needs a GPU and is
//! ignored unless asked for: see scripts/gpu-tests.sh).

mod common;
mod suite;
mod under_test;

use fusion_streams::FusionClient;
use fusion_streams::backend::BackendRuntime;

use under_test::Plain;

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

/// The GPU tests are ignored unless asked for.
macro_rules! on_this_backend {
    ($macro:path { $($input:tt)* }) => {
        $macro! {
            {
                #[cfg_attr(
                    feature = "cuda",
                    ignore = "needs an NVIDIA GPU: build with scripts/gpu-tests.sh, run on a GPU machine"
                )]
            }
            $($input)*
        }
    };
}

// The suite, then publication's shared properties (`suite/publication.rs`), on the burn
// backend's engine.
on_this_backend!(suite::cross_thread_suite { client, suite::Counters::none(), LARGE });
on_this_backend!(suite::suite {
    suite::publication {
        a_publication_survives_its_session(&client());
        a_publication_outlives_its_session_client_and_tensors(client());
        forgetting_a_publication_leaks_it_in_place(client(), &suite::Counters::none());
        a_refused_publication_returns_the_value(client);
        a_wrong_length_buffer_is_refused_with_both_owners_back(&client());
        one_session_per_stream(client);
        a_pinned_buffer_is_reused_across_downloads(&client());
        a_value_from_another_stream_is_published_after_its_producer_ran(&client());
    }
});
