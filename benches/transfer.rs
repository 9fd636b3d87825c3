//! Transfer paths of `StreamFusion<CubeBackend<CudaRuntime, ..>>` on a GPU (feature `cuda`; run
//! on the H200 with `./gpu-bin/transfer --bench`), through the engine under it,
//! `FusionClient<BackendRuntime<CubeBackend>>`.
//!
//! * `transfer_paths`: 16 B, 64 KiB, 8 MiB and 256 MiB from one device buffer to the host:
//!   `download_into` a reused pinned buffer + `wait` (of values published beforehand, their
//!   frontier reached), the same end to end with `publish` timed too (and once more with the
//!   caller awaiting the frontier before it downloads), burn's own `into_data`
//!   (what a burn user would call instead), cubecl's `read_one`, a pageable `cuMemcpyDtoH`, and a
//!   raw `cuMemcpyDtoHAsync` + event into `cuMemHostAlloc` memory (the practical limit), side by
//!   side in one run; beside them the two floors of any copy into the caller's page-locked
//!   memory on cubecl 0.10 (`sync_raw`: cubecl's `sync`, then the raw copy on another stream;
//!   `read_copy`: cubecl's `read_one` into its staging memory, then a host `memcpy`). Prints
//!   GB/s and `ratio <path>_vs_{raw,into_data,read_one,sync_raw,read_copy}_<size>`.
//! * `transfer_overlap`: K rounds of produce → publish → download, pipelined (the next producer
//!   runs while the previous copy does) against the same work done serially; the producer is
//!   sized so that its compute time is about the copy time. Prints `ratio overlap_vs_serial`.
//! * `publish` and `frontier_ready`: the cost of each call; `frontier`: publish + await of a value
//!   already finished, beside cubecl's own `sync` of an idle stream (the floor of any frontier
//!   observed on the host, which is the only ordering cubecl 0.10 leaves a copy on another
//!   stream).

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("the transfer benchmark needs a GPU: cargo bench --features cuda --bench transfer");
}

#[cfg(feature = "cuda")]
fn main() {
    gpu::main();
}

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
mod gpu {
    use std::ffi::c_void;
    use std::time::{Duration, Instant};

    use burn_backend::ops::FloatTensorOps;
    use burn_backend::{DType, TensorData};
    use criterion::{BenchmarkId, Criterion, Throughput};
    use cudarc::driver::{result, sys};
    use fusion_streams::FusionClient;
    use fusion_streams::backend::{BackendRuntime, StreamFusion};
    use fusion_streams::runtime::TransferRuntime;
    use fusion_streams::transfer::{HeldSession, PinnedHostBuffer, SourcePublication};

    use super::common::{median, record};

    type Cube = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
    type Runtime = BackendRuntime<Cube>;
    type Tensor = fusion_streams::FusionTensor<Runtime>;
    type Session = HeldSession<Runtime>;

    /// Time `body` once per iteration as `name` in `group` (`<path>/<size>` for a transfer
    /// path), and keep the per-iteration time for the ratios printed at the end.
    fn timed(
        group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
        mut body: impl FnMut(),
    ) {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    body();
                }
                let t = start.elapsed();
                record(name, t, iters);
                t
            })
        });
    }

    fn publish(session: &mut Session, value: Tensor) -> SourcePublication<Runtime> {
        // SAFETY: the value is produced on the session's stream by this crate's operations.
        unsafe { session.publish(value) }.expect("admitted")
    }

    fn label(bytes: usize) -> String {
        match bytes {
            b if b >= 1 << 20 => format!("{}MiB", b >> 20),
            b if b >= 1 << 10 => format!("{}KiB", b >> 10),
            b => format!("{b}B"),
        }
    }

    /// The primary context current on this thread, for the raw baselines.
    fn raw_context() {
        // SAFETY: standard driver initialisation; the primary context is retained for the
        // process's lifetime (the benchmark's).
        unsafe {
            result::init().unwrap();
            let dev = result::device::get(0).unwrap();
            let ctx = result::primary_ctx::retain(dev).unwrap();
            result::ctx::set_current(ctx).unwrap();
        }
    }

    fn transfer_paths(c: &mut Criterion, client: &FusionClient<Runtime>) {
        raw_context();
        let mut group = c.benchmark_group("transfer_paths");
        for bytes in [16usize, 64 << 10, 8 << 20, 256 << 20] {
            let n = bytes / 4;
            let size = label(bytes);
            eprintln!("transfer_paths {size}: preparing");
            let value = client
                .from_data(TensorData::new(
                    (0..n).map(|i| (i % 977) as f32).collect::<Vec<_>>(),
                    [n],
                ))
                .unwrap();
            client.sync().unwrap();
            // SAFETY: the raw baseline only reads the buffer (a device-to-host copy), after the
            // sync above has finished its producer.
            let handle = unsafe { value.handle() }.unwrap();
            let cubecl_handle = handle.handle.clone();
            let cubecl = handle.client.clone();
            let resource = cubecl_handle
                .stream
                .executes(|| cubecl.get_resource(cubecl_handle.clone()))
                .unwrap();
            let device_ptr = resource.resource().ptr;
            group.throughput(Throughput::Bytes(bytes as u64));

            // download_into of published values whose frontier has been reached: batches are
            // published and awaited untimed, then their downloads (+ wait) are timed. This is
            // the hand-off path the raw baseline is the limit for.
            let mut session = Session::open(client).unwrap();
            let mut buffer = Some(Runtime::alloc_pinned(client.context(), bytes).unwrap());
            let name = format!("download_into/{size}");
            group.bench_function(BenchmarkId::new("download_into", &size), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    let mut left = iters;
                    while left > 0 {
                        let batch = left.min(64);
                        left -= batch;
                        let published: Vec<_> = (0..batch)
                            .map(|_| {
                                let mut p = publish(&mut session, value.clone());
                                p.await_frontier().unwrap();
                                p
                            })
                            .collect();
                        let start = Instant::now();
                        for p in published {
                            let pending = p.download_into(buffer.take().unwrap()).unwrap();
                            buffer = Some(pending.wait().unwrap());
                        }
                        total += start.elapsed();
                    }
                    record(&name, total, iters);
                    total
                })
            });
            // End to end: publish + download_into + wait, the frontier recorded each time.
            timed(&mut group, &format!("publish_download/{size}"), || {
                let p = publish(&mut session, value.clone());
                let pending = p.download_into(buffer.take().unwrap()).unwrap();
                buffer = Some(pending.wait().unwrap());
            });
            // The same, split where the two routes part: the caller awaits the frontier, then
            // downloads by the direct route. Against `publish_download` (whose download is asked
            // for while the frontier is pending, and goes through the stream's waiter), this
            // shows what the waiter's hop costs.
            timed(
                &mut group,
                &format!("publish_await_download/{size}"),
                || {
                    let mut p = publish(&mut session, value.clone());
                    p.await_frontier().unwrap();
                    let pending = p.download_into(buffer.take().unwrap()).unwrap();
                    buffer = Some(pending.wait().unwrap());
                },
            );
            let got = buffer.as_ref().unwrap().to_data([n], DType::F32).unwrap();
            assert_eq!(got.to_vec::<f32>().unwrap()[n - 1], ((n - 1) % 977) as f32);
            session.close();

            // The raw baseline: async copy + event into page-locked memory, own stream.
            // SAFETY: plain driver calls on handles created here and freed below.
            let (stream, host, event) = unsafe {
                let stream =
                    result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
                let mut host: *mut c_void = std::ptr::null_mut();
                sys::cuMemHostAlloc(&mut host, bytes, sys::CU_MEMHOSTALLOC_PORTABLE)
                    .result()
                    .unwrap();
                let event =
                    result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
                (stream, host, event)
            };
            let raw_copy = || {
                // SAFETY: `device_ptr` is live (held by `resource`), `host` has `bytes` bytes,
                // and each copy completes before the next one starts.
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(host, device_ptr, bytes, stream)
                        .result()
                        .unwrap();
                    result::event::record(event, stream).unwrap();
                    result::event::synchronize(event).unwrap();
                }
            };

            // The two floors of a copy into the caller's page-locked memory on cubecl 0.10,
            // for a value whose producer may still run. cubecl keeps its streams private, so a
            // copy either runs on another stream after a cubecl fence the host has observed
            // (`sync_raw`: cubecl's `sync`, then the raw copy), or runs on cubecl's stream into
            // cubecl's own staging memory and is then copied on the host (`read_copy`:
            // cubecl's `read_one`, then a `memcpy` into the page-locked buffer).
            timed(&mut group, &format!("sync_raw/{size}"), || {
                cubecl::future::block_on(cubecl.sync()).unwrap();
                raw_copy();
            });
            timed(&mut group, &format!("read_copy/{size}"), || {
                let staged = cubecl.read_one(cubecl_handle.clone()).unwrap();
                // SAFETY: `host` has `bytes` bytes and no copy into it is in flight.
                unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), host as *mut u8, bytes) };
            });

            // burn's own read, what a burn user would call instead.
            timed(&mut group, &format!("into_data/{size}"), || {
                let data =
                    burn_backend::read_sync(StreamFusion::<Cube>::float_into_data(value.clone()))
                        .unwrap();
                std::hint::black_box(data);
            });

            // cubecl's own read.
            timed(&mut group, &format!("read_one/{size}"), || {
                let bytes = cubecl.read_one(cubecl_handle.clone()).unwrap();
                std::hint::black_box(bytes);
            });

            // A pageable, synchronous copy into a Vec.
            let mut pageable = vec![0u8; bytes];
            timed(&mut group, &format!("pageable/{size}"), || {
                // SAFETY: `device_ptr` is live (held by `resource`), `pageable` has
                // `bytes` bytes.
                unsafe {
                    sys::cuMemcpyDtoH_v2(pageable.as_mut_ptr() as *mut c_void, device_ptr, bytes)
                }
                .result()
                .unwrap();
            });

            timed(&mut group, &format!("raw/{size}"), raw_copy);
            // SAFETY: created above, no longer in use.
            unsafe {
                let _ = result::event::destroy(event);
                let _ = sys::cuMemFreeHost(host);
                let _ = result::stream::destroy(stream);
            }
            drop((resource, handle, value));
        }
        group.finish();
    }

    fn costs(c: &mut Criterion, client: &FusionClient<Runtime>) {
        let mut group = c.benchmark_group("costs");
        let mut session = Session::open(client).unwrap();
        let value = client.fill([1024], 1.0, DType::F32).unwrap();
        client.sync().unwrap();
        group.bench_function("publish", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let v = value.clone();
                    let start = Instant::now();
                    let mut p = publish(&mut session, v);
                    total += start.elapsed();
                    p.await_frontier().unwrap();
                }
                record("publish", total, iters);
                total
            })
        });
        // The frontier of a value that is already finished, as the host observes it, against
        // the floor of any host-observed cubecl fence: cubecl's own `sync` of an idle stream
        // (one round trip to its server, one fence recorded and waited for). cubecl 0.10 keeps
        // its CUDA streams private, so a copy on another stream can be ordered after a cubecl
        // stream only through such a fence, observed on the host.
        timed(&mut group, "frontier", || {
            publish(&mut session, value.clone())
                .await_frontier()
                .unwrap();
        });
        // SAFETY: only the handle's cubecl client is used, to synchronise.
        let cubecl = unsafe { value.handle() }.unwrap().client;
        timed(&mut group, "cubecl_sync", || {
            cubecl::future::block_on(cubecl.sync()).unwrap();
        });
        let mut p = publish(&mut session, value.clone());
        p.await_frontier().unwrap();
        timed(&mut group, "frontier_ready", || {
            assert!(p.frontier_ready().unwrap());
        });
        group.finish();
    }

    /// Inputs of the overlap producer: `[m, k] @ [k, m]`, a 64 MiB output for `m = 4096`.
    fn producer_inputs(client: &FusionClient<Runtime>, m: usize, k: usize) -> (Tensor, Tensor) {
        let a = client
            .from_data(TensorData::new(
                (0..m * k).map(|i| (i % 5) as f32).collect::<Vec<_>>(),
                [m, k],
            ))
            .unwrap();
        let b = client
            .from_data(TensorData::new(
                (0..k * m).map(|i| (i % 3) as f32).collect::<Vec<_>>(),
                [k, m],
            ))
            .unwrap();
        (a, b)
    }

    /// Seconds per round of `rounds` runs of `f`, the median of three.
    fn per_round(rounds: usize, mut f: impl FnMut()) -> f64 {
        let mut t: Vec<f64> = (0..3)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..rounds {
                    f();
                }
                start.elapsed().as_secs_f64() / rounds as f64
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[1]
    }

    /// K rounds of produce → publish → download. The producer is a matmul whose inner dimension
    /// is calibrated in this run so that its compute time matches the copy time of its output
    /// (both measured alone first, and printed).
    fn overlap(c: &mut Criterion, client: &FusionClient<Runtime>) {
        const K: usize = 8;
        let m = 4096;
        let n = m;
        let mut session = Session::open(client).unwrap();
        let mut buffers: Vec<PinnedHostBuffer> = (0..K)
            .map(|_| Runtime::alloc_pinned(client.context(), n * n * 4).unwrap())
            .collect();
        // The copy alone: downloads of a finished value.
        let finished = client.fill([m, n], 1.0, DType::F32).unwrap();
        client.sync().unwrap();
        let copy = per_round(K, || {
            let mut p = publish(&mut session, finished.clone());
            p.await_frontier().unwrap();
            let buffer = buffers.pop().unwrap();
            buffers.push(p.download_into(buffer).unwrap().wait().unwrap());
        });
        drop(finished);
        // The compute alone, at a probe size, then scaled (naive matmul time ∝ k).
        let compute_at = |k: usize| {
            let (a, b) = producer_inputs(client, m, k);
            client.sync().unwrap();
            per_round(1, || {
                // Kept until the sync: a fusing engine may skip work whose results nobody holds.
                let produced: Vec<_> = (0..K)
                    .map(|round| a.matmul(&b).unwrap().scale(round as f64).unwrap())
                    .collect();
                client.sync().unwrap();
                drop(produced);
            }) / K as f64
        };
        // Matmul time is not proportional to k at small k: scale from a probe, then refine
        // twice from the time measured at the estimate.
        let (mut k, mut compute) = (64, compute_at(64));
        for _ in 0..3 {
            k = ((k as f64 * copy / compute).round() as usize).clamp(8, 16384);
            compute = compute_at(k);
        }
        eprintln!(
            "transfer_overlap: inner dimension {k}: compute {:.3} ms, copy {:.3} ms per round",
            compute * 1e3,
            copy * 1e3
        );
        let (a, b) = producer_inputs(client, m, k);
        let mut group = c.benchmark_group("transfer_overlap");
        group.sample_size(10);
        for pipelined in [false, true] {
            let kind = if pipelined { "pipelined" } else { "serial" };
            group.bench_function(kind, |bench| {
                bench.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let mut pending = Vec::new();
                        for round in 0..K {
                            let produced = a.matmul(&b).unwrap().scale(round as f64).unwrap();
                            let p = publish(&mut session, produced);
                            let download = p.download_into(buffers.pop().unwrap()).unwrap();
                            if pipelined {
                                pending.push(download);
                            } else {
                                buffers.insert(0, download.wait().unwrap());
                            }
                        }
                        for d in pending {
                            buffers.insert(0, d.wait().unwrap());
                        }
                    }
                    let t = start.elapsed();
                    record(&format!("overlap/{kind}"), t, iters);
                    t
                })
            });
        }
        group.finish();
    }

    pub fn main() {
        let devices = result::init().and_then(|()| result::device::get_count());
        if !matches!(devices, Ok(n) if n > 0) {
            eprintln!("no CUDA device: nothing to measure");
            return;
        }
        let started = Instant::now();
        let mut c = Criterion::default()
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2))
            .configure_from_args();
        let client = StreamFusion::<Cube>::client(&Default::default());
        transfer_paths(&mut c, &client);
        costs(&mut c, &client);
        overlap(&mut c, &client);
        c.final_summary();

        println!("\n== transfer benchmark: medians ==");
        for bytes in [16usize, 64 << 10, 8 << 20, 256 << 20] {
            let size = label(bytes);
            let gbs =
                |path: &str| median(&format!("{path}/{size}")).map(|s| bytes as f64 / s / 1e9);
            let line: Vec<String> = [
                "download_into",
                "publish_download",
                "publish_await_download",
                "into_data",
                "read_one",
                "pageable",
                "raw",
                "sync_raw",
                "read_copy",
            ]
            .iter()
            .map(|p| format!("{p} {:.3} GB/s", gbs(p).unwrap_or(f64::NAN)))
            .collect();
            println!("  {size:>6}: {}", line.join("   "));
            for path in [
                "download_into",
                "publish_download",
                "publish_await_download",
            ] {
                for base in ["raw", "into_data", "read_one", "sync_raw", "read_copy"] {
                    if let (Some(ours), Some(theirs)) = (gbs(path), gbs(base)) {
                        println!("ratio {path}_vs_{base}_{size}: {:.3}", ours / theirs);
                    }
                }
            }
        }
        if let (Some(p), Some(f)) = (median("publish"), median("frontier_ready")) {
            println!(
                "publish: {:.2} us   frontier_ready: {:.3} us",
                p * 1e6,
                f * 1e6
            );
        }
        if let (Some(f), Some(s)) = (median("frontier"), median("cubecl_sync")) {
            println!(
                "frontier of a finished value: {:.2} us   cubecl sync of an idle stream: {:.2} us",
                f * 1e6,
                s * 1e6
            );
        }
        if let (Some(s), Some(p)) = (median("overlap/serial"), median("overlap/pipelined")) {
            println!(
                "overlap: serial {:.1} ms, pipelined {:.1} ms",
                s * 1e3,
                p * 1e3
            );
            println!("ratio overlap_vs_serial: {:.2}", s / p);
        }
        eprintln!("transfer benchmark finished in {:.1?}", started.elapsed());
    }
}
