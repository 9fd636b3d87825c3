//! A CPU profile of the backend bench's pipeline workload (producer threads → one consumer) on
//! `StreamFusion<CubeBackend>` and on plain `CubeBackend`, for the H200 runs of
//! docs/BENCHMARKS.md ("Drains through the shared tensor, measured"). Not part of the crate's
//! build: it needs `pprof`, which the crate does not depend on.
//!
//! Build here (x86-64, like the GPU machine), then run there with `CUDA_PATH` and
//! `LD_LIBRARY_PATH` set, keeping the binary's symbol table (do not strip it):
//!
//! ```text
//! cp ../../Cargo.lock . && CUDARC_CUDA_VERSION=13000 cargo build --release
//! COMPILE_LOG=/tmp/compile.log CALLS=10 ./target/release/pipeprof
//! ```
//!
//! With a `cubecl.toml` in the working directory that sends cubecl's compilation log
//! (`[compilation.logger] level = "basic"`) to `COMPILE_LOG`, each call's line also says how many
//! kernels were compiled during it. Output: per call, time and compilations; per thread name,
//! the functions where samples landed (self) and the frames they passed through (inclusive).
use std::collections::HashMap;
use std::time::{Duration, Instant};

use burn_backend::Backend;
use burn_tensor::{Tensor, TensorData};

type Plain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
type Ours = fusion_streams::backend::StreamFusion<Plain>;

fn data(n: usize, seed: usize) -> TensorData {
    TensorData::new(
        (0..n)
            .map(|i| (((i * 31 + seed) % 17) as f32 - 8.0) / 64.0)
            .collect::<Vec<_>>(),
        [n],
    )
}

fn pipeline<B: Backend>(device: &B::Device, producers: usize, each: usize) -> Duration {
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel::<Tensor<B, 1>>();
    std::thread::scope(|s| {
        for p in 0..producers {
            let (tx, device) = (tx.clone(), device.clone());
            std::thread::Builder::new()
                .name(format!("producer{p}"))
                .spawn_scoped(s, move || {
                    let base = Tensor::<B, 1>::from_data(data(1024, p), &device);
                    for i in 0..each {
                        tx.send((base.clone() * (i as f32) + 1.0).tanh() * 2.0)
                            .unwrap();
                    }
                })
                .unwrap();
        }
        drop(tx);
        let mut sum = Tensor::<B, 1>::zeros([1024], device);
        for t in rx.iter() {
            sum = sum + t;
        }
        std::hint::black_box(sum.into_data());
    });
    start.elapsed()
}

/// (thread name, cpu ticks) for every thread of this process.
fn thread_cpu() -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let p = e.path();
        let comm = std::fs::read_to_string(p.join("comm"))
            .unwrap_or_default()
            .trim()
            .to_string();
        let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
        let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 13 {
            let t = f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
            *out.entry(comm).or_insert(0) += t;
        }
    }
    out
}

fn profiled<B: Backend>(
    label: &str,
    device: &B::Device,
    producers: usize,
    each: usize,
    calls: usize,
) {
    // warm-up
    for _ in 0..3 {
        pipeline::<B>(device, producers, each);
    }
    let guard = pprof::ProfilerGuardBuilder::default()
        .frequency(4000)
        .build()
        .unwrap();
    let cpu0 = thread_cpu();
    let mut times = Vec::new();
    let log = std::env::var("COMPILE_LOG").ok();
    let lines = || {
        log.as_ref()
            .map(|l| {
                std::fs::read_to_string(l)
                    .map(|s| s.lines().count())
                    .unwrap_or(0)
            })
            .unwrap_or(0)
    };
    let mut per_call = Vec::new();
    for _ in 0..calls {
        let before = lines();
        let t = pipeline::<B>(device, producers, each);
        std::thread::sleep(Duration::from_millis(20));
        per_call.push(format!(
            "{:.1}ms/{}",
            t.as_secs_f64() * 1e3,
            lines() - before
        ));
        times.push(t);
    }
    println!(
        "{label} pipeline/{producers} per call (time/compile-log lines): {}",
        per_call.join(" ")
    );
    let cpu1 = thread_cpu();
    let report = guard.report().build().unwrap();
    times.sort();
    println!(
        "\n=== {label}: pipeline/{producers}, {calls} calls, median {:.2?} (min {:.2?}, max {:.2?})",
        times[calls / 2],
        times[0],
        times[calls - 1]
    );
    let mut cpu: Vec<_> = cpu1
        .iter()
        .map(|(k, v)| (k.clone(), v - cpu0.get(k).copied().unwrap_or(0)))
        .filter(|x| x.1 > 0)
        .collect();
    cpu.sort_by(|a, b| b.1.cmp(&a.1));
    println!("cpu ticks (10 ms) by thread name (live threads only): {cpu:?}");
    // aggregate samples per thread group
    let mut per_thread: HashMap<String, (u64, HashMap<String, u64>, HashMap<String, u64>)> =
        HashMap::new();
    for (frames, count) in report.data.iter() {
        let name = frames
            .thread_name
            .trim_end_matches(char::is_numeric)
            .to_string();
        let entry = per_thread.entry(name).or_default();
        entry.0 += *count as u64;
        let mut seen = std::collections::HashSet::new();
        for (depth, frame) in frames.frames.iter().enumerate() {
            for sym in frame {
                let n = sym.name();
                let n: String = n.chars().take(150).collect();
                if depth == 0 {
                    *entry.1.entry(n.clone()).or_default() += *count as u64;
                }
                if seen.insert(n.clone()) {
                    *entry.2.entry(n).or_default() += *count as u64;
                }
            }
        }
    }
    let mut threads: Vec<_> = per_thread.into_iter().collect();
    threads.sort_by(|a, b| b.1.0.cmp(&a.1.0));
    for (name, (total, selfs, incl)) in threads.iter().take(4) {
        println!("-- thread {name}: {total} samples");
        let mut s: Vec<_> = selfs.iter().collect();
        s.sort_by(|a, b| b.1.cmp(a.1));
        for (f, c) in s.iter().take(14) {
            println!("   self {:5.1}%  {f}", **c as f64 * 100.0 / *total as f64);
        }
        let mut s: Vec<_> = incl
            .iter()
            .filter(|(f, _)| {
                !f.contains("std::rt")
                    && !f.contains("__libc_start")
                    && !f.contains("thread::")
                    && !f.contains("clone3")
                    && !f.contains("start_thread")
                    && !f.contains("catch_unwind")
                    && !f.contains("__rust_begin")
                    && !f.contains("main")
            })
            .collect();
        s.sort_by(|a, b| b.1.cmp(a.1));
        for (f, c) in s.iter().take(40) {
            println!("   incl {:5.1}%  {f}", **c as f64 * 100.0 / *total as f64);
        }
    }
}

fn main() {
    let device = Default::default();
    let calls: usize = std::env::var("CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    for producers in [1usize, 4, 8] {
        profiled::<Ours>("ours", &device, producers, 200, calls);
        profiled::<Plain>("plain", &device, producers, 200, calls);
    }
}
