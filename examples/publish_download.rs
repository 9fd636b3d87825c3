//! Publish a finished value from a held session and download it into a reused pinned buffer.
//!
//! `cargo run --release --example publish_download`
//!
//! A held session produces a value, publishes it (the frontier is recorded without waiting) and
//! closes; the tensors are dropped, so the publication alone keeps the value's allocation. Its
//! download into a pinned buffer is polled, then waited on, and the buffer is reused for a second
//! round. Each state the program sees is printed.

use std::time::Instant;

use burn_backend::{DType, TensorData};
use fusion_streams::host::{HostDevice, HostRuntime};
use fusion_streams::runtime::TransferRuntime;
use fusion_streams::transfer::HeldSession;
use fusion_streams::{FusionClient, Result};

const N: usize = 256;

/// The CUDA runtime when built with `--features cuda` and a GPU answers; the host runtime
/// otherwise.
fn main() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        use fusion_streams::cuda::{CudaDevice, CudaRuntime};
        if CudaRuntime::is_available() {
            return run(FusionClient::<CudaRuntime>::new(CudaDevice::new(0))?);
        }
        println!("(built with `cuda`, but no CUDA device answered: using the host runtime)");
    }
    run(FusionClient::<HostRuntime>::new(HostDevice::default())?)
}

fn run<R: TransferRuntime>(client: FusionClient<R>) -> Result<()> {
    let started = Instant::now();
    println!("publish_download on the {} runtime", R::name());
    let bytes = N * N * DType::F32.size();
    // Pinned memory is expensive to allocate (on CUDA): allocate once, reuse.
    let mut buffer = R::alloc_pinned(client.context(), bytes)?;
    println!("allocated a {bytes}-byte pinned buffer");

    for round in 1..=2 {
        let client = client.clone();
        let mut session = HeldSession::open(&client)?;
        let a = client.from_data(TensorData::new(
            (0..N * N)
                .map(|i| ((i * round) % 13) as f32 - 6.0)
                .collect::<Vec<_>>(),
            [N, N],
        ))?;
        let b = client.fill([N, N], 0.5, DType::F32)?;
        let value = a.matmul(&b)?.scale(2.0)?; // queued on the session's stream
        let expected_first_row: f32 = (0..N).map(|k| ((k * round) % 13) as f32 - 6.0).sum();

        // SAFETY: `value` was produced by this crate's operations on the session's stream.
        let mut publication = unsafe { session.publish(value) }.map_err(|e| e.error().clone())?;
        println!(
            "round {round}: published {} bytes; frontier ready right away: {}",
            publication.bytes(),
            publication.frontier_ready()?
        );
        session.close();
        drop((a, b, client));
        println!("round {round}: session closed, its tensors dropped");

        let pending = publication
            .download_into(buffer)
            .map_err(|e| e.error().clone())?;
        let mut polls = 0u64;
        while !pending.is_ready()? {
            polls += 1;
            std::thread::yield_now();
        }
        println!("round {round}: download polled {polls} time(s) before it was ready");
        buffer = pending.wait().map_err(|e| e.error)?;

        let row = buffer.to_data([N, N], DType::F32)?.to_vec::<f32>().unwrap();
        assert!(row[..N].iter().all(|v| *v == expected_first_row));
        println!(
            "round {round}: first row checked ({expected_first_row} everywhere), buffer back for reuse"
        );
    }

    let retirement = R::retirement(client.context()).stats();
    println!(
        "retirement queue: pending {}, permanent {}, released {}",
        retirement.pending, retirement.permanent, retirement.released
    );
    println!("done ({:.1?})", started.elapsed());
    Ok(())
}
